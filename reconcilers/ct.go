package reconcilers

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// CTMaps converges the ct-maps table into pinned conntrack maps: it opens
// each map with the desired size, reusing a pin whose attributes match and
// migrating the live entries of one that differs (see MigrateCT), and keeps
// the maps open for the ct cell's garbage collector and for other cells.
// It opens them through a bpf.Opener: the kernel's pins in the agent, maps
// in memory in tests. The datapath, not the agent, writes their entries,
// so it keeps no record of them (no Mirror).
//
// It implements reconciler.Operations[*tables.CTMap]. Update fills in the
// row's pin fields (ActualMaxEntries, Pin, Change, Copied, Dropped,
// Expired, Entries), which the reconciler stores with the status.
type CTMaps struct {
	log    *slog.Logger
	opener bpf.Opener
	pinDir string
	// clock returns the CT clock, in seconds; see bpf.CTClockNow.
	clock func() (uint32, error)

	// mu guards maps. Users of a map hold it for reading so that a
	// replacement never closes a file descriptor in use: a closed and
	// reused descriptor number would point them at another object.
	mu   sync.RWMutex
	maps map[string]bpf.Map
}

var _ reconciler.Operations[*tables.CTMap] = (*CTMaps)(nil)

// NewCTMaps returns the operations for conntrack maps pinned in pinDir,
// opened through opener (nil: bpf.KernelMaps). A nil log discards log
// messages.
func NewCTMaps(log *slog.Logger, opener bpf.Opener, pinDir string) *CTMaps {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if opener == nil {
		opener = bpf.KernelMaps
	}
	return &CTMaps{log: log, opener: opener, pinDir: pinDir, clock: bpf.CTClockNow, maps: map[string]bpf.Map{}}
}

// ErrCTMapNotOpen is returned by Use for a map that has not been reconciled
// (yet), or whose reconciliation failed.
var ErrCTMapNotOpen = errors.New("conntrack map not open")

// Use calls fn with the open conntrack map called name. fn must not keep the
// map after it returns: a later reconciliation may replace and close it.
func (c *CTMaps) Use(name string, fn func(bpf.Map) error) error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	m, ok := c.maps[name]
	if !ok {
		return fmt.Errorf("%s: %w", name, ErrCTMapNotOpen)
	}
	return fn(m)
}

// Names returns the names of the open maps, sorted.
func (c *CTMaps) Names() []string {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return slices.Sorted(maps.Keys(c.maps))
}

// Update opens or creates the pinned map the row asks for, migrating the
// live entries of a pin with other attributes, and records the outcome in
// the row.
func (c *CTMaps) Update(ctx context.Context, _ statedb.ReadTxn, _ statedb.Revision, row *tables.CTMap) error {
	spec, err := bpf.CTMapSpec(row.Name, row.MaxEntries)
	if err != nil {
		return err
	}

	var (
		mig     CTMigration
		migTime time.Duration
	)
	migrate := func(old, new bpf.Map) error {
		start := time.Now()
		defer func() { migTime = time.Since(start) }()
		now, err := c.clock()
		if err != nil {
			return err
		}
		mig, err = MigrateCT(ctx, old, new, now)
		if errors.Is(err, ErrCTLayoutChanged) {
			// Entries of another layout cannot be converted, and keeping the
			// old map would leave the datapath without a usable one.
			c.log.Warn("Conntrack map replaced without its entries, whose layout changed; tracked connections start over",
				"map", row.Name, "error", err)
			mig = CTMigration{}
			return nil
		}
		return err
	}

	// A pin of another layout is replaced too: migrate drops its entries.
	pm, err := c.opener.OpenMap(c.log, spec, c.pinDir, migrate, bpf.ReplaceOtherLayout)
	if err != nil {
		err = fmt.Errorf("conntrack map %s: %w", row.Name, err)
		if c.keepPinned(row, spec) {
			err = fmt.Errorf("%w; the pinned map of %d entries stays in service", err, row.ActualMaxEntries)
		}
		return err
	}
	c.install(row.Name, pm.Map)

	row.ActualMaxEntries = pm.MaxEntries()
	row.Pin = pm.Outcome.String()
	row.Change = pm.Mismatch
	row.Copied, row.Dropped, row.Expired = mig.Copied, mig.Dropped, mig.Expired
	if pm.Outcome == bpf.PinReplaced {
		row.Entries = mig.Copied
		log := c.log.Info
		if mig.Dropped > 0 {
			log = c.log.Warn
		}
		log("Resized conntrack map, keeping its live entries",
			"map", row.Name, "change", pm.Mismatch, "copied", mig.Copied, "dropped", mig.Dropped,
			"expired", mig.Expired, "duration", migTime)
	}
	return nil
}

// keepPinned opens the map pinned for row after a failed resize and keeps
// it in service, as long as its entries have the layout spec asks for: the
// datapath is better off with a map of the old size than with none. It
// records the pin in the row and reports whether it kept one.
func (c *CTMaps) keepPinned(row *tables.CTMap, spec *ebpf.MapSpec) bool {
	m, err := c.opener.LoadMap(c.pinDir, row.Name)
	if err != nil {
		return false
	}
	if m.KeySize() != spec.KeySize || m.ValueSize() != spec.ValueSize || m.Type() != spec.Type {
		m.Close()
		return false
	}
	c.install(row.Name, m)
	row.ActualMaxEntries = m.MaxEntries()
	row.Pin, row.Change = "kept", ""
	row.Copied, row.Dropped, row.Expired = 0, 0, 0
	c.log.Warn("Cannot resize conntrack map; the pinned one stays in service until a retry succeeds",
		"map", row.Name, "maxEntries", m.MaxEntries(), "wanted", spec.MaxEntries)
	return true
}

// install makes m the open map called name, closing the one it replaces.
func (c *CTMaps) install(name string, m bpf.Map) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.maps[name]; ok {
		old.Close()
	}
	c.maps[name] = m
}

// Delete closes the map of a row that was removed and removes its pin: a
// conntrack map that is no longer configured only holds kernel memory.
func (c *CTMaps) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, row *tables.CTMap) error {
	return c.remove(row.Name)
}

// Prune removes the pins of conntrack maps that are not desired, such as the
// IPv6 maps after IPv6 was disabled. Other files in the pin directory are
// left alone.
func (c *CTMaps) Prune(_ context.Context, _ statedb.ReadTxn, desired iter.Seq2[*tables.CTMap, statedb.Revision]) error {
	want := map[string]bool{}
	for row := range desired {
		want[row.Name] = true
	}
	var errs []error
	for _, name := range bpf.CTMapNames(true) {
		if want[name] {
			continue
		}
		if _, err := os.Stat(filepath.Join(c.pinDir, name)); err == nil {
			c.log.Info("Removing conntrack map that is no longer configured", "map", name)
		}
		errs = append(errs, c.remove(name))
	}
	return errors.Join(errs...)
}

func (c *CTMaps) remove(name string) error {
	c.mu.Lock()
	if m, ok := c.maps[name]; ok {
		m.Close()
		delete(c.maps, name)
	}
	c.mu.Unlock()
	return c.opener.RemoveMap(c.pinDir, name)
}

// Close closes every open map; their pins stay. Call it when the agent
// stops, after the reconciler and every user of the maps have stopped.
func (c *CTMaps) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	for name, m := range c.maps {
		errs = append(errs, m.Close())
		delete(c.maps, name)
	}
	return errors.Join(errs...)
}
