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
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/sys/unix"
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
// It keeps a copy of what each map holds, read when the maps are opened,
// so that a restart with unchanged desired state writes nothing.
type Policy struct {
	log      *slog.Logger
	maxFlag  string
	maxCount uint32

	mu        sync.Mutex
	policy    *ebpf.Map
	endpoints *ebpf.Map
	entries   map[bpf.PolicyKey]bpf.PolicyValue
	// byID are the keys of entries by endpoint ID.
	byID map[uint32]map[bpf.PolicyKey]struct{}
	// cgroups is what policy_endpoints holds: cgroup ID → value.
	cgroups map[uint64]bpf.PolicyEndpointValue
	// applied is what each row applied last, by endpoint name; idOwner and
	// cgroupOwner name the endpoint that applied an ID or a cgroup, so
	// that a pod gone does not take away what a newer pod reuses.
	applied     map[string]appliedEndpoint
	idOwner     map[uint32]string
	cgroupOwner map[uint64]string

	// drift, if set, makes Prune a resync: the maps are read and what
	// differs from the copy is repaired and reported to it.
	drift *Drift

	writes, deletes atomic.Uint64

	// endpointMaps, if set, keeps per-endpoint state beside the maps.
	endpointMaps EndpointMaps
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
	return &Policy{
		log: log, maxFlag: maxFlag,
		entries: map[bpf.PolicyKey]bpf.PolicyValue{}, byID: map[uint32]map[bpf.PolicyKey]struct{}{},
		cgroups: map[uint64]bpf.PolicyEndpointValue{}, applied: map[string]appliedEndpoint{},
		idOwner: map[uint32]string{}, cgroupOwner: map[uint64]string{},
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
			// A pod tree's or the agent's entry holds no endpoint ID.
			if values[i].Flags&bpf.PolicyPodTree == 0 && values[i].EndpointID != 0 {
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
	byID := map[uint32]map[bpf.PolicyKey]struct{}{}
	for k := range entries {
		addKey(byID, k)
	}
	p.mu.Lock()
	p.policy, p.endpoints, p.entries, p.byID, p.cgroups, p.maxCount = pol.Map, eps.Map, entries, byID, cgroups, maxEntries
	clear(p.applied)
	clear(p.idOwner)
	clear(p.cgroupOwner)
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

// errPolicyMapFull is wrapped by the error of an entry the policy map had
// no room for.
var errPolicyMapFull = errors.New("policy map is full")

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
			return fmt.Errorf("%w (%d entries): raise --%s", errPolicyMapFull, p.maxCount, p.maxFlag)
		}
		return fmt.Errorf("write policy entry %s: %w", k, err)
	}
	p.writes.Add(1)
	p.entries[k] = v
	addKey(p.byID, k)
	return nil
}

// batchSize bounds the entries of one batch syscall: the gain per entry
// is small beyond about a thousand (docs/benchmarks.md), and the kernel
// copies the whole batch in.
const batchSize = 4096

// putEntriesLocked writes entries that differ from the copy, in batches
// (one syscall each instead of one per entry). An entry a batch could not
// write, and those after it, are written one by one, so that an error
// names its entry and a full map is reported as such; at most three
// errors are collected.
func (p *Policy) putEntriesLocked(keys []bpf.PolicyKey, values []bpf.PolicyValue) error {
	if len(keys) == 0 {
		return nil
	}
	if p.policy == nil {
		return errors.New("policy map not open")
	}
	for len(keys) > 0 {
		n := min(len(keys), batchSize)
		done, err := p.policy.BatchUpdate(keys[:n], values[:n], nil)
		done = max(0, min(done, n))
		if err != nil && done == n {
			done = 0 // a count not to be trusted: write them one by one
		}
		for i := range done {
			p.entries[keys[i]] = values[i]
			addKey(p.byID, keys[i])
		}
		p.writes.Add(uint64(done))
		keys, values = keys[done:], values[done:]
		if err != nil {
			return p.putEachLocked(keys, values)
		}
	}
	return nil
}

// putEachLocked writes entries one by one, collecting up to three errors.
func (p *Policy) putEachLocked(keys []bpf.PolicyKey, values []bpf.PolicyValue) error {
	var errs []error
	for i, k := range keys {
		if err := p.putEntryLocked(k, values[i]); err != nil {
			errs = append(errs, err)
			if len(errs) == 3 {
				break
			}
		}
	}
	return errors.Join(errs...)
}

// deleteEntriesLocked deletes entries in batches; a batch that fails
// (an entry already gone from the map, say) is finished one by one.
func (p *Policy) deleteEntriesLocked(keys []bpf.PolicyKey) error {
	if len(keys) == 0 {
		return nil
	}
	if p.policy == nil {
		return errors.New("policy map not open")
	}
	for len(keys) > 0 {
		n := min(len(keys), batchSize)
		done, err := p.policy.BatchDelete(keys[:n], nil)
		done = max(0, min(done, n))
		if err != nil && done == n {
			done = 0
		}
		for _, k := range keys[:done] {
			p.forgetEntryLocked(k)
		}
		p.deletes.Add(uint64(done))
		keys = keys[done:]
		if err != nil {
			for _, k := range keys {
				if err := p.deleteEntryLocked(k); err != nil {
					return err
				}
			}
			return nil
		}
	}
	return nil
}

func addKey(byID map[uint32]map[bpf.PolicyKey]struct{}, k bpf.PolicyKey) {
	if byID[k.EndpointID] == nil {
		byID[k.EndpointID] = map[bpf.PolicyKey]struct{}{}
	}
	byID[k.EndpointID][k] = struct{}{}
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
	p.forgetEntryLocked(k)
	return nil
}

// forgetEntryLocked removes a deleted entry from the copy.
func (p *Policy) forgetEntryLocked(k bpf.PolicyKey) {
	delete(p.entries, k)
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

	// 1. Every entry of the endpoint first, its denies before its allows.
	// A full map does not stop here: the endpoint fails closed (see
	// failClosedLocked) and its flags are written all the same, so that
	// a new default deny is enforced whatever other endpoints fill.
	want := map[bpf.PolicyKey]bpf.PolicyValue{}
	for entry := range tables.PolicyEntriesOf(txn, o.Entries, e.Name) {
		if entry.EndpointID != e.ID {
			continue // written with the row that replaces this one
		}
		k, v := PolicyKeyOf(entry)
		want[k] = v
	}
	var closed error
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
		closed = fmt.Errorf("endpoint %s fails closed, %w", e.Name, closed)
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
		v := EndpointValue(e)
		if old, ok := o.cgroups[e.CgroupID]; !ok || old != v {
			if o.endpoints == nil {
				return errors.New("policy_endpoints map not open")
			}
			if err := o.endpoints.Put(e.CgroupID, v); err != nil {
				return fmt.Errorf("write policy_endpoints entry of %s: %w", e.Name, err)
			}
			o.writes.Add(1)
			o.cgroups[e.CgroupID] = v
		}
		o.cgroupOwner[e.CgroupID] = e.Name
	}
	for cg, v := range o.cgroups {
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
	// The row keeps the error while it fails closed: its status and the
	// reconciler's health say so, and the reconciler retries it.
	return errors.Join(closed, stateErr)
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
		if old, ok := p.entries[k]; !ok || old != v {
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
		if isDenyValue(p.entries[k]) {
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
		if closed[k.Egress] && isAllowValue(p.entries[k]) {
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
			if old, ok := p.entries[k]; k.Egress != dir || (ok && old == v) {
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
	v := EndpointValue(e)
	if old, ok := p.cgroups[e.CgroupID]; !ok || old != v {
		if p.endpoints == nil {
			return errors.New("policy_endpoints map not open")
		}
		if err := p.endpoints.Put(e.CgroupID, v); err != nil {
			return fmt.Errorf("write policy_endpoints entry of %s: %w", e.Name, err)
		}
		p.writes.Add(1)
		p.cgroups[e.CgroupID] = v
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
	return o.withdrawLocked(e)
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
	if _, ok := p.cgroups[cg]; !ok {
		delete(p.cgroupOwner, cg)
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

// resyncLocked repairs drift of both maps (see resyncMap).
func (p *Policy) resyncLocked() error {
	if p.drift == nil || p.policy == nil || p.endpoints == nil {
		return nil
	}
	c, err := resyncMap(p.policy, p.entries)
	errs := []error{err, p.drift.Report(bpf.PolicyMap, c)}
	c, err = resyncMap(p.endpoints, p.cgroups)
	errs = append(errs, err, p.drift.Report(bpf.PolicyEndpointsMap, c))
	return errors.Join(errs...)
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
	for cg := range o.cgroups {
		if _, ok := wantCgroups[cg]; !ok {
			errs = append(errs, o.deleteCgroupLocked(cg))
		}
	}
	for k := range o.entries {
		if _, ok := keepIDs[k.EndpointID]; ok {
			continue
		}
		if _, ok := wantEntries[k]; !ok {
			errs = append(errs, o.deleteEntryLocked(k))
		}
	}
	return errors.Join(append(errs, resyncErr)...)
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
