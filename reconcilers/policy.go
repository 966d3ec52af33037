package reconcilers

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// Policy converges the endpoint-policy table, with the policy-entries
// table's entries of each endpoint, into the policy and policy_endpoints
// maps. One reconciler, on the endpoint-policy table, owns both maps: the
// policy controller marks an endpoint's row pending whenever it changes
// the endpoint's entries, and applying a row takes one order:
//
//  1. the endpoint's entries the table holds are written (or rewritten);
//  2. its policy_endpoints entry is written, and the entries of cgroups it
//     no longer has are deleted;
//  3. the entries the map holds for the endpoint that the table no longer
//     has (or that belong to an endpoint ID it no longer has) are deleted.
//
// So a new endpoint, a newly enforced direction or a replaced pod never
// runs on a partial policy, and a policy that goes turns enforcement off
// before its entries go. The one exception is a full map: the endpoint is
// switched on with what fits and fails closed (see failClosedLocked), its
// row keeping the error until the rest is in.
//
// Each map is a Mirror, which keeps a record of what the map holds, read
// when the maps are opened, so that a restart with unchanged desired state
// writes nothing.
type Policy struct {
	log      *slog.Logger
	maxFlag  string
	maxCount uint32

	mu sync.Mutex
	// policy holds the entries; endpoints is policy_endpoints: cgroup ID
	// → value.
	policy    *Mirror[bpf.PolicyKey, bpf.PolicyValue]
	endpoints *Mirror[uint64, bpf.PolicyEndpointValue]
	// gen is policy_endpoints_gen, moved after each change of
	// policy_endpoints: the programs' cache of each cgroup's endpoint
	// holds only until it moves. Its writes are not counted in Writes.
	gen *Mirror[uint32, uint64]
	// byID are the keys of the policy map's entries by endpoint ID, kept
	// by the policy mirror (Track).
	byID map[uint32]map[bpf.PolicyKey]struct{}
	// applied is what each row applied last, by endpoint name; idOwner and
	// cgroupOwner name the endpoint that applied an ID or a cgroup, so
	// that a pod gone does not take away what a newer pod reuses.
	applied     map[string]appliedEndpoint
	idOwner     map[uint32]string
	cgroupOwner map[uint64]string

	// drift, if set, makes Prune a resync: the maps are read and what
	// differs from the record is repaired and reported to it.
	drift *Drift

	// endpointMaps, if set, keeps per-endpoint state beside the maps.
	endpointMaps EndpointMaps
	// orphanSets are the policy sets (ID → name) whose rows went while a
	// reference entry in the map still named them: their entries go
	// once none does.
	orphanSets map[uint32]string
	// refKeys are the reference entries' keys in the map, kept with byID.
	refKeys map[bpf.PolicyKey]struct{}
}

// EndpointMaps is state the programs keep per endpoint ID beside the
// policy maps (the DNS proxy's dns_origin, one map per endpoint with DNS
// rules). Policy makes an endpoint's before writing its policy_endpoints
// entry, so that the programs find it from the endpoint's first packet,
// and removes it with the endpoint's entries: it is the only writer.
type EndpointMaps interface {
	// Ensure makes (or keeps) what endpoint e, whose ID is not 0, needs
	// and removes what it no longer needs.
	Ensure(e *tables.EndpointPolicy) error
	// Remove removes what endpoint ID id has.
	Remove(id uint32) error
	// Prune removes what every endpoint ID not in keep has.
	Prune(keep map[uint32]struct{}) error
}

// SetEndpointMaps has the operations keep m (nil: none); call it before
// the reconcilers start.
func (p *Policy) SetEndpointMaps(m EndpointMaps) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.endpointMaps = m
}

type appliedEndpoint struct {
	id     uint32
	cgroup uint64
}

// NewPolicy returns operations on no maps yet; call Open before the
// reconcilers start. maxFlag names the flag that sizes the policy map, for
// the error of a full map. A nil log discards log messages.
func NewPolicy(log *slog.Logger, maxFlag string) *Policy {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Policy{
		log: log, maxFlag: maxFlag,
		policy:    NewMirror[bpf.PolicyKey, bpf.PolicyValue](bpf.PolicyMap),
		endpoints: NewMirror[uint64, bpf.PolicyEndpointValue](bpf.PolicyEndpointsMap),
		gen:       NewMirror[uint32, uint64](bpf.PolicyEndpointsGenMap),
		byID:      map[uint32]map[bpf.PolicyKey]struct{}{}, refKeys: map[bpf.PolicyKey]struct{}{}, applied: map[string]appliedEndpoint{},
		idOwner: map[uint32]string{}, cgroupOwner: map[uint64]string{},
	}
	p.policy.Track(p.addKey, p.removeKey)
	p.policy.OnWriteError(func(k bpf.PolicyKey, err error) error {
		if bpf.IsFull(err) {
			return fmt.Errorf("%w (%d entries): raise --%s", errPolicyMapFull, p.maxCount, p.maxFlag)
		}
		return fmt.Errorf("write policy entry %s: %w", k, err)
	})
	return p
}

// Open opens (or creates) the policy and policy_endpoints maps pinned in
// pinDir on bpffs (OpenWith bpf.KernelMaps).
func (p *Policy) Open(pinDir string, maxEntries, maxEndpoints uint32) (map[uint64]uint32, error) {
	return p.OpenWith(bpf.KernelMaps, pinDir, maxEntries, maxEndpoints)
}

// OpenWith opens (or creates) the policy and policy_endpoints maps pinned
// in pinDir through opener and reads what they hold. It returns the
// endpoint IDs by cgroup found in policy_endpoints, so that endpoints keep
// their numbers (and so their entries) across a restart. A policy map of
// another size is replaced by one holding the old one's entries.
func (p *Policy) OpenWith(opener bpf.Opener, pinDir string, maxEntries, maxEndpoints uint32) (map[uint64]uint32, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, err := p.policy.Open(opener, p.log, bpf.PolicyMapSpec(maxEntries), pinDir, p.copyPolicy); err != nil {
		return nil, fmt.Errorf("%w (--%s=%d)", err, p.maxFlag, maxEntries)
	}
	if _, err := p.endpoints.Open(opener, p.log, bpf.PolicyEndpointsMapSpec(maxEndpoints), pinDir, nil); err != nil {
		p.policy.Close()
		return nil, err
	}
	if _, err := p.gen.Open(opener, p.log, bpf.PolicyEndpointsGenMapSpec(), pinDir, nil); err != nil {
		p.policy.Close()
		p.endpoints.Close()
		return nil, err
	}
	// No endpoint's interface is known enforced until this run has
	// reconciled it (an earlier run's may have been detached since, or
	// this run may not enforce interfaces at all): a ClusterNetworkPolicy
	// Deny is EPERM meanwhile, never let through for no interface to drop.
	for cg, v := range p.endpoints.All() {
		if v.Flags&(bpf.PolicyPodIface|bpf.PolicyPodIfindexMask) != 0 {
			v.Flags &^= bpf.PolicyPodIface | bpf.PolicyPodIfindexMask
			if err := p.endpoints.Put(cg, v); err != nil {
				p.policy.Close()
				p.endpoints.Close()
				p.gen.Close()
				return nil, fmt.Errorf("clear the interface flag of cgroup %d: %w", cg, err)
			}
		}
	}
	// Moved at once: programs of an earlier run may have cached what
	// this one is about to change, and 0 means no counter to them.
	if err := p.moveGenLocked(); err != nil {
		p.policy.Close()
		p.endpoints.Close()
		p.gen.Close()
		return nil, err
	}
	restored := map[uint64]uint32{}
	for cg, v := range p.endpoints.All() {
		// A pod tree's or the agent's entry holds no endpoint ID.
		if v.Flags&bpf.PolicyPodTree == 0 && v.EndpointID != 0 {
			restored[cg] = v.EndpointID
		}
	}
	// The IDs of entries no cgroup names (an earlier run's policy sets)
	// are reserved too, under keys no cgroup has: a reference entry of
	// that run may still name one until its endpoint's row is applied,
	// so no new set may take its number.
	named := map[uint32]bool{}
	for _, id := range restored {
		named[id] = true
	}
	for id := range p.byID {
		if !named[id] {
			restored[StaleIDKey(id)] = id
		}
	}
	p.maxCount = maxEntries
	clear(p.applied)
	clear(p.idOwner)
	clear(p.cgroupOwner)
	return restored, nil
}

// StaleIDKey is the key, in the IDs OpenWith restores, of an ID whose
// entries are in the policy map without a cgroup: above every cgroup ID.
func StaleIDKey(id uint32) uint64 { return 1<<63 | uint64(id) }

// copyPolicy is the migration of a resized policy map: every entry moves
// while there is room. A smaller map than the entries needs keeps what
// fits (the endpoints stay enforced on those); the reconciler rewrites the
// rest and reports the entries that do not fit on their endpoints.
func (p *Policy) copyPolicy(old, new bpf.Map) error {
	left, err := bpf.CopyFitting[bpf.PolicyKey, bpf.PolicyValue](old, new)
	if left > 0 {
		p.log.Warn("The resized policy map is too small for the old one's entries", "left-out", left, "flag", "--"+p.maxFlag)
	}
	return err
}

// errPolicyMapFull is wrapped by the error of an entry the policy map had
// no room for.
var errPolicyMapFull = errors.New("policy map is full")

// Close closes the maps; the pins stay.
func (p *Policy) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return errors.Join(p.policy.Close(), p.endpoints.Close(), p.gen.Close())
}

// EndpointsGen returns policy_endpoints_gen, for the programs' loader
// (policyprog.Maps.EndpointsGen); nil before Open and for maps in memory.
// It stays open until Close.
func (p *Policy) EndpointsGen() *ebpf.Map {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.gen.Map() == nil {
		return nil
	}
	m, err := bpf.KernelMap(p.gen.Map())
	if err != nil {
		return nil
	}
	return m
}

// moveGenLocked moves policy_endpoints_gen after a change of
// policy_endpoints. Until it has moved the programs may go on with what
// they cached, so a failure fails the change: its row is retried.
func (p *Policy) moveGenLocked() error {
	v, _ := p.gen.Get(0)
	return p.gen.Put(0, v+1)
}

// putEndpointLocked writes the policy_endpoints entry of cgroup cg and
// moves the counter if it changed.
func (p *Policy) putEndpointLocked(cg uint64, v bpf.PolicyEndpointValue) error {
	if !p.endpoints.Differs(cg, v) {
		return nil
	}
	if err := p.endpoints.Put(cg, v); err != nil {
		return err
	}
	return p.moveGenLocked()
}

// Maps calls fn with the open policy and policy_endpoints maps, for the
// datapath loader. fn must not keep them. Maps in memory (tests) are
// refused.
func (p *Policy) Maps(fn func(policy, endpoints *ebpf.Map) error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.policy.Map() == nil || p.endpoints.Map() == nil {
		return errors.New("policy maps not open")
	}
	pol, err := bpf.KernelMap(p.policy.Map())
	if err != nil {
		return err
	}
	eps, err := bpf.KernelMap(p.endpoints.Map())
	if err != nil {
		return err
	}
	return fn(pol, eps)
}

// Writes returns how many map updates and deletes the operations made,
// both maps together.
func (p *Policy) Writes() (updates, deletes uint64) {
	u1, d1 := p.policy.Writes()
	u2, d2 := p.endpoints.Writes()
	return u1 + u2, d1 + d2
}

// Entries returns how many entries the policy map holds.
func (p *Policy) Entries() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.policy.Len()
}

// PolicyKeyOf returns the map key and value of a table entry.
func PolicyKeyOf(e *tables.PolicyEntry) (bpf.PolicyKey, bpf.PolicyValue) {
	dir := bpf.PolicyIngress
	if e.Direction == tables.DirEgress {
		dir = bpf.PolicyEgress
	}
	k := bpf.NewPolicyKey(e.EndpointID, e.Identity, dir, e.Protocol, e.Port, int(e.PortBits))
	v := bpf.PolicyValue{PortPrefixLen: uint8(k.PrefixLen - bpf.PolicyStaticPrefixBits), Cookie: e.Cookie}
	switch {
	case e.Deny:
		v.Flags |= bpf.PolicyFlagDeny
		if e.Audit {
			v.Flags |= bpf.PolicyFlagAudit
		}
	case e.PodAddrs:
		v.Flags |= bpf.PolicyFlagPodAddrs
	}
	if e.Final {
		v.Flags |= bpf.PolicyFlagFinal
	}
	if e.Pass {
		v.Flags |= bpf.PolicyFlagPass
	}
	if e.Drop && e.Deny {
		v.Flags |= bpf.PolicyFlagDrop
	}
	return k, v
}

// putEntriesLocked writes entries that differ from the record, in
// batches (see Mirror.PutBatch): an entry a batch could not write, and
// those after it, are written one by one, so that an error names its
// entry and a full map is reported as such; at most three errors are
// collected.
func (p *Policy) putEntriesLocked(keys []bpf.PolicyKey, values []bpf.PolicyValue) error {
	if len(keys) == 0 {
		return nil
	}
	if p.policy.Map() == nil {
		return errors.New("policy map not open")
	}
	var errs []error
	p.policy.PutBatch(keys, values, firstErrors(&errs, 3))
	return errors.Join(errs...)
}

// deleteEntriesLocked deletes entries in batches; a batch that fails
// (an entry already gone from the map, say) is finished one by one, up
// to the first error.
func (p *Policy) deleteEntriesLocked(keys []bpf.PolicyKey) error {
	if len(keys) == 0 {
		return nil
	}
	if p.policy.Map() == nil {
		return errors.New("policy map not open")
	}
	var errs []error
	p.policy.DeleteBatch(keys, firstErrors(&errs, 1))
	return errors.Join(errs...)
}

// addKey and removeKey keep byID as the policy map's record changes.
func (p *Policy) addKey(k bpf.PolicyKey) {
	if p.byID[k.EndpointID] == nil {
		p.byID[k.EndpointID] = map[bpf.PolicyKey]struct{}{}
	}
	p.byID[k.EndpointID][k] = struct{}{}
	if k.Identity == bpf.PolicySetRef {
		p.refKeys[k] = struct{}{}
	}
}

func (p *Policy) removeKey(k bpf.PolicyKey) {
	delete(p.refKeys, k)
	if keys := p.byID[k.EndpointID]; keys != nil {
		delete(keys, k)
		if len(keys) == 0 {
			delete(p.byID, k.EndpointID)
		}
	}
}

// PolicyOps are the operations of the endpoint-policy table's reconciler,
// which owns the policy and policy_endpoints maps. They read an
// endpoint's entries from the policy-entries table.
type PolicyOps struct {
	*Policy
	Entries statedb.Table[*tables.PolicyEntry]
}

var _ reconciler.Operations[*tables.EndpointPolicy] = PolicyOps{}

// Ops returns the operations of the endpoint-policy table.
func (p *Policy) Ops(entries statedb.Table[*tables.PolicyEntry]) PolicyOps {
	return PolicyOps{p, entries}
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
	if len(e.DNS) > 0 {
		v.Flags |= bpf.PolicyDNS
	}
	// Only with the pod side's index, which must fit: without it the
	// drop stays EPERM (fail closed).
	if e.PodIface && e.PodIfindex > 0 && uint32(e.PodIfindex) <= bpf.PolicyPodIfindexMask>>bpf.PolicyPodIfindexShift {
		v.Flags |= bpf.PolicyPodIface | uint32(e.PodIfindex)<<bpf.PolicyPodIfindexShift
	}
	return v
}

// Update implements reconciler.Operations: it applies the row in the
// order Policy describes.
func (o PolicyOps) Update(_ context.Context, txn statedb.ReadTxn, _ statedb.Revision, e *tables.EndpointPolicy) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if e.PodTree || e.Agent {
		return o.putTreeLocked(e)
	}
	if e.ID == 0 {
		// No cgroup known yet: nothing to enforce on, and nothing an
		// earlier row of the endpoint applied stays.
		return o.withdrawLocked(e)
	}
	prev, hadPrev := o.applied[e.Name]
	delete(o.orphanSets, e.ID)

	// 1. Every entry of the endpoint first, its denies before its allows.
	// A full map does not stop here: the endpoint fails closed (see
	// failClosedLocked) and its flags are written all the same, so that
	// a new default deny is enforced whatever other endpoints fill.
	want := map[bpf.PolicyKey]bpf.PolicyValue{}
	var setErr error
	for entry := range tables.PolicyEntriesOf(txn, o.Entries, e.Name) {
		if entry.EndpointID != e.ID {
			continue // written with the row that replaces this one
		}
		if entry.Identity == tables.PolicySetRef && len(entry.Policies) > 0 {
			// 0. The allows of the policy set it refers to, before the
			// reference: it never runs without them.
			if err := o.ensureSetLocked(txn, entry.Policies[0], entry.Cookie); err != nil {
				if !errors.Is(err, errPolicyMapFull) {
					return fmt.Errorf("endpoint %s not enforced until its policy is in the map: %w", e.Name, err)
				}
				setErr = errors.Join(setErr, err)
			}
		}
		k, v := PolicyKeyOf(entry)
		want[k] = v
	}
	var closed error
	if setErr != nil {
		closed = fmt.Errorf("endpoint %s fails closed, %w", e.Name, setErr)
	}
	err := o.putEntriesLocked(o.missingLocked(want, isDenyValue))
	if err == nil {
		err = o.putEntriesLocked(o.missingLocked(want, isAllowValue))
	}
	if err != nil {
		if !errors.Is(err, errPolicyMapFull) {
			return fmt.Errorf("endpoint %s not enforced until its policy is in the map: %w", e.Name, err)
		}
		if closed, err = o.failClosedLocked(e.ID, want); err != nil {
			return fmt.Errorf("endpoint %s: %w", e.Name, err)
		}
		closed = errors.Join(fmt.Errorf("endpoint %s fails closed, %w", e.Name, closed), setErr)
	}
	o.applied[e.Name] = appliedEndpoint{id: e.ID, cgroup: e.CgroupID}
	o.idOwner[e.ID] = e.Name

	// Its per-endpoint state, before the programs can use it. A failure
	// does not hold enforcement back: the row is retried.
	var stateErr error
	if o.endpointMaps != nil {
		if err := o.endpointMaps.Ensure(e); err != nil {
			stateErr = fmt.Errorf("endpoint %s: %w", e.Name, err)
		}
	}

	// 2. Its cgroup's entry; the cgroups it no longer has lose theirs.
	if e.CgroupID != 0 {
		if err := o.putEndpointLocked(e.CgroupID, EndpointValue(e)); err != nil {
			return fmt.Errorf("endpoint %s: %w", e.Name, err)
		}
		o.cgroupOwner[e.CgroupID] = e.Name
	}
	for cg, v := range o.endpoints.All() {
		if cg == e.CgroupID || (v.EndpointID != e.ID && !(hadPrev && cg == prev.cgroup)) {
			continue
		}
		if owner, ok := o.cgroupOwner[cg]; ok && owner != e.Name {
			continue // another endpoint's now
		}
		if err := o.deleteCgroupLocked(cg); err != nil {
			return err
		}
	}

	// 3. The entries it no longer has.
	var stale []bpf.PolicyKey
	for k := range o.byID[e.ID] {
		if _, ok := want[k]; !ok {
			stale = append(stale, k)
		}
	}
	if err := o.deleteEntriesLocked(stale); err != nil {
		return err
	}
	if hadPrev && prev.id != e.ID {
		if err := o.deleteEndpointEntriesLocked(prev.id, e.Name); err != nil {
			return err
		}
	}
	if err := o.dropOrphanSetsLocked(); err != nil {
		return err
	}
	// The row keeps the error while it fails closed: its status and the
	// reconciler's health say so, and the reconciler retries it.
	return errors.Join(closed, stateErr)
}

// ensureSetLocked writes the entries of policy set name (ID id) that the
// map does not hold as its rows say: what an endpoint that refers to it
// needs before its reference entry. A set holds allows only, so a full
// map leaves it lacking allows, which only deny (the error says how
// many); the set's own row is applied the same way.
func (o PolicyOps) ensureSetLocked(txn statedb.ReadTxn, name string, id uint32) error {
	p := o.Policy
	want := map[bpf.PolicyKey]bpf.PolicyValue{}
	for entry := range tables.PolicyEntriesOf(txn, o.Entries, name) {
		if entry.EndpointID == id && !entry.Deny {
			k, v := PolicyKeyOf(entry)
			want[k] = v
		}
	}
	// What the set no longer holds goes first (an earlier run's set of
	// the same number, or entries its row has not deleted yet): nothing
	// of it may allow more than its rows say.
	var stale []bpf.PolicyKey
	for k := range p.byID[id] {
		if _, ok := want[k]; !ok {
			stale = append(stale, k)
		}
	}
	if err := p.deleteEntriesLocked(stale); err != nil {
		return err
	}
	err := p.putEntriesLocked(p.missingLocked(want, isAllowValue))
	if err == nil || !errors.Is(err, errPolicyMapFull) {
		return err
	}
	keys, _ := p.missingLocked(want, isAllowValue)
	return fmt.Errorf("%w (%d entries): raise --%s; its policy set %s lacks %d allows (what they allow is denied)",
		errPolicyMapFull, p.maxCount, p.maxFlag, name, len(keys))
}

// setReferencedLocked says whether a reference entry in the map names
// policy set id: its entries stay until none does (Prune deletes them).
func (p *Policy) setReferencedLocked(id uint32) bool {
	for k := range p.refKeys {
		if v, ok := p.policy.Get(k); ok && v.Cookie == id {
			return true
		}
	}
	return false
}

func isDenyValue(v bpf.PolicyValue) bool  { return v.Flags&bpf.PolicyFlagDeny != 0 }
func isAllowValue(v bpf.PolicyValue) bool { return !isDenyValue(v) }

// missingLocked returns the entries of want, those pick takes, that the
// map does not hold as wanted.
func (p *Policy) missingLocked(want map[bpf.PolicyKey]bpf.PolicyValue, pick func(bpf.PolicyValue) bool) ([]bpf.PolicyKey, []bpf.PolicyValue) {
	var keys []bpf.PolicyKey
	var values []bpf.PolicyValue
	for k, v := range want {
		if !pick(v) {
			continue
		}
		if p.policy.Differs(k, v) {
			keys, values = append(keys, k), append(values, v)
		}
	}
	return keys, values
}

// failClosedLocked puts in the map what of endpoint id's wanted entries
// fits when not all do, so that what is missing can only deny: a missing
// allow denies (the endpoint is default deny where it has allows), but a
// missing deny could let a broader allow through, so a direction with a
// deny that does not fit loses all its allows and denies everything.
// It returns what the endpoint lacks (an error wrapping errPolicyMapFull),
// or the error of a write that failed otherwise.
//
// The order never loosens the map on the way: the entries the policy no
// longer allows go first (making room), then the denies are written; a
// direction whose denies are all in loses the denies it no longer has and
// gets what allows fit; one whose denies are not all in loses its allows
// before anything else of it goes.
func (p *Policy) failClosedLocked(id uint32, want map[bpf.PolicyKey]bpf.PolicyValue) (lacks, err error) {
	var staleAllows, staleDenies []bpf.PolicyKey
	for k := range p.byID[id] {
		if _, ok := want[k]; ok {
			continue
		}
		if v, _ := p.policy.Get(k); isDenyValue(v) {
			staleDenies = append(staleDenies, k)
		} else {
			staleAllows = append(staleAllows, k)
		}
	}
	if err := p.deleteEntriesLocked(staleAllows); err != nil {
		return nil, err
	}
	if err := p.putFittingLocked(p.missingLocked(want, isDenyValue)); err != nil {
		return nil, err
	}
	// closed: the directions (bpf.PolicyIngress, bpf.PolicyEgress) with
	// a deny not in the map.
	closed := map[uint8]bool{}
	keys, _ := p.missingLocked(want, isDenyValue)
	for _, k := range keys {
		closed[k.Egress] = true
	}
	var withdrawn []bpf.PolicyKey
	for k := range p.byID[id] {
		if v, _ := p.policy.Get(k); closed[k.Egress] && isAllowValue(v) {
			withdrawn = append(withdrawn, k)
		}
	}
	if err := p.deleteEntriesLocked(withdrawn); err != nil {
		return nil, err
	}
	if err := p.deleteEntriesLocked(staleDenies); err != nil {
		return nil, err
	}
	// Room made: the denies again (their cookies name the denying policy
	// in verdicts), then the allows of the directions not closed.
	if err := p.putFittingLocked(p.missingLocked(want, isDenyValue)); err != nil {
		return nil, err
	}
	allows := maps.Collect(func(yield func(bpf.PolicyKey, bpf.PolicyValue) bool) {
		for k, v := range want {
			if !closed[k.Egress] && !yield(k, v) {
				return
			}
		}
	})
	if err := p.putFittingLocked(p.missingLocked(allows, isAllowValue)); err != nil {
		return nil, err
	}
	return p.lacksLocked(want, closed), nil
}

// putFittingLocked writes entries while the map has room: a full map is
// no error here, what did not fit stays missing.
func (p *Policy) putFittingLocked(keys []bpf.PolicyKey, values []bpf.PolicyValue) error {
	if err := p.putEntriesLocked(keys, values); err != nil && !errors.Is(err, errPolicyMapFull) {
		return err
	}
	return nil
}

// lacksLocked says what of want the map lacks, by direction.
func (p *Policy) lacksLocked(want map[bpf.PolicyKey]bpf.PolicyValue, closed map[uint8]bool) error {
	var parts []string
	for _, dir := range []uint8{bpf.PolicyIngress, bpf.PolicyEgress} {
		name := "ingress"
		if dir == bpf.PolicyEgress {
			name = "egress"
		}
		allows, denies := 0, 0
		for k, v := range want {
			if k.Egress != dir || !p.policy.Differs(k, v) {
				continue
			}
			if isDenyValue(v) {
				denies++
			} else {
				allows++
			}
		}
		switch {
		case closed[dir]:
			parts = append(parts, fmt.Sprintf("%s denies everything (%d of its denies do not fit, so none of its %d allows may apply)",
				name, denies, countDir(want, dir, isAllowValue)))
		case allows > 0:
			parts = append(parts, fmt.Sprintf("%s lacks %d allows (what they allow is denied)", name, allows))
		}
	}
	return fmt.Errorf("%w (%d entries): raise --%s; %s", errPolicyMapFull, p.maxCount, p.maxFlag, strings.Join(parts, ", "))
}

// countDir counts the entries of want in direction dir that pick takes.
func countDir(want map[bpf.PolicyKey]bpf.PolicyValue, dir uint8, pick func(bpf.PolicyValue) bool) int {
	n := 0
	for k, v := range want {
		if k.Egress == dir && pick(v) {
			n++
		}
	}
	return n
}

// putTreeLocked writes the policy_endpoints entry of a pod tree's row or
// the agent's (no endpoint ID, no entries), and deletes the one of the cgroup the tree had
// before (the kubelet made it anew).
func (p *Policy) putTreeLocked(e *tables.EndpointPolicy) error {
	if err := p.putEndpointLocked(e.CgroupID, EndpointValue(e)); err != nil {
		return fmt.Errorf("endpoint %s: %w", e.Name, err)
	}
	p.cgroupOwner[e.CgroupID] = e.Name
	if prev, ok := p.applied[e.Name]; ok && prev.cgroup != e.CgroupID && p.cgroupOwner[prev.cgroup] == e.Name {
		if err := p.deleteCgroupLocked(prev.cgroup); err != nil {
			return err
		}
	}
	p.applied[e.Name] = appliedEndpoint{cgroup: e.CgroupID}
	return nil
}

// Delete implements reconciler.Operations: enforcement goes, then the
// entries.
func (o PolicyOps) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, e *tables.EndpointPolicy) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if e.Set && o.setReferencedLocked(e.ID) {
		// An endpoint's row that no longer names it is not applied yet:
		// its entries stay for it meanwhile, and go once no reference
		// does (or with Prune).
		delete(o.applied, e.Name)
		if o.orphanSets == nil {
			o.orphanSets = map[uint32]string{}
		}
		o.orphanSets[e.ID] = e.Name
		return nil
	}
	return errors.Join(o.withdrawLocked(e), o.dropOrphanSetsLocked())
}

// dropOrphanSetsLocked deletes the entries of the orphan sets that no
// reference entry in the map names any more.
func (p *Policy) dropOrphanSetsLocked() error {
	for id, name := range p.orphanSets {
		if p.setReferencedLocked(id) {
			continue
		}
		if err := p.deleteEndpointEntriesLocked(id, name); err != nil {
			return err
		}
		delete(p.orphanSets, id)
	}
	return nil
}

// withdrawLocked deletes the policy_endpoints entry and the entries that
// e's endpoint applied (or, not applied by this process, that e names),
// except those another endpoint has taken over since.
func (p *Policy) withdrawLocked(e *tables.EndpointPolicy) error {
	prev, ok := p.applied[e.Name]
	if !ok {
		prev = appliedEndpoint{id: e.ID, cgroup: e.CgroupID}
	}
	for _, cg := range []uint64{prev.cgroup, e.CgroupID} {
		if owner, taken := p.cgroupOwner[cg]; cg == 0 || (taken && owner != e.Name) {
			continue
		}
		if err := p.deleteCgroupLocked(cg); err != nil {
			return err
		}
	}
	for _, id := range []uint32{prev.id, e.ID} {
		if id != 0 {
			if err := p.deleteEndpointEntriesLocked(id, e.Name); err != nil {
				return err
			}
		}
	}
	delete(p.applied, e.Name)
	return nil
}

// deleteEndpointEntriesLocked deletes the entries of endpoint ID id,
// unless an endpoint other than name has taken the ID.
func (p *Policy) deleteEndpointEntriesLocked(id uint32, name string) error {
	if owner, ok := p.idOwner[id]; ok && owner != name {
		return nil
	}
	if err := p.deleteEntriesLocked(slices.Collect(maps.Keys(p.byID[id]))); err != nil {
		return err
	}
	if p.endpointMaps != nil {
		if err := p.endpointMaps.Remove(id); err != nil {
			return fmt.Errorf("endpoint ID %d: %w", id, err)
		}
	}
	delete(p.idOwner, id)
	return nil
}

func (p *Policy) deleteCgroupLocked(cg uint64) error {
	if _, ok := p.endpoints.Get(cg); ok {
		if err := p.endpoints.Delete(cg); err != nil {
			return err
		}
		if err := p.moveGenLocked(); err != nil {
			return fmt.Errorf("cgroup %d: %w", cg, err)
		}
	}
	delete(p.cgroupOwner, cg)
	return nil
}

// ResyncWith makes every Prune first compare the maps with what the
// operations wrote and repair them, reporting to d (nil: no resync).
func (p *Policy) ResyncWith(d *Drift) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.drift = d
}

// resyncLocked repairs drift of both maps (see Mirror.Resync).
func (p *Policy) resyncLocked() error {
	// Whatever the repair wrote, the programs' cache goes with it.
	return errors.Join(p.policy.Resync(p.drift), p.endpoints.Resync(p.drift), p.moveGenLocked())
}

// Prune implements reconciler.Operations: it repairs drift of the maps
// (ResyncWith), then what the maps hold that no row asks for (left by an
// earlier run) is deleted. What a row not applied
// yet (pending, or failed and to be retried) had applied stays: its
// Update replaces it in order.
func (o PolicyOps) Prune(_ context.Context, txn statedb.ReadTxn, rows iter.Seq2[*tables.EndpointPolicy, statedb.Revision]) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	resyncErr := o.resyncLocked()
	wantEntries := map[bpf.PolicyKey]struct{}{}
	wantCgroups := map[uint64]struct{}{}
	keepIDs := map[uint32]struct{}{}
	rowIDs := map[uint32]struct{}{}
	for e := range rows {
		rowIDs[e.ID] = struct{}{}
		if e.Status.Kind != reconciler.StatusKindDone {
			for _, id := range []uint32{e.ID, o.applied[e.Name].id} {
				keepIDs[id] = struct{}{}
			}
			for _, cg := range []uint64{e.CgroupID, o.applied[e.Name].cgroup} {
				wantCgroups[cg] = struct{}{}
			}
			continue
		}
		if e.PodTree || e.Agent {
			wantCgroups[e.CgroupID] = struct{}{}
			continue
		}
		if e.ID == 0 {
			continue
		}
		if e.CgroupID != 0 {
			wantCgroups[e.CgroupID] = struct{}{}
		}
		for entry := range tables.PolicyEntriesOf(txn, o.Entries, e.Name) {
			if entry.EndpointID == e.ID {
				k, _ := PolicyKeyOf(entry)
				wantEntries[k] = struct{}{}
			}
		}
	}
	// The policy sets that reference entries in the map name keep their
	// entries: an endpoint's row that no longer names one may not be
	// applied yet.
	for k := range o.refKeys {
		if v, ok := o.policy.Get(k); ok {
			keepIDs[v.Cookie] = struct{}{}
		}
	}
	var errs []error
	if o.endpointMaps != nil {
		// Any row's ID keeps its state: Update and Delete see to
		// those.
		keep := map[uint32]struct{}{}
		for id := range keepIDs {
			keep[id] = struct{}{}
		}
		for id := range o.idOwner {
			keep[id] = struct{}{}
		}
		for id := range rowIDs {
			keep[id] = struct{}{}
		}
		errs = append(errs, o.endpointMaps.Prune(keep))
	}
	for cg := range o.endpoints.All() {
		if _, ok := wantCgroups[cg]; !ok {
			errs = append(errs, o.deleteCgroupLocked(cg))
		}
	}
	for k := range o.policy.All() {
		if _, ok := keepIDs[k.EndpointID]; ok {
			continue
		}
		if _, ok := wantEntries[k]; !ok {
			errs = append(errs, o.policy.Delete(k))
		}
	}
	return errors.Join(append(errs, resyncErr)...)
}

// DumpPolicy calls fn with the policy map's entries, read from the map.
func (p *Policy) DumpPolicy(fn func(bpf.PolicyKey, bpf.PolicyValue)) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.policy.Dump(fn)
}

// RegisterPolicy registers the reconciler of the endpoint-policy table,
// which writes the policy and policy_endpoints maps with ops (see Policy),
// reading the endpoints' entries from entries.
func RegisterPolicy(params reconciler.Params, ops *Policy, entries statedb.Table[*tables.PolicyEntry],
	endpoints statedb.RWTable[*tables.EndpointPolicy], opts ...reconciler.Option,
) (reconciler.Reconciler[*tables.EndpointPolicy], error) {
	opts = append([]reconciler.Option{
		// Update writes only what differs from the copy of the maps, so
		// a refresh would only compare.
		reconciler.WithRefreshing(0, nil),
		// The DNS proxy holds answers until the entries are in the map.
		reconciler.WithRoundLimits(1000, rate.NewLimiter(rate.Inf, 1)),
	}, opts...)
	r, err := reconciler.Register(params, endpoints,
		(*tables.EndpointPolicy).Clone, (*tables.EndpointPolicy).SetStatus, (*tables.EndpointPolicy).GetStatus,
		ops.Ops(entries), nil, opts...)
	if err != nil {
		return nil, fmt.Errorf("register endpoint-policy reconciler: %w", err)
	}
	return r, nil
}
