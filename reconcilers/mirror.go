package reconcilers

import (
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"maps"
	"sync/atomic"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
)

// Mirror is one pinned BPF map together with the record of what the agent
// wrote into it: the map layer every reconciler of a map stands on, so that
// it only turns rows into keys and values. It
//
//   - opens the map through a bpf.Opener (the kernel's maps, or maps in
//     memory with bpf/memmap, whose Faulty injects faults), migrating the
//     entries of a pin of another size (bpf.CopyEntries unless told
//     otherwise);
//   - reads what the map holds when it is opened, so that a restart with
//     unchanged desired state writes nothing;
//   - writes and deletes an entry only when the record says it differs,
//     in batches with a one-by-one fallback that gives each failed entry
//     its own error;
//   - repairs drift (Resync): what the map holds against the record,
//     reported to a Drift.
//
// A Mirror is not safe for concurrent use: its owner serializes the calls
// (the reconcilers hold their own mutex around them).
type Mirror[K, V comparable] struct {
	name string
	m    bpf.Map
	rec  map[K]V

	// writeErr, if set, turns the error of one failed write of key k into
	// the one reported (the policy map's "full: raise --flag").
	writeErr func(k K, err error) error
	// added and removed, if set, are told of every key the record gains
	// or loses, for an index the owner keeps beside it.
	added, removed func(K)

	writes, deletes atomic.Uint64
}

// NewMirror returns the mirror of the map called name (used in errors and
// drift reports), none open yet.
func NewMirror[K, V comparable](name string) *Mirror[K, V] {
	return &Mirror[K, V]{name: name, rec: map[K]V{}}
}

// mirrorBatch bounds the entries of one batch syscall: the gain per entry
// is small beyond about a thousand (docs/benchmarks.md), and the kernel
// copies the whole batch in.
const mirrorBatch = 4096

// OnWriteError makes fn build the error of a failed single write of k
// (nil: "write NAME entry K: ERR").
func (m *Mirror[K, V]) OnWriteError(fn func(k K, err error) error) { m.writeErr = fn }

// Track has added and removed told of every key the record gains and
// loses (including those read by Open), for an index kept beside it.
func (m *Mirror[K, V]) Track(added, removed func(K)) { m.added, m.removed = added, removed }

// Name returns the map's name.
func (m *Mirror[K, V]) Name() string { return m.name }

// Open opens (or creates) the map of spec pinned in pinDir through opener
// and reads what it holds into the record, replacing a map opened before.
// migrate moves the entries of a pin of another size (nil: every entry,
// bpf.CopyEntries). The returned map says how the pin was obtained; its
// Map is the mirror's, not to be closed by the caller.
func (m *Mirror[K, V]) Open(opener bpf.Opener, log *slog.Logger, spec *ebpf.MapSpec, pinDir string, migrate bpf.MigrateFunc) (*bpf.OpenedMap, error) {
	if migrate == nil {
		migrate = bpf.CopyEntries[K, V]
	}
	opened, err := opener.OpenMap(log, spec, pinDir, migrate)
	if err != nil {
		return nil, err
	}
	rec := map[K]V{}
	err = bpf.Walk(opened.Map, 1024, func(keys []K, values []V) error {
		for i, k := range keys {
			rec[k] = values[i]
		}
		return nil
	})
	if err != nil {
		opened.Close()
		return nil, fmt.Errorf("read %s: %w", opened.Path, err)
	}
	if m.m != nil {
		m.m.Close()
	}
	if m.removed != nil {
		for k := range m.rec {
			m.removed(k)
		}
	}
	m.m, m.rec = opened.Map, rec
	if m.added != nil {
		for k := range rec {
			m.added(k)
		}
	}
	return opened, nil
}

// Close closes the map; the pin stays. The record stays too (a later Open
// replaces it).
func (m *Mirror[K, V]) Close() error {
	if m.m == nil {
		return nil
	}
	err := m.m.Close()
	m.m = nil
	return err
}

// Map returns the open map, or nil.
func (m *Mirror[K, V]) Map() bpf.Map { return m.m }

// errNotOpen is the error of an operation on a map not open.
func (m *Mirror[K, V]) errNotOpen() error { return fmt.Errorf("%s map not open", m.name) }

// Get returns what the record says the map holds for k.
func (m *Mirror[K, V]) Get(k K) (V, bool) {
	v, ok := m.rec[k]
	return v, ok
}

// Differs reports whether the map does not hold v for k, as far as the
// record knows.
func (m *Mirror[K, V]) Differs(k K, v V) bool {
	old, ok := m.rec[k]
	return !ok || old != v
}

// Len returns how many entries the record holds.
func (m *Mirror[K, V]) Len() int { return len(m.rec) }

// All yields the record's entries. The caller may delete the entry it is
// given (Go's map iteration allows it), but nothing else.
func (m *Mirror[K, V]) All() iter.Seq2[K, V] { return maps.All(m.rec) }

// Writes returns how many entries the mirror wrote and deleted.
func (m *Mirror[K, V]) Writes() (updates, deletes uint64) {
	return m.writes.Load(), m.deletes.Load()
}

func (m *Mirror[K, V]) record(k K, v V) {
	if _, ok := m.rec[k]; !ok && m.added != nil {
		m.added(k)
	}
	m.rec[k] = v
}

func (m *Mirror[K, V]) forget(k K) {
	if _, ok := m.rec[k]; !ok {
		return
	}
	delete(m.rec, k)
	if m.removed != nil {
		m.removed(k)
	}
}

// Put writes v for k unless the record says the map holds it already.
func (m *Mirror[K, V]) Put(k K, v V) error {
	if !m.Differs(k, v) {
		return nil
	}
	if m.m == nil {
		return m.errNotOpen()
	}
	if err := m.m.Put(k, v); err != nil {
		if m.writeErr != nil {
			return m.writeErr(k, err)
		}
		return fmt.Errorf("write %s entry %v: %w", m.name, k, err)
	}
	m.writes.Add(1)
	m.record(k, v)
	return nil
}

// Delete deletes k unless the record says the map does not hold it; a key
// already gone from the map is no error.
func (m *Mirror[K, V]) Delete(k K) error {
	if _, ok := m.rec[k]; !ok {
		return nil
	}
	if m.m == nil {
		return m.errNotOpen()
	}
	if err := m.m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete %s entry %v: %w", m.name, k, err)
	}
	m.deletes.Add(1)
	m.forget(k)
	return nil
}

// PutBatch writes values[i] for keys[i], the entries the caller found to
// differ (Differs), with batch updates of up to mirrorBatch entries, one
// syscall each. When a batch fails, its entry that failed and every one
// after it are written one by one (Put), so that an error names its entry
// and a full map is reported as such: failed is called with the index and
// error of each that fails, and stops the writes by returning false.
func (m *Mirror[K, V]) PutBatch(keys []K, values []V, failed func(i int, err error) bool) {
	off := 0
	for off < len(keys) && m.m != nil {
		n := min(len(keys)-off, mirrorBatch)
		done, err := m.m.BatchUpdate(keys[off:off+n], values[off:off+n], nil)
		done = max(0, min(done, n))
		if err != nil && done == n {
			done = 0 // a count not to be trusted: write them one by one
		}
		// The entries before a failure are written: the record must know
		// them, or a later delete would skip them.
		for i := off; i < off+done; i++ {
			m.record(keys[i], values[i])
		}
		m.writes.Add(uint64(done))
		off += done
		if err != nil {
			break
		}
	}
	for i := off; i < len(keys); i++ {
		if err := m.Put(keys[i], values[i]); err != nil && !failed(i, err) {
			return
		}
	}
}

// DeleteBatch deletes keys with batch deletes, as PutBatch writes; the
// caller passes keys the record holds. A batch that fails (a key already
// gone from the map, say) is finished one by one (Delete), failed being
// called as PutBatch calls it.
func (m *Mirror[K, V]) DeleteBatch(keys []K, failed func(i int, err error) bool) {
	off := 0
	for off < len(keys) && m.m != nil {
		n := min(len(keys)-off, mirrorBatch)
		done, err := m.m.BatchDelete(keys[off:off+n], nil)
		done = max(0, min(done, n))
		if err != nil && done == n {
			done = 0
		}
		for _, k := range keys[off : off+done] {
			m.forget(k)
		}
		m.deletes.Add(uint64(done))
		off += done
		if err != nil {
			break
		}
	}
	for i := off; i < len(keys); i++ {
		if err := m.Delete(keys[i]); err != nil && !failed(i, err) {
			return
		}
	}
}

// Resync compares the map with the record and repairs it (see resyncMap),
// reporting what it repaired to d under the map's name. A nil d, or a map
// not open, does nothing.
func (m *Mirror[K, V]) Resync(d *Drift) error {
	if d == nil || m.m == nil {
		return nil
	}
	c, err := resyncMap(m.m, m.rec)
	return errors.Join(err, d.Report(m.name, c))
}

// Dump calls fn with the map's entries, read from the map (not the
// record).
func (m *Mirror[K, V]) Dump(fn func(K, V)) error {
	if m.m == nil {
		return m.errNotOpen()
	}
	return bpf.Walk(m.m, 1024, func(keys []K, values []V) error {
		for i, k := range keys {
			fn(k, values[i])
		}
		return nil
	})
}

// firstErrors returns a failed callback for PutBatch and DeleteBatch that
// collects up to limit errors into *errs.
func firstErrors(errs *[]error, limit int) func(int, error) bool {
	return func(_ int, err error) bool {
		*errs = append(*errs, err)
		return len(*errs) < limit
	}
}
