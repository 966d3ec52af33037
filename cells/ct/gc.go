package ct

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// Bounds of the adaptive garbage collection interval.
const (
	gcInitialInterval = 5 * time.Minute
	gcMinInterval     = 10 * time.Second
	gcMaxInterval     = 12 * time.Hour
)

// gcBatch is the number of entries per batch lookup and delete. Beyond a few
// thousand the per-entry cost hardly drops, and the buffers stay small.
const gcBatch = 4096

// nextGCInterval adapts the garbage collection interval to the last run,
// which deleted the fraction deleted of the maximum entries of the fullest
// map: much deleted means entries expire faster than collected, so collect
// sooner; little deleted means collecting is mostly wasted work, so collect
// later.
func nextGCInterval(cur time.Duration, deleted float64) time.Duration {
	next := cur
	switch {
	case deleted > 0.25:
		next = time.Duration(float64(cur) * (1 - deleted))
	case deleted < 0.05:
		next = time.Duration(float64(cur) * 1.5)
	}
	return min(max(next, gcMinInterval), gcMaxInterval)
}

// gcResult is what one garbage collection of one map found.
type gcResult struct {
	name       string
	maxEntries uint32
	scanned    uint64
	deleted    uint64
	duration   time.Duration
}

func (r gcResult) alive() uint64 { return r.scanned - r.deleted }

// pressure is the fill ratio of the map after the run.
func (r gcResult) pressure() float64 {
	if r.maxEntries == 0 {
		return 0
	}
	return float64(r.alive()) / float64(r.maxEntries)
}

// CollectExpired deletes the entries of the conntrack map m whose lifetime
// lies before now, in seconds of the CT clock, with batch lookups and
// deletes. It returns how many entries it saw and how many it deleted.
//
// An entry the datapath refreshes between the lookup and the delete is
// deleted all the same; the datapath then tracks the connection anew.
func CollectExpired(ctx context.Context, m bpf.Map, now uint32) (scanned, deleted uint64, err error) {
	switch m.KeySize() {
	case bpf.CTKey4Size:
		return collectExpired[bpf.CTKey4](ctx, m, now)
	case bpf.CTKey6Size:
		return collectExpired[bpf.CTKey6](ctx, m, now)
	}
	return 0, 0, fmt.Errorf("key size %d is no conntrack key", m.KeySize())
}

func collectExpired[K bpf.CTKey](ctx context.Context, m bpf.Map, now uint32) (scanned, deleted uint64, err error) {
	expired := make([]K, 0, gcBatch)
	err = bpf.WalkCT(m, gcBatch, func(keys []K, values []bpf.CTEntry) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		scanned += uint64(len(keys))
		expired = expired[:0]
		for i := range values {
			if values[i].Expired(now) {
				expired = append(expired, keys[i])
			}
		}
		n, err := deleteKeys(m, expired)
		deleted += n
		return err
	})
	return scanned, deleted, err
}

// deleteKeys deletes keys from m with batch deletes and returns how many it
// deleted. Keys that are already gone (the datapath or the LRU removed them)
// are skipped.
func deleteKeys[K any](m bpf.Map, keys []K) (uint64, error) {
	var deleted uint64
	for len(keys) > 0 {
		n, err := m.BatchDelete(keys, nil)
		deleted += uint64(n)
		switch {
		case errors.Is(err, ebpf.ErrKeyNotExist):
			// The kernel stops at the first missing key.
			keys = keys[n+1:]
		case err != nil:
			return deleted, fmt.Errorf("delete expired entries: %w", err)
		default:
			return deleted, nil
		}
	}
	return deleted, nil
}

// gc is the conntrack garbage collector: a job of the ct cell that deletes
// expired entries from the maps the reconciler opened. The datapath only
// refreshes lifetimes; without it, closed connections would sit in the maps
// until the LRU evicts them, pushing out live ones.
//
// It writes no entry, and deletes only entries the datapath created: the
// agent never inserts a conntrack entry of its own (the reconciler only
// copies the datapath's live ones into a resized map). That is the rule
// for writers of BPF maps outside reconcilers (docs/architecture.md).
type gc struct {
	log     *slog.Logger
	db      *statedb.DB
	table   statedb.RWTable[*tables.CTMap]
	maps    *reconcilers.CTMaps
	metrics *ctMetrics
	// interval is --conntrack-gc-interval; 0 means adaptive.
	interval time.Duration

	// mu makes runs exclusive, whether started by the job or by ct/gc.
	mu sync.Mutex
}

func newGC(log *slog.Logger, db *statedb.DB, table statedb.RWTable[*tables.CTMap], maps *reconcilers.CTMaps,
	m *ctMetrics, cfg Config) *gc {
	return &gc{log: log, db: db, table: table, maps: maps, metrics: m, interval: cfg.ConntrackGCInterval}
}

// run is the garbage collection job: it waits until the maps are
// reconciled, collects right away (an agent that was down may find many
// expired entries), then again after every interval.
func (g *gc) run(ctx context.Context, health cell.Health) error {
	health.OK("Waiting for the conntrack maps to be reconciled")
	if err := g.waitReconciled(ctx); err != nil {
		return nil
	}
	interval := g.interval
	if interval == 0 {
		interval = gcInitialInterval
	}
	for {
		results, err := g.collect(ctx)
		if ctx.Err() != nil {
			return nil
		}
		var deleted, scanned uint64
		worst := 0.0
		for _, r := range results {
			deleted += r.deleted
			scanned += r.scanned
			if r.maxEntries > 0 {
				worst = max(worst, float64(r.deleted)/float64(r.maxEntries))
			}
		}
		if g.interval == 0 {
			interval = nextGCInterval(interval, worst)
		}
		g.metrics.interval.Set(interval.Seconds())
		if err != nil {
			health.Degraded("Conntrack garbage collection failed", err)
		} else {
			health.OK(fmt.Sprintf("Deleted %d expired of %d entries; next run in %s", deleted, scanned, interval))
		}

		select {
		case <-ctx.Done():
			return nil
		case <-time.After(interval):
		}
	}
}

// waitReconciled returns once no map waits for its first reconciliation.
func (g *gc) waitReconciled(ctx context.Context) error {
	for {
		rows, watch := g.table.AllWatch(g.db.ReadTxn())
		pending := false
		for row := range rows {
			pending = pending || row.Status.IsPendingOrRefreshing()
		}
		if !pending {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-watch:
		}
	}
}

// collect runs one garbage collection over every reconciled map and records
// the results in the table and the metrics. Maps that fail are reported in
// the error; the others are collected all the same.
func (g *gc) collect(ctx context.Context) ([]gcResult, error) {
	g.mu.Lock()
	defer g.mu.Unlock()

	start := time.Now()
	now, err := bpf.CTClockNow()
	if err != nil {
		return nil, err
	}
	var (
		results []gcResult
		errs    []error
	)
	for row := range g.table.All(g.db.ReadTxn()) {
		if row.Status.Kind != reconciler.StatusKindDone {
			continue
		}
		r := gcResult{name: row.Name, maxEntries: row.ActualMaxEntries}
		mapStart := time.Now()
		err := g.maps.Use(row.Name, func(m bpf.Map) error {
			var err error
			r.scanned, r.deleted, err = CollectExpired(ctx, m, now)
			return err
		})
		r.duration = time.Since(mapStart)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", row.Name, err))
			continue
		}
		g.log.Debug("Collected expired conntrack entries",
			"map", r.name, "deleted", r.deleted, "scanned", r.scanned, "duration", r.duration)
		g.metrics.observe(r)
		results = append(results, r)
	}
	g.record(results, start)
	return results, errors.Join(errs...)
}

// record stores the results of the run that started at start in the table,
// on the rows the reconciler is done with: a row waiting to be reconciled
// keeps its pending status and gets the next run's results.
func (g *gc) record(results []gcResult, start time.Time) {
	wtxn := g.db.WriteTxn(g.table)
	defer wtxn.Abort()
	for _, r := range results {
		row, _, found := g.table.Get(wtxn, tables.CTMapNameIndex.Query(r.name))
		if !found || row.Status.Kind != reconciler.StatusKindDone {
			continue
		}
		row = row.Clone()
		row.Entries, row.GCDeleted, row.LastGC = r.alive(), r.deleted, start
		g.table.Insert(wtxn, row) // cannot fail: wtxn is open and locks g.table
	}
	wtxn.Commit()
}
