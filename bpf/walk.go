package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
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

// CopyEntries copies every entry of src into dst (CopyFitting). It is the
// migration for maps whose entries stay valid as they are, such as the
// load-balancing and ipcache maps after a change of size. If dst is
// smaller and fills up, the error says so and dst holds what fitted.
func CopyEntries[K, V any](src, dst Map) error {
	left, err := CopyFitting[K, V](src, dst)
	if err == nil && left > 0 {
		err = fmt.Errorf("copy into %s: %d entries do not fit", dst, left)
	}
	return err
}

// CopyFitting copies every entry of src into dst with batch updates; the
// entries of a batch that failed are written one by one, and those dst has
// no room for are left out and counted in left. Another failure stops the
// copy with an error.
func CopyFitting[K, V any](src, dst Map) (left int, err error) {
	err = Walk(src, 4096, func(keys []K, values []V) error {
		done, err := dst.BatchUpdate(keys, values, nil)
		if err == nil {
			return nil
		}
		done = max(0, min(done, len(keys)))
		if done == len(keys) {
			done = 0 // a count not to be trusted
		}
		for i := done; i < len(keys); i++ {
			if err := dst.Put(keys[i], values[i]); err != nil {
				if !IsFull(err) {
					return fmt.Errorf("copy entry into %s: %w", dst, err)
				}
				left++
			}
		}
		return nil
	})
	return left, err
}

// IsFull reports whether err is what the kernel answers a write into a
// full map (E2BIG for a hash, ENOSPC for an LPM trie, ENOMEM when it has
// no memory for the entry).
func IsFull(err error) bool {
	return errors.Is(err, unix.E2BIG) || errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.ENOMEM)
}
