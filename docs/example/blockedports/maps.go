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
	"github.com/apiary-net/apiary/reconcilers"
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

// ops are the reconciler's operations: they alone write the map. They
// stand on reconcilers.Mirror, the map layer: it opens the map through
// bpffs.Maps (pinned on bpffs in the agent, in memory in the script
// tests), reads what the map holds so that a restart writes nothing, and
// writes only what differs. The operations only turn rows into keys and
// values.
type ops struct {
	mu sync.Mutex
	m  *reconcilers.Mirror[MapKey, uint8]
}

var _ reconciler.Operations[*BlockedPort] = (*ops)(nil)

func (o *ops) open(opener bpf.Opener, pinDir string) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, err := o.m.Open(opener, nil, MapSpec(1024), pinDir, nil); err != nil {
		return fmt.Errorf("open %s: %w", MapName, err)
	}
	return nil
}

func (o *ops) close() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.m.Close()
}

// Update implements reconciler.Operations: the row's entry is written,
// unless the map holds it already.
func (o *ops) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, b *BlockedPort) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.m.Put(keyOf(b), 1)
}

// Delete implements reconciler.Operations: the row is gone, so is its
// entry.
func (o *ops) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, b *BlockedPort) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.m.Delete(keyOf(b))
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
	var errs []error
	for k := range o.m.All() {
		if !want[k] {
			errs = append(errs, o.m.Delete(k))
		}
	}
	return errors.Join(errs...)
}

// counts returns how many entries the operations wrote and deleted.
func (o *ops) counts() (writes, deletes uint64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.m.Writes()
}

// dump returns the map's keys, read from the map.
func (o *ops) dump() ([]MapKey, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []MapKey
	err := o.m.Dump(func(k MapKey, _ uint8) { out = append(out, k) })
	return out, err
}
