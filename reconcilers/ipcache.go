package reconcilers

import (
	"context"
	"errors"
	"iter"
	"log/slog"
	"net/netip"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// IPCache converges the ipcache table into the pinned ipcache LPM trie
// (NewIPCache), or the policy-prefixes table into the policy prefixes map,
// whose keys and values are the ipcache's (NewPolicyPrefixes).
//
// It keeps a copy of what the map holds, read from the map when it is opened,
// so that an entry whose value is already in the map costs no write: a
// restart with unchanged desired state writes nothing. Entries without an
// identity (Identity 0, allocation failed) are kept out of the map, so that
// the address falls back to the longest shorter prefix, or to world.
//
// It implements reconciler.Operations and reconciler.BatchOperations of
// *tables.IPCacheEntry.
type IPCache struct {
	log *slog.Logger
	// name is the map's (bpf.IPCacheMap, bpf.PolicyPrefixesMap); spec
	// gives its spec for a capacity.
	name string
	spec func(maxEntries uint32) *ebpf.MapSpec

	// mu guards m. Reconciler operations run one at a time, but Dump and
	// Close come from other goroutines.
	mu sync.Mutex
	m  *Mirror[bpf.IPCacheKey, bpf.IPCacheValue]
	// drift, if set, makes Prune a resync: the map is read and what
	// differs from the record is repaired.
	drift *Drift
}

var (
	_ reconciler.Operations[*tables.IPCacheEntry]      = (*IPCache)(nil)
	_ reconciler.BatchOperations[*tables.IPCacheEntry] = (*IPCache)(nil)
)

// NewIPCache returns operations on no map yet; call Open before the
// reconciler starts. A nil log discards log messages.
func NewIPCache(log *slog.Logger) *IPCache {
	return newPrefixMap(log, bpf.IPCacheMap, bpf.IPCacheMapSpec)
}

// NewPolicyPrefixes returns operations on the policy prefixes map
// (bpf.PolicyPrefixesMap), none open yet, as NewIPCache.
func NewPolicyPrefixes(log *slog.Logger) *IPCache {
	return newPrefixMap(log, bpf.PolicyPrefixesMap, bpf.PolicyPrefixesMapSpec)
}

func newPrefixMap(log *slog.Logger, name string, spec func(uint32) *ebpf.MapSpec) *IPCache {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &IPCache{log: log, name: name, spec: spec, m: NewMirror[bpf.IPCacheKey, bpf.IPCacheValue](name)}
}

// IPCacheRestored is an entry found in the pinned map when it was opened.
type IPCacheRestored struct {
	Prefix   netip.Prefix
	Identity uint32
}

// Open opens (or creates) the ipcache map pinned in pinDir with room for
// maxEntries, and returns the entries it already held, which tell the
// identity allocator which numbers the datapath is using. A pin of another
// size is replaced by a new map holding the old one's entries.
func (c *IPCache) Open(pinDir string, maxEntries uint32) ([]IPCacheRestored, error) {
	return c.OpenWith(bpf.KernelMaps, pinDir, maxEntries)
}

// OpenWith is Open with the maps of opener (bpf.KernelMaps in the agent).
func (c *IPCache) OpenWith(opener bpf.Opener, pinDir string, maxEntries uint32) ([]IPCacheRestored, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	pinned, err := c.m.Open(opener, c.log, c.spec(maxEntries), pinDir, nil)
	if err != nil {
		return nil, err
	}
	if pinned.Outcome != bpf.PinReused {
		c.log.Info("Prefix map", "map", c.name, "pin", pinned.Outcome, "change", pinned.Mismatch, "maxEntries", maxEntries)
	}
	var restored []IPCacheRestored
	for k, v := range c.m.All() {
		p, err := k.Prefix()
		if err != nil || k.ClusterID != 0 {
			continue // not ours to interpret; prune removes it
		}
		restored = append(restored, IPCacheRestored{Prefix: p, Identity: v.Identity})
	}
	return restored, nil
}

// Close closes the map; the pin stays.
func (c *IPCache) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m.Close()
}

// WithMap calls fn with the open ipcache map, for the datapath loader. fn
// must not keep it. A map in memory (tests) is refused.
func (c *IPCache) WithMap(fn func(*ebpf.Map) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m.Map() == nil {
		return c.m.errNotOpen()
	}
	km, err := bpf.KernelMap(c.m.Map())
	if err != nil {
		return err
	}
	return fn(km)
}

// Writes returns how many map updates and deletes the operations made.
func (c *IPCache) Writes() (updates, deletes uint64) {
	return c.m.Writes()
}

// Dump calls fn with the map's entries, read from the kernel.
func (c *IPCache) Dump(fn func(bpf.IPCacheKey, bpf.IPCacheValue)) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m.Dump(fn)
}

// desired returns the key of e and the value the map should hold for it;
// ok is false when the map should hold nothing.
func desired(e *tables.IPCacheEntry) (k bpf.IPCacheKey, v bpf.IPCacheValue, ok bool) {
	return bpf.NewIPCacheKey(e.Prefix), bpf.IPCacheValue{Identity: e.Identity}, e.Identity != 0
}

// Update implements reconciler.Operations.
func (c *IPCache) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, e *tables.IPCacheEntry) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	k, v, ok := desired(e)
	if !ok {
		return c.m.Delete(k)
	}
	return c.m.Put(k, v)
}

// Delete implements reconciler.Operations.
func (c *IPCache) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, e *tables.IPCacheEntry) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m.Delete(bpf.NewIPCacheKey(e.Prefix))
}

// ResyncWith makes every Prune first compare the map with what the
// operations wrote and repair it, reporting to d (nil: no resync).
func (c *IPCache) ResyncWith(d *Drift) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.drift = d
}

// Prune implements reconciler.Operations: it repairs drift of the map
// (ResyncWith), then entries the table doesn't hold (left by an earlier
// run, or for prefixes without identity) are deleted.
func (c *IPCache) Prune(_ context.Context, _ statedb.ReadTxn, objs iter.Seq2[*tables.IPCacheEntry, statedb.Revision]) error {
	want := map[bpf.IPCacheKey]struct{}{}
	for e := range objs {
		if k, _, ok := desired(e); ok {
			want[k] = struct{}{}
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	errs := []error{c.m.Resync(c.drift)}
	for k := range c.m.All() {
		if _, ok := want[k]; !ok {
			if err := c.m.Delete(k); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// UpdateBatch implements reconciler.BatchOperations: the entries whose value
// changed are written with batch updates; the entries of a batch that
// fails are written one by one so that each gets its own result.
func (c *IPCache) UpdateBatch(_ context.Context, _ statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.IPCacheEntry]) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var (
		keys   []bpf.IPCacheKey
		values []bpf.IPCacheValue
		idx    []int
	)
	for i := range batch {
		k, v, ok := desired(batch[i].Object)
		if !ok {
			batch[i].Result = c.m.Delete(k)
			continue
		}
		if c.m.Differs(k, v) {
			keys, values, idx = append(keys, k), append(values, v), append(idx, i)
		}
	}
	c.m.PutBatch(keys, values, func(i int, err error) bool {
		batch[idx[i]].Result = err
		return true
	})
}

// DeleteBatch implements reconciler.BatchOperations.
func (c *IPCache) DeleteBatch(_ context.Context, _ statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.IPCacheEntry]) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var (
		keys []bpf.IPCacheKey
		idx  []int
	)
	for i := range batch {
		k := bpf.NewIPCacheKey(batch[i].Object.Prefix)
		if _, ok := c.m.Get(k); ok {
			keys, idx = append(keys, k), append(idx, i)
		}
	}
	// Some key may have vanished meanwhile; one by one, a missing key is
	// not an error.
	c.m.DeleteBatch(keys, func(i int, err error) bool {
		batch[idx[i]].Result = err
		return true
	})
}
