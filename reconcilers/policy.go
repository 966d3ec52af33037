package reconcilers

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// Policy converges the policy-entries table into the policy map and the
// endpoint-policy table into policy_endpoints.
//
// An endpoint's policy_endpoints entry, which switches enforcement on for
// its cgroup, is written only once every policy entry the table holds for
// the endpoint is in the policy map: the endpoint operations write those
// entries first (the entry operations then find them there and write
// nothing), so a new endpoint or a newly enforced direction never runs on a
// partial policy.
//
// Like IPCache, it keeps a copy of what each map holds, read when the maps
// are opened, so that a restart with unchanged desired state writes nothing.
type Policy struct {
	log      *slog.Logger
	maxFlag  string
	maxCount uint32

	mu        sync.Mutex
	policy    *ebpf.Map
	endpoints *ebpf.Map
	entries   map[bpf.PolicyKey]bpf.PolicyValue
	// cgroups is what policy_endpoints holds: cgroup ID → value.
	cgroups map[uint64]bpf.PolicyEndpointValue
	// written are the entries the endpoint operations wrote, with the
	// policy-entries table's revision they saw: the entry reconciler's
	// prune may run on an older view of the table, which does not have
	// them yet, and must not delete them under an enforced endpoint.
	written map[bpf.PolicyKey]statedb.Revision

	writes, deletes atomic.Uint64
}

// NewPolicy returns operations on no maps yet; call Open before the
// reconcilers start. maxFlag names the flag that sizes the policy map, for
// the error of a full map. A nil log discards log messages.
func NewPolicy(log *slog.Logger, maxFlag string) *Policy {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Policy{
		log: log, maxFlag: maxFlag,
		entries: map[bpf.PolicyKey]bpf.PolicyValue{}, cgroups: map[uint64]bpf.PolicyEndpointValue{},
		written: map[bpf.PolicyKey]statedb.Revision{},
	}
}

// Open opens (or creates) the policy and policy_endpoints maps pinned in
// pinDir and reads what they hold. It returns the endpoint IDs by cgroup
// found in policy_endpoints, so that endpoints keep their numbers (and so
// their entries) across a restart. A policy map of another size is
// replaced by one holding the old one's entries.
func (p *Policy) Open(pinDir string, maxEntries, maxEndpoints uint32) (map[uint64]uint32, error) {
	pol, err := bpf.OpenPinnedMap(p.log, bpf.PolicyMapSpec(maxEntries), pinDir, p.copyPolicy)
	if err != nil {
		return nil, fmt.Errorf("%w (--%s=%d)", err, p.maxFlag, maxEntries)
	}
	eps, err := bpf.OpenPinnedMap(p.log, bpf.PolicyEndpointsMapSpec(maxEndpoints), pinDir, copyMap[uint64, bpf.PolicyEndpointValue])
	if err != nil {
		pol.Close()
		return nil, err
	}
	entries := map[bpf.PolicyKey]bpf.PolicyValue{}
	err = bpf.Walk(pol.Map, 1024, func(keys []bpf.PolicyKey, values []bpf.PolicyValue) error {
		for i, k := range keys {
			entries[k] = values[i]
		}
		return nil
	})
	if err != nil {
		pol.Close()
		eps.Close()
		return nil, fmt.Errorf("read %s: %w", pol.Path, err)
	}
	cgroups := map[uint64]bpf.PolicyEndpointValue{}
	restored := map[uint64]uint32{}
	err = bpf.Walk(eps.Map, 1024, func(keys []uint64, values []bpf.PolicyEndpointValue) error {
		for i, k := range keys {
			cgroups[k] = values[i]
			if values[i].Flags&bpf.PolicyPodTree == 0 {
				restored[k] = values[i].EndpointID
			}
		}
		return nil
	})
	if err != nil {
		pol.Close()
		eps.Close()
		return nil, fmt.Errorf("read %s: %w", eps.Path, err)
	}
	p.mu.Lock()
	p.policy, p.endpoints, p.entries, p.cgroups, p.maxCount = pol.Map, eps.Map, entries, cgroups, maxEntries
	p.mu.Unlock()
	return restored, nil
}

// copyMap is the migration of a resized map: every entry moves.
func copyMap[K comparable, V any](old, new *ebpf.Map) error {
	return bpf.Walk(old, 1024, func(keys []K, values []V) error {
		_, err := new.BatchUpdate(keys, values, nil)
		return err
	})
}

// copyPolicy is the migration of a resized policy map: every entry moves
// while there is room. A smaller map than the entries needs keeps what
// fits (the endpoints stay enforced on those); the reconciler rewrites the
// rest and reports the entries that do not fit on their endpoints.
func (p *Policy) copyPolicy(old, new *ebpf.Map) error {
	left := 0
	err := bpf.Walk(old, 1024, func(keys []bpf.PolicyKey, values []bpf.PolicyValue) error {
		if _, err := new.BatchUpdate(keys, values, nil); err == nil {
			return nil
		}
		for i, k := range keys {
			if err := new.Put(k, values[i]); err != nil {
				if !isFull(err) {
					return err
				}
				left++
			}
		}
		return nil
	})
	if left > 0 {
		p.log.Warn("The resized policy map is too small for the old one's entries", "left-out", left, "flag", "--"+p.maxFlag)
	}
	return err
}

// isFull reports whether err says that a map has no room left.
func isFull(err error) bool {
	return errors.Is(err, unix.E2BIG) || errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.ENOMEM)
}

// Close closes the maps; the pins stay.
func (p *Policy) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	if p.policy != nil {
		errs = append(errs, p.policy.Close())
		p.policy = nil
	}
	if p.endpoints != nil {
		errs = append(errs, p.endpoints.Close())
		p.endpoints = nil
	}
	return errors.Join(errs...)
}

// Maps calls fn with the open policy and policy_endpoints maps, for the
// datapath loader. fn must not keep them.
func (p *Policy) Maps(fn func(policy, endpoints *ebpf.Map) error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.policy == nil || p.endpoints == nil {
		return errors.New("policy maps not open")
	}
	return fn(p.policy, p.endpoints)
}

// Writes returns how many map updates and deletes the operations made,
// both maps together.
func (p *Policy) Writes() (updates, deletes uint64) {
	return p.writes.Load(), p.deletes.Load()
}

// Entries returns how many entries the policy map holds.
func (p *Policy) Entries() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.entries)
}

// PolicyKeyOf returns the map key and value of a table entry.
func PolicyKeyOf(e *tables.PolicyEntry) (bpf.PolicyKey, bpf.PolicyValue) {
	dir := bpf.PolicyIngress
	if e.Direction == tables.DirEgress {
		dir = bpf.PolicyEgress
	}
	k := bpf.NewPolicyKey(e.EndpointID, e.Identity, dir, e.Protocol, e.Port, int(e.PortBits))
	v := bpf.PolicyValue{PortPrefixLen: uint8(k.PrefixLen - bpf.PolicyStaticPrefixBits), Cookie: e.Cookie}
	if e.Deny {
		v.Flags |= bpf.PolicyFlagDeny
		if e.Audit {
			v.Flags |= bpf.PolicyFlagAudit
		}
	}
	return k, v
}

func (p *Policy) putEntryLocked(k bpf.PolicyKey, v bpf.PolicyValue) error {
	if old, ok := p.entries[k]; ok && old == v {
		return nil
	}
	if p.policy == nil {
		return errors.New("policy map not open")
	}
	if err := p.policy.Put(k, v); err != nil {
		if isFull(err) {
			return fmt.Errorf("policy map is full (%d entries): raise --%s", p.maxCount, p.maxFlag)
		}
		return fmt.Errorf("write policy entry %s: %w", k, err)
	}
	p.writes.Add(1)
	p.entries[k] = v
	return nil
}

func (p *Policy) deleteEntryLocked(k bpf.PolicyKey) error {
	if _, ok := p.entries[k]; !ok {
		return nil
	}
	if p.policy == nil {
		return errors.New("policy map not open")
	}
	if err := p.policy.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete policy entry %s: %w", k, err)
	}
	p.deletes.Add(1)
	delete(p.entries, k)
	return nil
}

// PolicyEntryOps are the operations of the policy-entries table.
type PolicyEntryOps struct {
	*Policy
	table        statedb.Table[*tables.PolicyEntry]
	endpointRows statedb.Table[*tables.EndpointPolicy]
}

var _ reconciler.Operations[*tables.PolicyEntry] = PolicyEntryOps{}

// EntryOps returns the operations of the policy-entries table, which
// prune reads the revision of.
func (p *Policy) EntryOps(table statedb.Table[*tables.PolicyEntry]) PolicyEntryOps {
	return PolicyEntryOps{Policy: p, table: table}
}

// Update implements reconciler.Operations.
func (o PolicyEntryOps) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, e *tables.PolicyEntry) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	k, v := PolicyKeyOf(e)
	return o.putEntryLocked(k, v)
}

// Delete implements reconciler.Operations.
func (o PolicyEntryOps) Delete(_ context.Context, txn statedb.ReadTxn, _ statedb.Revision, e *tables.PolicyEntry) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	// A policy that goes takes its entries and, often, the endpoint's
	// enforcement with it: the endpoint's new flags go first, so that its
	// traffic never meets a default deny without the entries meanwhile.
	if o.endpointRows != nil && o.table != nil {
		if row, _, found := o.endpointRows.Get(txn, tables.EndpointPolicyNameIndex.Query(e.Endpoint)); found &&
			row.Status.Kind != reconciler.StatusKindDone {
			// Its own reconciler retries what fails here.
			_ = o.updateEndpointLocked(txn, o.table, row)
		}
	}
	k, _ := PolicyKeyOf(e)
	return o.deleteEntryLocked(k)
}

// OrderedBy returns the operations with the endpoint-policy table, so
// that deleting an entry first applies its endpoint's pending row (see
// Delete).
func (o PolicyEntryOps) OrderedBy(endpoints statedb.Table[*tables.EndpointPolicy]) PolicyEntryOps {
	o.endpointRows = endpoints
	return o
}

// Prune implements reconciler.Operations: entries the table does not hold
// (left by an earlier run) are deleted, except those the endpoint
// operations wrote from a newer view of the table than txn.
func (o PolicyEntryOps) Prune(_ context.Context, txn statedb.ReadTxn, objs iter.Seq2[*tables.PolicyEntry, statedb.Revision]) error {
	want := map[bpf.PolicyKey]struct{}{}
	for e := range objs {
		k, _ := PolicyKeyOf(e)
		want[k] = struct{}{}
	}
	var seen statedb.Revision
	if o.table != nil {
		seen = o.table.Revision(txn)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	var errs []error
	for k := range o.entries {
		if _, ok := want[k]; ok {
			continue
		}
		if rev, ok := o.written[k]; ok && rev > seen {
			continue
		}
		errs = append(errs, o.deleteEntryLocked(k))
	}
	for k, rev := range o.written {
		if rev <= seen {
			delete(o.written, k)
		}
	}
	return errors.Join(errs...)
}

// EndpointPolicyOps are the operations of the endpoint-policy table. They
// read the policy-entries table, so they need it.
type EndpointPolicyOps struct {
	*Policy
	Entries statedb.Table[*tables.PolicyEntry]
}

var _ reconciler.Operations[*tables.EndpointPolicy] = EndpointPolicyOps{}

// EndpointOps returns the operations of the endpoint-policy table.
func (p *Policy) EndpointOps(entries statedb.Table[*tables.PolicyEntry]) EndpointPolicyOps {
	return EndpointPolicyOps{p, entries}
}

// EndpointValue returns the policy_endpoints value of a row.
func EndpointValue(e *tables.EndpointPolicy) bpf.PolicyEndpointValue {
	v := bpf.PolicyEndpointValue{EndpointID: e.ID}
	if e.Ingress != tables.EnforceOff {
		v.Flags |= bpf.PolicyEnforceIngress
	}
	if e.Egress != tables.EnforceOff {
		v.Flags |= bpf.PolicyEnforceEgress
	}
	if e.Audit {
		v.Flags |= bpf.PolicyAudit
	}
	if e.AuditDefaultIngress {
		v.Flags |= bpf.PolicyAuditDefaultIngress
	}
	if e.AuditDefaultEgress {
		v.Flags |= bpf.PolicyAuditDefaultEgress
	}
	if e.PodTree {
		v.Flags |= bpf.PolicyPodTree
	}
	return v
}

// Update implements reconciler.Operations.
func (o EndpointPolicyOps) Update(_ context.Context, txn statedb.ReadTxn, _ statedb.Revision, e *tables.EndpointPolicy) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.updateEndpointLocked(txn, o.Entries, e)
}

// updateEndpointLocked writes the entries of e that entries holds in txn,
// then e's policy_endpoints entry.
func (p *Policy) updateEndpointLocked(txn statedb.ReadTxn, entries statedb.Table[*tables.PolicyEntry], e *tables.EndpointPolicy) error {
	if e.PodTree {
		return p.putCgroupLocked(e)
	}
	if e.ID == 0 {
		return nil
	}
	// Every entry of the endpoint first: see Policy.
	var errs []error
	rev := entries.Revision(txn)
	for entry := range entries.List(txn, tables.PolicyEntryEndpointIndex.Query(e.Name)) {
		k, v := PolicyKeyOf(entry)
		p.written[k] = rev
		if err := p.putEntryLocked(k, v); err != nil {
			errs = append(errs, err)
			if len(errs) == 3 {
				break
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("endpoint %s not enforced until its policy is in the map: %w", e.Name, err)
	}
	// A cgroup the endpoint no longer has loses its entry.
	for cg, v := range p.cgroups {
		if v.EndpointID == e.ID && cg != e.CgroupID {
			if err := p.deleteCgroupLocked(cg); err != nil {
				return err
			}
		}
	}
	return p.putCgroupLocked(e)
}

// putCgroupLocked writes the policy_endpoints entry of e's cgroup.
func (p *Policy) putCgroupLocked(e *tables.EndpointPolicy) error {
	if e.CgroupID == 0 {
		return nil
	}
	v := EndpointValue(e)
	if old, ok := p.cgroups[e.CgroupID]; ok && old == v {
		return nil
	}
	if p.endpoints == nil {
		return errors.New("policy_endpoints map not open")
	}
	if err := p.endpoints.Put(e.CgroupID, v); err != nil {
		return fmt.Errorf("write policy_endpoints entry of %s: %w", e.Name, err)
	}
	p.writes.Add(1)
	p.cgroups[e.CgroupID] = v
	return nil
}

func (p *Policy) deleteCgroupLocked(cg uint64) error {
	if _, ok := p.cgroups[cg]; !ok {
		return nil
	}
	if p.endpoints == nil {
		return errors.New("policy_endpoints map not open")
	}
	if err := p.endpoints.Delete(cg); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete policy_endpoints entry of cgroup %d: %w", cg, err)
	}
	p.deletes.Add(1)
	delete(p.cgroups, cg)
	return nil
}

// Delete implements reconciler.Operations.
func (o EndpointPolicyOps) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, e *tables.EndpointPolicy) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	for cg, v := range o.cgroups {
		if (e.ID != 0 && v.EndpointID == e.ID) || (e.CgroupID != 0 && cg == e.CgroupID) {
			if err := o.deleteCgroupLocked(cg); err != nil {
				return err
			}
		}
	}
	return nil
}

// Prune implements reconciler.Operations: cgroups no row names lose their
// entry.
func (o EndpointPolicyOps) Prune(_ context.Context, _ statedb.ReadTxn, objs iter.Seq2[*tables.EndpointPolicy, statedb.Revision]) error {
	want := map[uint64]struct{}{}
	for e := range objs {
		if (e.ID != 0 || e.PodTree) && e.CgroupID != 0 {
			want[e.CgroupID] = struct{}{}
		}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	var errs []error
	for cg := range o.cgroups {
		if _, ok := want[cg]; !ok {
			errs = append(errs, o.deleteCgroupLocked(cg))
		}
	}
	return errors.Join(errs...)
}

// DumpPolicy calls fn with the policy map's entries, read from the kernel.
func (p *Policy) DumpPolicy(fn func(bpf.PolicyKey, bpf.PolicyValue)) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.policy == nil {
		return errors.New("policy map not open")
	}
	return bpf.Walk(p.policy, 1024, func(keys []bpf.PolicyKey, values []bpf.PolicyValue) error {
		for i, k := range keys {
			fn(k, values[i])
		}
		return nil
	})
}
