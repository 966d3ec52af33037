package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
)

// Walk reads every entry of m with batch lookups of up to batchSize entries
// and calls fn with each batch. The slices are reused for the next batch, so
// fn must copy what it keeps. fn may delete the entries it is given: the
// walk's cursor only moves forward.
//
// Entries that others add or remove during the walk may or may not be seen,
// and one that moves between hash buckets may be seen twice.
func Walk[K, V any](m Map, batchSize int, fn func(keys []K, values []V) error) error {
	if batchSize <= 0 {
		return fmt.Errorf("walk map %s: batch size %d", m, batchSize)
	}
	keys := make([]K, batchSize)
	values := make([]V, batchSize)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, values, nil)
		done := errors.Is(err, ebpf.ErrKeyNotExist)
		if err != nil && !done {
			return err
		}
		if n > 0 {
			if err := fn(keys[:n], values[:n]); err != nil {
				return err
			}
		}
		if done {
			return nil
		}
	}
}

// CopyEntries copies every entry of src into dst with batch operations. It
// is the migration for maps whose entries stay valid as they are, such as
// the load-balancing maps after a change of size. If dst is smaller and
// fills up, the error says so and dst holds what fitted.
func CopyEntries[K, V any](src, dst *ebpf.Map) error {
	return Walk(src, 4096, func(keys []K, values []V) error {
		if _, err := dst.BatchUpdate(keys, values, nil); err != nil {
			return fmt.Errorf("copy %d entries into %s: %w", len(keys), dst, err)
		}
		return nil
	})
}
