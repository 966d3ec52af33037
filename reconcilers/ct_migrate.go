package reconcilers

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
)

// migrateBatch is the number of entries per batch lookup and update when a
// conntrack map is copied. Beyond a few thousand the per-entry cost hardly
// drops (measured in the project's bpf-limits reference), and the buffers
// stay under 1 MiB.
const migrateBatch = 8192

// lruLocalFree is how many free elements the kernel moves at a time from an
// LRU hash's global free list to a CPU's local one (LOCAL_FREE_TARGET in
// kernel/bpf/bpf_lru_list.c). Once fewer than that are left globally, an
// insertion evicts entries even though other CPUs still hold free ones.
const lruLocalFree = 128

// CTMigration says what a resize of a conntrack map carried over.
type CTMigration struct {
	// Copied is how many live entries are in the new map.
	Copied uint64
	// Dropped is how many live entries did not fit into the new map: those
	// that expire first.
	Dropped uint64
	// Expired is how many expired entries were left behind.
	Expired uint64
}

// ErrCTLayoutChanged means that a conntrack map's entries cannot be copied
// into its replacement because their byte layout differs.
var ErrCTLayoutChanged = errors.New("conntrack entry layout changed")

// MigrateCT copies the live entries of the conntrack map old into new, which
// is empty and may be smaller or larger, and reports what it copied. Entries
// whose lifetime lies before now (in seconds of the CT clock) are left
// behind. If the live entries do not all fit, the ones that expire last are
// kept.
//
// When the key or value size differs between the maps the entries cannot be
// converted, so nothing is copied and an error matching
// ErrCTLayoutChanged is returned.
func MigrateCT(ctx context.Context, old, new bpf.Map, now uint32) (CTMigration, error) {
	if old.KeySize() != new.KeySize() || old.ValueSize() != new.ValueSize() {
		return CTMigration{}, fmt.Errorf("%w: key/value size %d/%d → %d/%d",
			ErrCTLayoutChanged, old.KeySize(), old.ValueSize(), new.KeySize(), new.ValueSize())
	}
	if new.ValueSize() == bpf.CTEntrySize {
		switch new.KeySize() {
		case bpf.CTKey4Size:
			return migrateCT[bpf.CTKey4](ctx, old, new, now)
		case bpf.CTKey6Size:
			return migrateCT[bpf.CTKey6](ctx, old, new, now)
		}
	}
	return CTMigration{}, fmt.Errorf("%w: key/value size %d/%d is no conntrack layout",
		ErrCTLayoutChanged, new.KeySize(), new.ValueSize())
}

func migrateCT[K bpf.CTKey](ctx context.Context, old, new bpf.Map, now uint32) (CTMigration, error) {
	budget := lruBudget(new.MaxEntries())
	if old.MaxEntries() <= budget {
		// Whatever the old map holds fits: copy batch by batch without
		// holding the whole map in memory.
		return streamCT[K](ctx, old, new, now)
	}
	return selectCT[K](ctx, old, new, now, budget)
}

// lruBudget returns how many entries user space can insert into an empty LRU
// hash of maxEntries without the kernel evicting any: each CPU that inserts
// may strand up to lruLocalFree free elements in its local list. Capped so
// that small maps on machines with many CPUs still get most of their room;
// selectCT counts what survived in that case.
func lruBudget(maxEntries uint32) uint32 {
	cpus, err := ebpf.PossibleCPU()
	if err != nil || cpus < 1 {
		cpus = runtime.NumCPU()
	}
	headroom := min(uint64(lruLocalFree)*uint64(cpus), uint64(maxEntries/4))
	return maxEntries - uint32(headroom)
}

// ctChunk is one batch of conntrack entries.
type ctChunk[K bpf.CTKey] struct {
	keys   []K
	values []bpf.CTEntry
}

func newCTChunk[K bpf.CTKey](n int) *ctChunk[K] {
	return &ctChunk[K]{keys: make([]K, n), values: make([]bpf.CTEntry, n)}
}

// streamCT copies every live entry of old into new as it reads old. A
// goroutine reads the next batch while this one writes the last, so that
// the copy takes about as long as the slower of the two (writing) rather
// than their sum.
func streamCT[K bpf.CTKey](ctx context.Context, old, new bpf.Map, now uint32) (CTMigration, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	// Two buffers circulate: one being read into, one being written out.
	free := make(chan *ctChunk[K], 2)
	free <- newCTChunk[K](migrateBatch)
	free <- newCTChunk[K](migrateBatch)
	full := make(chan *ctChunk[K])
	readErr := make(chan error, 1)
	go func() {
		defer close(full)
		readErr <- readCT(ctx, old, free, full)
	}()

	var (
		res CTMigration
		err error
	)
	for c := range full {
		if err == nil {
			// Checked here as well as by the reader: a select between a
			// cancelled context and a ready channel may pick either.
			err = ctx.Err()
		}
		if err == nil {
			n := compactLive(c.keys, c.values, now)
			res.Expired += uint64(len(c.keys) - n)
			if n > 0 {
				var done int
				done, err = new.BatchUpdate(c.keys[:n], c.values[:n], nil)
				res.Copied += uint64(done)
				if err != nil {
					err = fmt.Errorf("copy entries: %w", err)
					cancel()
				}
			}
		}
		free <- c
	}
	if rerr := <-readErr; err == nil {
		err = rerr
	}
	return res, err
}

// readCT reads m batch by batch into the chunks it takes from free and
// sends them, cut to the entries read, to full.
func readCT[K bpf.CTKey](ctx context.Context, m bpf.Map, free <-chan *ctChunk[K], full chan<- *ctChunk[K]) error {
	var cursor ebpf.MapBatchCursor
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		var c *ctChunk[K]
		select {
		case <-ctx.Done():
			return ctx.Err()
		case c = <-free:
		}
		c.keys, c.values = c.keys[:cap(c.keys)], c.values[:cap(c.values)]
		n, err := m.BatchLookup(&cursor, c.keys, c.values, nil)
		done := errors.Is(err, ebpf.ErrKeyNotExist)
		if err != nil && !done {
			return fmt.Errorf("read entries: %w", err)
		}
		if n > 0 {
			c.keys, c.values = c.keys[:n], c.values[:n]
			select {
			case <-ctx.Done():
				return ctx.Err()
			case full <- c:
			}
		}
		if done {
			return nil
		}
	}
}

// selectCT reads every live entry of old and copies those that expire last
// into new, up to budget of them, in the order they expire: should the LRU
// evict anyway, it evicts the entry inserted first, which expires first.
func selectCT[K bpf.CTKey](ctx context.Context, old, new bpf.Map, now uint32, budget uint32) (CTMigration, error) {
	var (
		res CTMigration
		// Chunks rather than one growing slice: appending half a million
		// entries would copy them over and over.
		chunks []*ctChunk[K]
		live   uint64
	)
	err := bpf.WalkCT(old, migrateBatch, func(keys []K, values []bpf.CTEntry) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := compactLive(keys, values, now)
		res.Expired += uint64(len(keys) - n)
		if n > 0 {
			c := newCTChunk[K](n)
			copy(c.keys, keys)
			copy(c.values, values)
			chunks = append(chunks, c)
			live += uint64(n)
		}
		return nil
	})
	if err != nil {
		return res, err
	}

	write := func(keys []K, values []bpf.CTEntry) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		done, err := new.BatchUpdate(keys, values, nil)
		res.Copied += uint64(done)
		if err != nil {
			return fmt.Errorf("copy entries: %w", err)
		}
		return nil
	}

	if live <= uint64(budget) {
		for _, c := range chunks {
			if err := write(c.keys, c.values); err != nil {
				return res, err
			}
		}
		return res, nil
	}

	// Sort by lifetime, ties by position, packed into one integer so that
	// sorting half a million entries stays cheap. The position counts live
	// entries across chunks, so it stays below the old map's size.
	order := make([]uint64, 0, live)
	starts := make([]int, len(chunks))
	pos := 0
	for ci, c := range chunks {
		starts[ci] = pos
		for i := range c.values {
			order = append(order, uint64(c.values[i].Lifetime)<<32|uint64(pos))
			pos++
		}
	}
	slices.Sort(order)
	batch := newCTChunk[K](migrateBatch)
	n := 0
	for _, o := range order[live-uint64(budget):] {
		pos := int(uint32(o))
		ci, _ := slices.BinarySearch(starts, pos)
		if ci == len(starts) || starts[ci] > pos {
			ci--
		}
		c, i := chunks[ci], pos-starts[ci]
		batch.keys[n], batch.values[n] = c.keys[i], c.values[i]
		if n++; n == migrateBatch {
			if err := write(batch.keys, batch.values); err != nil {
				return res, err
			}
			n = 0
		}
	}
	if n > 0 {
		if err := write(batch.keys[:n], batch.values[:n]); err != nil {
			return res, err
		}
	}

	// The new map is at its budget, where the LRU may have evicted some of
	// what was inserted (see lruBudget): report what it really holds.
	count, err := countCT[K](new)
	if err != nil {
		return res, err
	}
	res.Copied = min(count, res.Copied)
	res.Dropped = live - res.Copied
	return res, nil
}

// compactLive moves the live entries of keys and values to the front, in
// order, and returns how many there are.
func compactLive[K any](keys []K, values []bpf.CTEntry, now uint32) int {
	n := 0
	for i := range values {
		if values[i].Expired(now) {
			continue
		}
		keys[n], values[n] = keys[i], values[i]
		n++
	}
	return n
}

// countCT returns the number of entries in m.
func countCT[K bpf.CTKey](m bpf.Map) (uint64, error) {
	var n uint64
	err := bpf.WalkCT(m, migrateBatch, func(keys []K, _ []bpf.CTEntry) error {
		n += uint64(len(keys))
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("count entries: %w", err)
	}
	return n, nil
}
