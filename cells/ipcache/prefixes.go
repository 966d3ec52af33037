package ipcache

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// Prefixes is how other cells label IP prefixes. Each owner (a string
// "kind/name": "policy", "pod/default/web-1", "fqdn/www.example.com",
// "ipam/health") says which labels it gives to which prefixes; the ipcache
// cell merges the owners' labels, inherits the labels of shorter prefixes
// containing each prefix, allocates an identity per label set and writes
// the ipcache map.
//
// For example, delegated IPAM gives its health IP the health identity (4):
//
//	rev, err := prefixes.Update(ipcache.Upsert(tables.HostPrefix(ip), "ipam/health", tables.LabelHealth))
//
// and a DNS proxy that must not answer before the map knows the IPs waits,
// bounded:
//
//	ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
//	defer cancel()
//	err := prefixes.Wait(ctx, rev)
type Prefixes interface {
	// Update applies the changes in one write transaction and returns the
	// revision to Wait for. A change with labels sets the labels of
	// (prefix, owner); one without deletes them.
	Update(changes ...Change) (Revision, error)
	// DeleteOwner deletes every prefix of owner, in one write transaction.
	DeleteOwner(owner string) (Revision, error)
	// Wait blocks until every change up to rev has been resolved into the
	// ipcache and policy-prefixes tables and written to their maps, or
	// until ctx ends (then it returns ctx's error).
	Wait(ctx context.Context, rev Revision) error
	// RegisterInitializer tells the ipcache cell that an owner has prefixes
	// to add before the ipcache map may be pruned of entries an earlier run
	// left. It must be called before the hive starts (from a constructor);
	// the owner calls done once it has added its initial prefixes.
	RegisterInitializer(name string) (done func())
}

// Revision is a revision of the prefixes table.
type Revision = statedb.Revision

// Change is a change of the labels one owner gives one prefix.
type Change struct {
	Prefix netip.Prefix
	Owner  string
	// Labels are the labels; empty deletes (Prefix, Owner).
	Labels tables.Labels
}

// Upsert returns the change that gives prefix the labels, from owner.
func Upsert(prefix netip.Prefix, owner string, labels ...string) Change {
	return Change{Prefix: prefix, Owner: owner, Labels: tables.NewLabels(labels...)}
}

// Delete returns the change that removes owner's labels from prefix.
func Delete(prefix netip.Prefix, owner string) Change {
	return Change{Prefix: prefix, Owner: owner}
}

// prefixes implements Prefixes.
type prefixes struct {
	db      *statedb.DB
	table   statedb.RWTable[*tables.PrefixLabels]
	ipcache statedb.Table[*tables.IPCacheEntry]

	// progress is what the resolver has done, see resolved.
	mu       sync.Mutex
	progress resolvedProgress
	changed  chan struct{}

	// rec and policyRec are the reconcilers of the ipcache and
	// policy-prefixes tables.
	rec, policyRec reconciler.Reconciler[*tables.IPCacheEntry]
}

// resolvedProgress: every change of the prefixes table up to PrefixesRev
// is in the ipcache table as of IPCacheRev, and in the policy-prefixes
// table as of PolicyRev.
type resolvedProgress struct {
	PrefixesRev, IPCacheRev, PolicyRev Revision
}

func newPrefixes(db *statedb.DB, table statedb.RWTable[*tables.PrefixLabels], ipcache statedb.Table[*tables.IPCacheEntry]) *prefixes {
	return &prefixes{db: db, table: table, ipcache: ipcache, changed: make(chan struct{})}
}

func (p *prefixes) Update(changes ...Change) (Revision, error) {
	wtxn := p.db.WriteTxn(p.table)
	defer wtxn.Abort()
	if err := p.apply(wtxn, changes); err != nil {
		return 0, err
	}
	return p.table.Revision(wtxn.Commit()), nil
}

func (p *prefixes) apply(wtxn statedb.WriteTxn, changes []Change) error {
	for _, c := range changes {
		if !c.Prefix.IsValid() {
			return fmt.Errorf("prefix of owner %q is not valid", c.Owner)
		}
		if c.Owner == "" {
			return fmt.Errorf("prefix %s has no owner", c.Prefix)
		}
		row := &tables.PrefixLabels{Prefix: tables.CanonicalPrefix(c.Prefix), Owner: c.Owner, Labels: c.Labels}
		if len(c.Labels) == 0 {
			if _, _, err := p.table.Delete(wtxn, row); err != nil {
				return err
			}
			continue
		}
		if old, _, found := p.table.Get(wtxn, tables.PrefixLabelsIndex.Query(tables.PrefixOwner{Prefix: row.Prefix, Owner: row.Owner})); found && old.Labels.Equal(row.Labels) {
			continue // no new revision, no work for the resolver
		}
		if _, _, err := p.table.Insert(wtxn, row); err != nil {
			return err
		}
	}
	return nil
}

func (p *prefixes) DeleteOwner(owner string) (Revision, error) {
	wtxn := p.db.WriteTxn(p.table)
	defer wtxn.Abort()
	for row := range p.table.List(wtxn, tables.PrefixOwnerIndex.Query(owner)) {
		if _, _, err := p.table.Delete(wtxn, row); err != nil {
			return 0, err
		}
	}
	return p.table.Revision(wtxn.Commit()), nil
}

func (p *prefixes) RegisterInitializer(name string) func() {
	wtxn := p.db.WriteTxn(p.table)
	done := p.table.RegisterInitializer(wtxn, name)
	wtxn.Commit()
	return func() {
		wtxn := p.db.WriteTxn(p.table)
		done(wtxn)
		wtxn.Commit()
	}
}

// resolved records the resolver's progress and wakes up waiters.
func (p *prefixes) resolved(progress resolvedProgress) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if progress.PrefixesRev <= p.progress.PrefixesRev {
		return
	}
	p.progress = progress
	close(p.changed)
	p.changed = make(chan struct{})
}

func (p *prefixes) Wait(ctx context.Context, rev Revision) error {
	// First the resolver, then the reconcilers.
	var target resolvedProgress
	for {
		p.mu.Lock()
		progress, changed := p.progress, p.changed
		p.mu.Unlock()
		if progress.PrefixesRev >= rev {
			target = progress
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for prefixes to be resolved: %w", ctx.Err())
		case <-changed:
		}
	}
	if p.rec == nil || p.policyRec == nil {
		return fmt.Errorf("ipcache reconcilers not running")
	}
	if err := waitReconciled(ctx, p.rec, target.IPCacheRev, bpf.IPCacheMap); err != nil {
		return err
	}
	return waitReconciled(ctx, p.policyRec, target.PolicyRev, bpf.PolicyPrefixesMap)
}

// waitReconciled waits until rec has written every entry up to target to
// the map name.
//
// WaitUntilReconciled returns as soon as the reconciler has processed
// target, also when an entry up to target failed and waits for its retry;
// the reconciler (statedb v0.8.3) signals nothing when a retry succeeds, so
// that case, rare (a full or failing map), is polled, backing off from 5 ms
// to 100 ms: a waiter answers soon after the retry without spinning while
// the map stays full.
func waitReconciled(ctx context.Context, rec reconciler.Reconciler[*tables.IPCacheEntry], target Revision, name string) error {
	poll := 5 * time.Millisecond
	for {
		done, retryLow, err := rec.WaitUntilReconciled(ctx, target)
		if err != nil {
			return fmt.Errorf("wait for the %s map: %w", name, err)
		}
		// An entry up to target that failed is retried: not written yet.
		if done >= target && (retryLow == 0 || retryLow > target) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for the %s map: %w", name, ctx.Err())
		case <-time.After(poll):
		}
		poll = min(2*poll, 100*time.Millisecond)
	}
}
