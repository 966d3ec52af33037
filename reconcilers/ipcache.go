package reconcilers

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"

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

	// mu guards m and shadow. Reconciler operations run one at a time, but
	// Dump and Close come from other goroutines.
	mu     sync.Mutex
	m      bpf.Map
	shadow map[bpf.IPCacheKey]bpf.IPCacheValue
	// drift, if set, makes Prune a resync: the map is read and what
	// differs from shadow is repaired.
	drift *Drift

	writes, deletes atomic.Uint64
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
	return &IPCache{log: log, name: name, spec: spec, shadow: map[bpf.IPCacheKey]bpf.IPCacheValue{}}
}

// errNotOpen is the error of an operation before Open.
func (c *IPCache) errNotOpen() error { return fmt.Errorf("%s map not open", c.name) }

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
	pinned, err := opener.OpenMap(c.log, c.spec(maxEntries), pinDir, copyIPCache)
	if err != nil {
		return nil, err
	}
	if pinned.Outcome != bpf.PinReused {
		c.log.Info("Prefix map", "map", c.name, "pin", pinned.Outcome, "change", pinned.Mismatch, "maxEntries", maxEntries)
	}
	shadow, err := readIPCache(pinned.Map)
	if err != nil {
		pinned.Close()
		return nil, fmt.Errorf("read %s: %w", pinned.Path, err)
	}
	var restored []IPCacheRestored
	for k, v := range shadow {
		p, err := k.Prefix()
		if err != nil || k.ClusterID != 0 {
			continue // not ours to interpret; prune removes it
		}
		restored = append(restored, IPCacheRestored{Prefix: p, Identity: v.Identity})
	}
	c.mu.Lock()
	c.m, c.shadow = pinned.Map, shadow
	c.mu.Unlock()
	return restored, nil
}

// Close closes the map; the pin stays.
func (c *IPCache) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		return nil
	}
	err := c.m.Close()
	c.m = nil
	return err
}

// WithMap calls fn with the open ipcache map, for the datapath loader. fn
// must not keep it. A map in memory (tests) is refused.
func (c *IPCache) WithMap(fn func(*ebpf.Map) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		return c.errNotOpen()
	}
	km, err := bpf.KernelMap(c.m)
	if err != nil {
		return err
	}
	return fn(km)
}

// Writes returns how many map updates and deletes the operations made.
func (c *IPCache) Writes() (updates, deletes uint64) {
	return c.writes.Load(), c.deletes.Load()
}

// Dump calls fn with the map's entries, read from the kernel.
func (c *IPCache) Dump(fn func(bpf.IPCacheKey, bpf.IPCacheValue)) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		return c.errNotOpen()
	}
	entries, err := readIPCache(c.m)
	if err != nil {
		return err
	}
	for k, v := range entries {
		fn(k, v)
	}
	return nil
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
		return c.deleteLocked(k)
	}
	return c.putLocked(k, v)
}

// Delete implements reconciler.Operations.
func (c *IPCache) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, e *tables.IPCacheEntry) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.deleteLocked(bpf.NewIPCacheKey(e.Prefix))
}

func (c *IPCache) putLocked(k bpf.IPCacheKey, v bpf.IPCacheValue) error {
	if old, ok := c.shadow[k]; ok && old == v {
		return nil
	}
	if c.m == nil {
		return c.errNotOpen()
	}
	if err := c.m.Put(k, v); err != nil {
		return fmt.Errorf("write %s entry: %w", c.name, err)
	}
	c.writes.Add(1)
	c.shadow[k] = v
	return nil
}

func (c *IPCache) deleteLocked(k bpf.IPCacheKey) error {
	if _, ok := c.shadow[k]; !ok {
		return nil
	}
	if c.m == nil {
		return c.errNotOpen()
	}
	if err := c.m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete %s entry: %w", c.name, err)
	}
	c.deletes.Add(1)
	delete(c.shadow, k)
	return nil
}

// ResyncWith makes every Prune first compare the map with what the
// operations wrote and repair it, reporting to d (nil: no resync).
func (c *IPCache) ResyncWith(d *Drift) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.drift = d
}

// resyncLocked repairs drift of the map (see resyncMap).
func (c *IPCache) resyncLocked() error {
	if c.drift == nil || c.m == nil {
		return nil
	}
	n, err := resyncMap(c.m, c.shadow)
	return errors.Join(err, c.drift.Report(c.name, n))
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
	errs := []error{c.resyncLocked()}
	for k := range c.shadow {
		if _, ok := want[k]; !ok {
			if err := c.deleteLocked(k); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// UpdateBatch implements reconciler.BatchOperations: the entries whose value
// changed are written with one batch update; if that fails they are written
// one by one so that each gets its own result.
func (c *IPCache) UpdateBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.IPCacheEntry]) {
	c.mu.Lock()
	var (
		keys   []bpf.IPCacheKey
		values []bpf.IPCacheValue
		idx    []int
	)
	for i := range batch {
		k, v, ok := desired(batch[i].Object)
		if !ok {
			batch[i].Result = c.deleteLocked(k)
			continue
		}
		if old, ok := c.shadow[k]; ok && old == v {
			continue
		}
		keys, values, idx = append(keys, k), append(values, v), append(idx, i)
	}
	if len(keys) == 0 {
		c.mu.Unlock()
		return
	}
	var (
		n   int
		err error
	)
	if c.m == nil {
		err = c.errNotOpen()
	} else {
		n, err = c.m.BatchUpdate(keys, values, nil)
	}
	// The entries before a failure are written: the record must know
	// them, or a later delete would skip them.
	for i, k := range keys[:n] {
		c.shadow[k] = values[i]
	}
	c.writes.Add(uint64(n))
	c.mu.Unlock()
	if err == nil {
		return
	}
	for _, i := range idx[n:] {
		batch[i].Result = c.Update(ctx, txn, batch[i].Revision, batch[i].Object)
	}
}

// DeleteBatch implements reconciler.BatchOperations.
func (c *IPCache) DeleteBatch(ctx context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.IPCacheEntry]) {
	c.mu.Lock()
	var (
		keys []bpf.IPCacheKey
		idx  []int
	)
	for i := range batch {
		k := bpf.NewIPCacheKey(batch[i].Object.Prefix)
		if _, ok := c.shadow[k]; ok {
			keys, idx = append(keys, k), append(idx, i)
		}
	}
	if len(keys) == 0 {
		c.mu.Unlock()
		return
	}
	var (
		n   int
		err error
	)
	if c.m == nil {
		err = c.errNotOpen()
	} else {
		n, err = c.m.BatchDelete(keys, nil)
	}
	for _, k := range keys[:n] {
		delete(c.shadow, k)
	}
	c.deletes.Add(uint64(n))
	c.mu.Unlock()
	if err == nil {
		return
	}
	// Some key may have vanished meanwhile; one by one, a missing key is
	// not an error.
	for _, i := range idx[n:] {
		batch[i].Result = c.Delete(ctx, txn, batch[i].Revision, batch[i].Object)
	}
}

// readIPCache reads every entry of an ipcache map with batch lookups.
func readIPCache(m bpf.Map) (map[bpf.IPCacheKey]bpf.IPCacheValue, error) {
	out := map[bpf.IPCacheKey]bpf.IPCacheValue{}
	keys := make([]bpf.IPCacheKey, 1024)
	values := make([]bpf.IPCacheValue, 1024)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, values, nil)
		for i := range n {
			out[keys[i]] = values[i]
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

// copyIPCache is the migration of a resized ipcache map: every entry moves.
func copyIPCache(old, new *ebpf.Map) error {
	entries, err := readIPCache(old)
	if err != nil {
		return fmt.Errorf("read old ipcache map: %w", err)
	}
	keys := make([]bpf.IPCacheKey, 0, len(entries))
	values := make([]bpf.IPCacheValue, 0, len(entries))
	for k, v := range entries {
		keys, values = append(keys, k), append(values, v)
	}
	if len(keys) == 0 {
		return nil
	}
	if _, err := new.BatchUpdate(keys, values, nil); err != nil {
		return fmt.Errorf("copy %d ipcache entries: %w", len(keys), err)
	}
	return nil
}
