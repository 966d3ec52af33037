package identity

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// Allocator gives each distinct label set one identity, reference-counted,
// and keeps the identities table. Every method works inside a write
// transaction of the caller that has the identities table locked (lock
// Table() together with the caller's own tables), so that an identity and
// the rows that use it change atomically.
//
// Numbers of reserved label sets are fixed (ReservedFor); label sets of
// CIDR/FQDN labels get local numbers, workload label sets cluster numbers
// through ClusterNumbers. Numbers read back from the checkpoint or from the
// old ipcache map are kept for their label set (or prefix) during the
// restore grace period.
type Allocator struct {
	log   *slog.Logger
	db    *statedb.DB
	table statedb.RWTable[*tables.Identity]

	// mu guards what follows. The table lock already serialises writers,
	// but hints may be read by anyone.
	mu      sync.Mutex
	local   *NumberRange
	cluster ClusterNumbers
	// withheld are numbers seen in the old ipcache map without a label
	// set in the checkpoint: only a hint may claim them until the grace
	// period ends.
	withheld map[uint32]struct{}

	// Restore grace period, see StartGracePeriod.
	grace      time.Duration
	graceOnce  sync.Once
	graceStart chan struct{}

	checkpointPath string
}

// NewAllocator returns an allocator over table, with the reserved
// identities inserted.
func NewAllocator(log *slog.Logger, db *statedb.DB, table statedb.RWTable[*tables.Identity], cluster ClusterNumbers) (*Allocator, error) {
	a := &Allocator{
		log: log, db: db, table: table,
		local:    NewNumberRange(tables.ScopeLocal, MinLocal, MaxLocal),
		cluster:  cluster,
		withheld: map[uint32]struct{}{},
	}
	wtxn := db.WriteTxn(table)
	defer wtxn.Abort()
	for _, id := range Reserved() {
		if _, _, err := table.Insert(wtxn, id); err != nil {
			return nil, fmt.Errorf("insert reserved identity %d: %w", id.ID, err)
		}
	}
	wtxn.Commit()
	return a, nil
}

// LimitLocal caps the local range at its first n numbers, so that tests can
// exhaust it. Call it before the first Acquire.
func (a *Allocator) LimitLocal(n uint32) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.local = NewNumberRange(tables.ScopeLocal, MinLocal, MinLocal+n-1)
}

// Table returns the identities table, to lock in the caller's write
// transactions.
func (a *Allocator) Table() statedb.Table[*tables.Identity] {
	return a.table
}

// Acquire takes a reference to the identity of l, allocating one if the
// set has none. hint is a number the caller's entry had before (from the
// old ipcache map, say), used for a new identity if it is free and in
// range; 0 means none. The identity is returned as it is now in txn.
func (a *Allocator) Acquire(txn statedb.WriteTxn, l tables.Labels, hint uint32) (*tables.Identity, error) {
	return a.AcquireN(txn, l, hint, 1)
}

// AcquireN is Acquire taking n references at once (n ≥ 1), for n entries
// with the same labels: one write of the identity instead of n.
func (a *Allocator) AcquireN(txn statedb.WriteTxn, l tables.Labels, hint uint32, n uint32) (*tables.Identity, error) {
	if id, ok := ReservedFor(l); ok {
		return a.ref(txn, id, n)
	}
	if cur, _, found := a.table.Get(txn, tables.IdentityLabelsIndex.Query(l.Key())); found {
		return a.ref(txn, cur.ID, n)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	free := func(id uint32) bool {
		if _, ok := a.withheld[id]; ok && id != hint {
			return false
		}
		_, _, found := a.table.Get(txn, tables.IdentityIDIndex.Query(id))
		return !found
	}
	scope := ScopeOf(l)
	var (
		id     uint32
		source string
		err    error
	)
	switch scope {
	case tables.ScopeLocal:
		id, err = a.local.Allocate(free, hint)
		source = SourceAgent
	default:
		id, err = a.cluster.Assign(l, free, hint)
		source = a.clusterSource(id)
	}
	if err != nil {
		return nil, err
	}
	delete(a.withheld, id)
	obj := &tables.Identity{ID: id, Labels: l, Scope: scope, Source: source, RefCount: n}
	if _, _, err := a.table.Insert(txn, obj); err != nil {
		return nil, fmt.Errorf("insert identity %d: %w", id, err)
	}
	return obj, nil
}

func (a *Allocator) ref(txn statedb.WriteTxn, id uint32, n uint32) (*tables.Identity, error) {
	cur, _, found := a.table.Get(txn, tables.IdentityIDIndex.Query(id))
	if !found {
		return nil, fmt.Errorf("BUG: identity %d vanished", id)
	}
	obj := cur.Clone()
	obj.RefCount += n
	obj.Restored = false
	if _, _, err := a.table.Insert(txn, obj); err != nil {
		return nil, err
	}
	return obj, nil
}

// clusterSource names who handed out the cluster-scope number id.
func (a *Allocator) clusterSource(id uint32) string {
	if r, ok := a.cluster.(Renumberer); ok {
		return r.SourceOf(id)
	}
	return a.cluster.Source()
}

// RenumberWatch returns a channel closed when Renumber may have work: the
// ClusterNumbers changed its choices. Nil (never closed) in the agent mode.
func (a *Allocator) RenumberWatch() <-chan struct{} {
	if r, ok := a.cluster.(Renumberer); ok {
		return r.Changed()
	}
	return nil
}

// Renumber moves every cluster identity whose number the ClusterNumbers no
// longer stands by (a temporary number whose Identity has appeared, a
// number whose Identity is gone) to the number it wants now, keeping the
// references, and frees the old number. It returns old → new for the
// caller to rewrite the entries that use them in the same transaction.
// Label sets that cannot move (their wanted number is still used by
// another row, or no temporary number is free) keep their number and are
// retried at the next call.
func (a *Allocator) Renumber(txn statedb.WriteTxn) (map[uint32]uint32, error) {
	r, ok := a.cluster.(Renumberer)
	if !ok {
		return nil, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	free := func(id uint32) bool {
		if _, ok := a.withheld[id]; ok {
			return false
		}
		_, _, found := a.table.Get(txn, tables.IdentityIDIndex.Query(id))
		return !found
	}
	moved := map[uint32]uint32{}
	var errs []error
	// A move can free the number another label set waits for: a few
	// passes settle chains of them.
	for pass := 0; pass < 3; pass++ {
		errs = errs[:0]
		n, err := a.renumberPass(txn, r, free, moved, &errs)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			break
		}
	}
	if len(errs) > 0 {
		a.log.Warn("Some identities keep their numbers for now", "error", errors.Join(errs...))
	}
	return moved, nil
}

// renumberPass is one pass of Renumber; it returns how many rows moved.
func (a *Allocator) renumberPass(txn statedb.WriteTxn, r Renumberer, free func(uint32) bool, moved map[uint32]uint32, errs *[]error) (int, error) {
	var rows []*tables.Identity
	for obj := range a.table.All(txn) {
		// Restored numbers nobody claimed wait for the grace period's end
		// rather than take temporary numbers.
		if obj.Scope == tables.ScopeCluster && obj.RefCount > 0 {
			rows = append(rows, obj)
		}
	}
	count := 0
	for _, obj := range rows {
		want, err := r.Want(obj.Labels, obj.ID, free)
		if err != nil {
			*errs = append(*errs, err)
			continue
		}
		if want == obj.ID {
			continue
		}
		if _, _, err := a.table.Delete(txn, obj); err != nil {
			return 0, err
		}
		n := obj.Clone()
		n.ID = want
		n.Source = r.SourceOf(want)
		delete(a.withheld, want)
		if _, _, err := a.table.Insert(txn, n); err != nil {
			return 0, fmt.Errorf("renumber identity %d to %d: %w", obj.ID, want, err)
		}
		a.cluster.Freed(obj.ID)
		// Entries still say the first number they had.
		orig := obj.ID
		for o, m := range moved {
			if m == obj.ID {
				orig = o
			}
		}
		moved[orig] = want
		count++
	}
	return count, nil
}

// freed tells the ranges that id is free again.
func (a *Allocator) freed(id uint32) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.local.Freed(id)
	a.cluster.Freed(id)
}

// Release drops a reference to id; an identity nobody uses any more is
// deleted, except the reserved ones, which always exist.
func (a *Allocator) Release(txn statedb.WriteTxn, id uint32) error {
	return a.ReleaseN(txn, id, 1)
}

// ReleaseN is Release of n references at once.
func (a *Allocator) ReleaseN(txn statedb.WriteTxn, id uint32, n uint32) error {
	cur, _, found := a.table.Get(txn, tables.IdentityIDIndex.Query(id))
	if !found || cur.RefCount < n {
		return fmt.Errorf("BUG: release of %d references to identity %d that holds fewer", n, id)
	}
	if cur.RefCount == n && cur.Scope != tables.ScopeReserved {
		if _, _, err := a.table.Delete(txn, cur); err != nil {
			return err
		}
		a.freed(id)
		return nil
	}
	obj := cur.Clone()
	obj.RefCount -= n
	_, _, err := a.table.Insert(txn, obj)
	return err
}

// Restore inserts the identities of a checkpoint as restored rows, which
// keep their numbers for their label sets until ReleaseRestored. It must
// run before the first Acquire. Entries that make no sense (a number out of
// its range, a duplicate) are skipped with a warning.
func (a *Allocator) Restore(checkpoint []*tables.Identity) error {
	wtxn := a.db.WriteTxn(a.table)
	defer wtxn.Abort()
	a.mu.Lock()
	defer a.mu.Unlock()
	var errs []error
	for _, c := range checkpoint {
		scope := ScopeOfID(c.ID)
		switch {
		case scope == tables.ScopeReserved || scope == "":
			errs = append(errs, fmt.Errorf("identity %d: not a local or cluster number", c.ID))
			continue
		case scope != ScopeOf(c.Labels):
			errs = append(errs, fmt.Errorf("identity %d: labels %s belong in the %s range", c.ID, c.Labels, ScopeOf(c.Labels)))
			continue
		case scope == tables.ScopeCluster && !a.cluster.Contains(c.ID):
			continue // numbers of another mode's allocator
		}
		if _, ok := ReservedFor(c.Labels); ok {
			continue
		}
		if _, _, found := a.table.Get(wtxn, tables.IdentityIDIndex.Query(c.ID)); found {
			errs = append(errs, fmt.Errorf("identity %d: listed twice", c.ID))
			continue
		}
		if _, _, found := a.table.Get(wtxn, tables.IdentityLabelsIndex.Query(c.Labels.Key())); found {
			errs = append(errs, fmt.Errorf("identity %d: labels %s listed twice", c.ID, c.Labels))
			continue
		}
		source := SourceAgent
		if scope == tables.ScopeCluster {
			source = a.clusterSource(c.ID)
		}
		row := &tables.Identity{ID: c.ID, Labels: c.Labels, Scope: scope, Source: source, Restored: true}
		if _, _, err := a.table.Insert(wtxn, row); err != nil {
			return err
		}
		if scope == tables.ScopeLocal {
			a.local.advancePast(c.ID)
		}
	}
	wtxn.Commit()
	if len(errs) > 0 {
		a.log.Warn("Skipped identities of the checkpoint", "error", errors.Join(errs...))
	}
	return nil
}

// Withhold keeps numbers the datapath still uses (read from the old ipcache
// map) from being handed to other label sets until ReleaseRestored: only
// an Acquire that hints at the number may take it. Numbers the checkpoint
// restored are already kept.
func (a *Allocator) Withhold(ids []uint32) {
	rtxn := a.db.ReadTxn()
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, id := range ids {
		if s := ScopeOfID(id); s == tables.ScopeLocal || s == tables.ScopeCluster {
			if _, _, found := a.table.Get(rtxn, tables.IdentityIDIndex.Query(id)); !found {
				a.withheld[id] = struct{}{}
			}
		}
	}
}

// ReleaseRestored ends the restore grace period: restored identities no
// entry has claimed are deleted and withheld numbers become free. It
// returns how many identities were released.
func (a *Allocator) ReleaseRestored() (int, error) {
	wtxn := a.db.WriteTxn(a.table)
	defer wtxn.Abort()
	n := 0
	for obj := range a.table.All(wtxn) {
		if obj.Restored && obj.RefCount == 0 {
			if _, _, err := a.table.Delete(wtxn, obj); err != nil {
				return 0, err
			}
			a.freed(obj.ID)
			n++
		}
	}
	a.mu.Lock()
	n += len(a.withheld)
	for id := range a.withheld {
		a.local.Freed(id)
		a.cluster.Freed(id)
	}
	clear(a.withheld)
	a.mu.Unlock()
	wtxn.Commit()
	return n, nil
}
