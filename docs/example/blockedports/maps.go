package blockedports

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
)

// MapName is the name the map is pinned under in --bpf-pin-dir.
const MapName = "example_blocked"

// MapKey is the map's key: what a datapath program looks up. Its layout
// must match the program's C struct; bpf.CheckLayout checks Go types
// against a spec.
type MapKey struct {
	Port  bpf.Be16 // network byte order, as in the packet
	Proto uint8
	_     uint8
}

// MapSpec is the map's spec, with room for maxEntries ports.
func MapSpec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{Name: MapName, Type: ebpf.Hash, KeySize: 4, ValueSize: 1, MaxEntries: maxEntries}
}

func keyOf(b *BlockedPort) MapKey {
	return MapKey{Port: bpf.NewBe16(b.Port), Proto: uint8(b.Proto)}
}

// ops are the reconciler's operations: they alone write the map. The map
// is a bpf.Map, opened through bpffs.Maps: pinned on bpffs in the agent,
// in memory in the script tests.
type ops struct {
	mu sync.Mutex
	m  bpf.Map
	// writes and deletes count map operations, for the scripts.
	writes, deletes int
}

var _ reconciler.Operations[*BlockedPort] = (*ops)(nil)

func (o *ops) open(opener bpf.Opener, pinDir string) error {
	om, err := opener.OpenMap(nil, MapSpec(1024), pinDir, nil)
	if err != nil {
		return fmt.Errorf("open %s: %w", MapName, err)
	}
	o.mu.Lock()
	o.m = om.Map
	o.mu.Unlock()
	return nil
}

func (o *ops) close() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.m == nil {
		return nil
	}
	err := o.m.Close()
	o.m = nil
	return err
}

// Update implements reconciler.Operations: the row's entry is written.
func (o *ops) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, b *BlockedPort) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.m == nil {
		return errors.New("map not open")
	}
	if err := o.m.Put(keyOf(b), uint8(1)); err != nil {
		return fmt.Errorf("write %s: %w", b.Key(), err)
	}
	o.writes++
	return nil
}

// Delete implements reconciler.Operations: the row is gone, so is its
// entry.
func (o *ops) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, b *BlockedPort) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.m == nil {
		return errors.New("map not open")
	}
	err := o.m.Delete(keyOf(b))
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete %s: %w", b.Key(), err)
	}
	o.deletes++
	return nil
}

// Prune implements reconciler.Operations: entries no row explains (left
// by an earlier run whose configuration differed) are deleted. The
// reconciler calls it only once the table is initialized: before that,
// desired holds only part of what the agent wants.
func (o *ops) Prune(_ context.Context, _ statedb.ReadTxn, desired iter.Seq2[*BlockedPort, statedb.Revision]) error {
	want := map[MapKey]bool{}
	for b := range desired {
		want[keyOf(b)] = true
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.m == nil {
		return errors.New("map not open")
	}
	var stray []MapKey
	err := bpf.Walk(o.m, 256, func(keys []MapKey, _ []uint8) error {
		for _, k := range keys {
			if !want[k] {
				stray = append(stray, k)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", MapName, err)
	}
	var errs []error
	for _, k := range stray {
		if err := o.m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
			continue
		}
		o.deletes++
	}
	return errors.Join(errs...)
}

// dump returns the map's entries as "<port>/<proto>", sorted by the map.
func (o *ops) dump() ([]MapKey, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.m == nil {
		return nil, errors.New("map not open")
	}
	var out []MapKey
	err := bpf.Walk(o.m, 256, func(keys []MapKey, _ []uint8) error {
		out = append(out, keys...)
		return nil
	})
	return out, err
}
