package policy

import (
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/tables"
)

// Enforcement modes (--enable-policy).
const (
	// ModeDefault enforces a direction of an endpoint once a policy with
	// rules in that direction selects it.
	ModeDefault = "default"
	// ModeAlways enforces every endpoint in both directions: an endpoint
	// no policy selects is denied everything.
	ModeAlways = "always"
	// ModeNever enforces nothing: no entries, no programs.
	ModeNever = "never"
)

// LocalhostEntryPolicy names, in entries and verdicts, the allow of the
// node's traffic to its pods (--allow-localhost=always).
const LocalhostEntryPolicy = "allow-localhost"

// Map directions, as in the policy map key.
const (
	dirIngress uint8 = 0
	dirEgress  uint8 = 1
)

func dirName(d uint8) string {
	if d == dirEgress {
		return tables.DirEgress
	}
	return tables.DirIngress
}

// entryKey is an entry of an endpoint's policy without the endpoint.
type entryKey struct {
	identity uint32
	dir      uint8
	port     portKey
}

// groupKey gathers the entries of one remote identity in one direction,
// among which deny must win whatever the prefix lengths (see
// endpoint.recomputeGroup).
type groupKey struct {
	identity uint32
	dir      uint8
}

// contrib is a rule's contribution to an entry: allow or deny, by a policy;
// podAddrs for an allow through a peer that matches pods' addresses too
// (tables.MatchesPodAddrs).
type contrib struct {
	policy   string
	deny     bool
	podAddrs bool
	// tier is the layer of the rule (layerRules for NetworkPolicy and
	// CNP rules); a tiered (ClusterNetworkPolicy) one has its pass,
	// order (priority, then index) and label.
	tier     uint8
	pass     bool
	priority int32
	index    int32
	label    string
}

// Layers of a contribution, in the order they decide (docs/policy.md,
// Tiers): the Admin tier, NetworkPolicy and CNP rules, the Baseline
// tier, then the default allow of a direction no policy puts into
// default deny.
const (
	layerRules uint8 = iota
	layerAdmin
	layerBaseline
	layerDefault
)

// before says whether tiered contribution a comes before b in its tier:
// lower priority first; the API leaves policies of the same priority
// unordered, apiary orders them by name; then the rules' order.
func (a *contrib) before(b *contrib) bool {
	switch {
	case a.priority != b.priority:
		return a.priority < b.priority
	case a.policy != b.policy:
		return a.policy < b.policy
	}
	return a.index < b.index
}

// contribCount is a contribution and how many rules make it. An entry has
// few distinct contributions (one per policy and verdict), so a slice
// scanned in full costs less than a map per entry, which a policy of
// thousands of entries would allocate thousands of.
type contribCount struct {
	contrib
	n int
}

// entryValue is what an entry decides, and who decided it.
type entryValue struct {
	deny bool
	// final: decides alone (tables.PolicyEntry.Final); pass: decides
	// nothing (tables.PolicyEntry.Pass).
	final, pass bool
	// audit: a deny that only audited policies make.
	audit bool
	// drop: a deny a ClusterNetworkPolicy Deny rule decided
	// (tables.PolicyEntry.Drop).
	drop bool
	// podAddrs: an allow that matches pods' addresses too
	// (tables.PolicyEntry.PodAddrs).
	podAddrs bool
	policies []string
}

func (v entryValue) equal(o entryValue) bool {
	return v.deny == o.deny && v.final == o.final && v.pass == o.pass && v.audit == o.audit && v.drop == o.drop &&
		v.podAddrs == o.podAddrs && slices.Equal(v.policies, o.policies)
}

// rule is one rule of a policy as it applies to one endpoint: its ports
// resolved for the endpoint, its peers to be expanded into identities.
type rule struct {
	ep     *endpoint
	policy string
	dir    uint8
	deny   bool
	peers  []string // selectors; tables.AnyPeer is identity 0
	ports  []portKey
	// tier, pass, priority, index, label: a ClusterNetworkPolicy rule's
	// (see contrib).
	tier     uint8
	pass     bool
	priority int32
	index    int32
	label    string
}

// endpoint is a local endpoint and its policy.
type endpoint struct {
	row *tables.Endpoint
	id  uint32

	rules           []*rule
	policies        []string
	ingress, egress string
	// auditIngress, auditEgress: the direction's default deny comes only
	// from audited policies.
	auditIngress, auditEgress bool
	// rulesDeny: a NetworkPolicy or CNP (not the mode) puts the
	// direction (by map direction) into default deny, so that layer
	// decides every connection there and the Baseline tier none.
	rulesDeny       [2]bool
	usesNamedEgress bool
	// dns are the names the DNS rules of its egress policy allow to look
	// up, by pattern; empty when it has no DNS rule.
	dns []tables.DNSRule
	// reason says why the endpoint is not enforced as its policies say
	// (see engine.reason for the rest).
	reason string
	// ambiguous are the port names of the rules that stand for several
	// numbers (see portKeys), by policy.
	ambiguous []policyWarning
	// failClosed are the invalid policies that select the endpoint (so
	// deny it in their directions); failIngress and failEgress those of
	// each direction.
	failClosed              []string
	failIngress, failEgress []string
	contribs                map[entryKey][]contribCount
	groups                  map[groupKey][]portKey // keys with contributions, each once
	dirtyGroups             map[groupKey]struct{}
	emitted                 map[groupKey][]portEntry // each sorted by port
	emittedCount            int
	lastRow                 *tables.EndpointPolicy
	// sets are the policy sets whose allows the endpoint shares, by map
	// direction; sharedRules what it put there (for verdicts' names).
	sets        [2]*policySet
	sharedRules []tables.SharedRule
	// set is the policy set this pseudo-endpoint holds the entries of
	// (nil for an endpoint).
	set *policySet
}

// engine computes the policy entries of every local endpoint from the
// policies' specs, the identities each selector selects (the selectors
// table) and the endpoints. A change costs what it touches: a selector
// gaining an identity adds the entries of the rules that name the
// selector, on the endpoints those rules apply to, and recomputes only the
// (endpoint, identity, direction) groups it touched; a policy or endpoint
// change recomputes the endpoints concerned.
//
// It is not safe for concurrent use.
type engine struct {
	mode  string
	audit bool
	// denyPending denies, in both directions, an endpoint whose identity
	// is not known yet (--unclassified-pods=deny), instead of letting it
	// run unenforced.
	denyPending bool
	// allowLocalhost: the host may reach every endpoint in ingress
	// (--allow-localhost=always).
	allowLocalhost bool
	// dnsProxy: the DNS proxy intercepts (--dns-proxy-addr set,
	// --dns-intercept). Without it a ClusterNetworkPolicy domainNames
	// rule does not intercept its subjects' DNS, which would then be
	// denied: the rule matches nothing, as the API's fail closed of an
	// Accept rule says.
	dnsProxy bool

	specs     map[string][]tables.PolicySpec // by policy
	audited   map[string]bool                // policies whose denies are audited
	invalid   map[string]string              // policies failing closed → their error
	subjects  map[string]int                 // subject selector → specs using it
	selectors map[string]map[uint32]struct{} // selector → identities (the selectors table)
	endpoints map[string]*endpoint
	// byIdentity are the local endpoints of each identity.
	byIdentity map[uint32]map[*endpoint]struct{}
	// peerUsers are the rules that name each peer selector.
	peerUsers map[string]map[*rule]struct{}

	// Endpoint IDs: restored (by cgroup) from the map at start, in use, next.
	restored map[uint64]uint32
	// reserved are the restored IDs, which no new endpoint or set takes.
	reserved map[uint32]struct{}
	usedIDs  map[uint32]*endpoint
	nextID   uint32

	dirty map[*endpoint]struct{} // to recompute in full
	// gone are endpoints deleted since the last flush, whose rows go.
	gone map[string]*endpoint
	// noIface are the endpoints whose interface cannot be found (the
	// pod-interfaces rows failing closed), with why: denied both ways.
	noIface map[string]string
	// ifaceDone is the cgroup each endpoint's interface is enforced for
	// (its pod-interfaces row reconciled: programs attached, entry
	// written), by endpoint name: its row gets PodIface.
	ifaceDone map[string]ifaceDone

	// shareMin is how many identities a peer selector selects from which
	// its allows go into policy sets (0: never; --policy-share-min-identities).
	shareMin int
	// sets are the policy sets, by key (setKey).
	sets map[string]*policySet
}

// ifaceDone is an enforced interface: for which cgroup, and the index of
// its pod side in the pod's network namespace.
type ifaceDone struct {
	cgroupID    uint64
	peerIfindex int
}

func newEngine(mode string, audit bool, restored map[uint64]uint32) *engine {
	e := &engine{
		mode: mode, audit: audit,
		specs: map[string][]tables.PolicySpec{}, audited: map[string]bool{}, invalid: map[string]string{},
		subjects:  map[string]int{},
		selectors: map[string]map[uint32]struct{}{}, endpoints: map[string]*endpoint{},
		byIdentity: map[uint32]map[*endpoint]struct{}{}, peerUsers: map[string]map[*rule]struct{}{},
		restored: restored, usedIDs: map[uint32]*endpoint{}, nextID: 1,
		dirty: map[*endpoint]struct{}{}, gone: map[string]*endpoint{},
		noIface: map[string]string{}, ifaceDone: map[string]ifaceDone{},
		sets: map[string]*policySet{},
	}
	e.reserved = make(map[uint32]struct{}, len(restored))
	for _, id := range restored {
		e.reserved[id] = struct{}{}
		if id >= e.nextID {
			e.nextID = id + 1
		}
	}
	return e
}

// setPolicy replaces the specs of a policy (nil: the policy is gone or
// ignored); audit makes its denies audited. invalid is the error of an
// invalid policy whose specs are its fail-closed ones, which the rows of
// the endpoints it selects show. The same specs again change nothing.
func (e *engine) setPolicy(name string, specs []tables.PolicySpec, audit bool, invalid string) {
	if old, ok := e.specs[name]; ok && e.audited[name] == audit && e.invalid[name] == invalid && reflect.DeepEqual(old, specs) {
		return
	}
	if audit {
		e.audited[name] = true
	} else {
		delete(e.audited, name)
	}
	if invalid != "" && len(specs) > 0 {
		e.invalid[name] = invalid
	} else {
		delete(e.invalid, name)
	}
	for _, s := range e.specs[name] {
		e.markSelected(s.Subject)
		if e.subjects[s.Subject]--; e.subjects[s.Subject] <= 0 {
			delete(e.subjects, s.Subject)
		}
	}
	delete(e.specs, name)
	if len(specs) == 0 {
		return
	}
	e.specs[name] = specs
	for _, s := range specs {
		e.subjects[s.Subject]++
		e.markSelected(s.Subject)
	}
}

// markSelected marks the endpoints a subject selects for a full
// recompute.
func (e *engine) markSelected(subject string) {
	for id := range e.selectors[subject] {
		for ep := range e.byIdentity[id] {
			e.dirty[ep] = struct{}{}
		}
	}
}

// setSelector sets the identities a selector selects (nil: the selector
// is gone).
func (e *engine) setSelector(name string, ids []uint32) {
	old := e.selectors[name]
	next := make(map[uint32]struct{}, len(ids))
	for _, id := range ids {
		next[id] = struct{}{}
	}
	var added, removed []uint32
	for id := range next {
		if _, ok := old[id]; !ok {
			added = append(added, id)
		}
	}
	for id := range old {
		if _, ok := next[id]; !ok {
			removed = append(removed, id)
		}
	}
	if len(added) == 0 && len(removed) == 0 {
		if ids == nil {
			delete(e.selectors, name)
		}
		return
	}
	if ids == nil {
		delete(e.selectors, name)
	} else {
		e.selectors[name] = next
	}
	// Crossing the sharing threshold moves the rules naming it between
	// endpoints' own entries and policy sets.
	if e.shareMin > 0 && (len(old) >= e.shareMin) != (len(next) >= e.shareMin) {
		for r := range e.peerUsers[name] {
			if r.ep.set != nil {
				for u := range r.ep.set.users {
					e.dirty[u] = struct{}{}
				}
			} else {
				e.dirty[r.ep] = struct{}{}
			}
		}
	}
	// As a subject: the endpoints of the identities it gained or lost now
	// have other policies.
	if e.subjects[name] > 0 {
		for _, id := range append(slices.Clone(added), removed...) {
			for ep := range e.byIdentity[id] {
				e.dirty[ep] = struct{}{}
			}
		}
	}
	// As a peer: the rules naming it gain and lose entries. Endpoints to
	// be recomputed in full anyway are left alone.
	podAddrs := tables.MatchesPodAddrs(name)
	for r := range e.peerUsers[name] {
		if _, ok := e.dirty[r.ep]; ok {
			continue
		}
		for _, id := range added {
			r.ep.addIdentity(r, id, 1, podAddrs)
		}
		for _, id := range removed {
			r.ep.addIdentity(r, id, -1, podAddrs)
		}
	}
}

// setEndpoint sets a local endpoint (nil: it is gone).
func (e *engine) setEndpoint(name string, row *tables.Endpoint) {
	ep := e.endpoints[name]
	if ep != nil {
		e.unindex(ep)
		if row == nil || ep.row.Identity != row.Identity {
			delete(e.byIdentity[ep.row.Identity], ep)
		}
		if ep.row != nil && row != nil && !slices.Equal(ep.row.NamedPorts, row.NamedPorts) {
			e.namedPortsChanged()
		}
	}
	if row == nil {
		if ep != nil {
			old := ep.sets
			ep.sets = [2]*policySet{}
			e.releaseSets(ep, old)
			delete(e.endpoints, name)
			delete(e.dirty, ep)
			if ep.id != 0 {
				delete(e.usedIDs, ep.id)
			}
			e.gone[name] = ep
			if len(ep.row.NamedPorts) > 0 {
				e.namedPortsChanged()
			}
		}
		return
	}
	if ep == nil {
		// An endpoint deleted and added back before a flush keeps what
		// was emitted for it, so that the flush writes the difference.
		if ep = e.gone[name]; ep != nil {
			delete(e.gone, name)
			if ep.id != 0 && e.usedIDs[ep.id] == nil {
				e.usedIDs[ep.id] = ep
			} else {
				ep.id = 0
			}
		} else {
			ep = &endpoint{emitted: map[groupKey][]portEntry{}}
		}
		e.endpoints[name] = ep
		if len(row.NamedPorts) > 0 {
			e.namedPortsChanged()
		}
	}
	ep.row = row
	if e.byIdentity[row.Identity] == nil {
		e.byIdentity[row.Identity] = map[*endpoint]struct{}{}
	}
	e.byIdentity[row.Identity][ep] = struct{}{}
	e.dirty[ep] = struct{}{}
}

// setNoInterface says that the interface of endpoint name cannot be found,
// and why ("": it can, or the endpoint has its own namespace no more): the
// endpoint is denied both ways meanwhile, at the socket level, so that a
// pod that hides its interface is not left open.
func (e *engine) setNoInterface(name, why string) {
	if e.noIface[name] == why {
		return
	}
	if why == "" {
		delete(e.noIface, name)
	} else {
		e.noIface[name] = why
	}
	if ep := e.endpoints[name]; ep != nil {
		e.dirty[ep] = struct{}{}
	}
}

// setInterfaceDone says for which cgroup the interface of endpoint name
// is enforced (0: none), and its pod side's index: only then does its row
// get PodIface.
func (e *engine) setInterfaceDone(name string, cgroupID uint64, peerIfindex int) {
	done := ifaceDone{cgroupID, peerIfindex}
	if e.ifaceDone[name] == done {
		return
	}
	if cgroupID == 0 {
		delete(e.ifaceDone, name)
	} else {
		e.ifaceDone[name] = done
	}
	if ep := e.endpoints[name]; ep != nil {
		e.dirty[ep] = struct{}{}
	}
}

// namedPortsChanged marks the endpoints whose egress rules name ports,
// which resolve against every local endpoint's named ports.
func (e *engine) namedPortsChanged() {
	for _, ep := range e.endpoints {
		if ep.usesNamedEgress {
			e.dirty[ep] = struct{}{}
		}
	}
}

// unindex forgets the rules of ep.
func (e *engine) unindex(ep *endpoint) {
	for _, r := range ep.rules {
		for _, p := range r.peers {
			if users := e.peerUsers[p]; users != nil {
				delete(users, r)
				if len(users) == 0 {
					delete(e.peerUsers, p)
				}
			}
		}
	}
	ep.rules = nil
}

// namedPorts returns the ports called name: the endpoint's own for
// ingress, those of every local endpoint for egress.
func (e *engine) namedPorts(ep *endpoint, dir uint8) func(string) []tables.NamedPort {
	return func(name string) []tables.NamedPort {
		var out []tables.NamedPort
		add := func(row *tables.Endpoint) {
			for _, np := range row.NamedPorts {
				if np.Name == name && !slices.Contains(out, np) {
					out = append(out, np)
				}
			}
		}
		if dir == dirIngress {
			add(ep.row)
			return out
		}
		ep.usesNamedEgress = true
		for _, name := range slices.Sorted(maps.Keys(e.endpoints)) {
			add(e.endpoints[name].row)
		}
		return out
	}
}

// policyWarning is something wrong with a policy that does not make it
// invalid.
type policyWarning struct {
	policy, text string
}

// warnings returns what is wrong with each policy on this node's
// endpoints: the port names that stand for several numbers.
func (e *engine) warnings() map[string][]string {
	out := map[string][]string{}
	for _, ep := range e.endpoints {
		for _, w := range ep.ambiguous {
			if !slices.Contains(out[w.policy], w.text) {
				out[w.policy] = append(out[w.policy], w.text)
			}
		}
	}
	for _, ws := range out {
		slices.Sort(ws)
	}
	return out
}

// recompute rebuilds the rules and contributions of ep: what selects it,
// the state of each direction, the entries every policy implies, then its
// rules' entries and the policy sets it shares.
func (e *engine) recompute(ep *endpoint) {
	e.unindex(ep)
	oldSets := ep.sets
	defer func() { e.releaseSets(ep, oldSets) }()
	ep.reset()
	if e.mode == ModeNever || e.unenforced(ep) {
		return
	}
	selected := e.selectedSpecs(ep)
	on, allow := e.directions(ep, selected)
	if ep.id == 0 {
		return // no cgroup yet: nothing to enforce on
	}
	if e.allowLocalhost && ep.ingress == tables.EnforceDefaultDeny {
		// The node reaches its pods whatever the policy (kubelet's
		// probes); a deny of the host still wins over this allow.
		ep.add(entryKey{identity: identity.IDHost, dir: dirIngress, port: anyPort}, contrib{policy: LocalhostEntryPolicy}, 1)
	}
	for dir, policies := range allow {
		for _, p := range policies {
			ep.add(entryKey{dir: uint8(dir), port: anyPort}, contrib{policy: p, tier: layerDefault}, 1)
		}
	}
	shared, interceptBy := e.addRules(ep, selected, on)
	if len(ep.dns) == 0 && interceptBy != "" {
		// Only domainNames rules: intercepted, every name allowed, as
		// without interception.
		ep.dns = []tables.DNSRule{{Pattern: "*", Policy: interceptBy}}
	}
	slices.SortFunc(ep.dns, func(a, b tables.DNSRule) int { return strings.Compare(a.Pattern, b.Pattern) })
	for dir, peers := range shared {
		if len(peers) == 0 {
			continue
		}
		set := e.acquireSet(uint8(dir), peers, ep)
		ep.sets[dir] = set
		ep.add(entryKey{identity: tables.PolicySetRef, dir: uint8(dir), port: anyPort}, contrib{policy: set.name}, 1)
	}
}

// reset forgets what the last recompute of ep found.
func (ep *endpoint) reset() {
	ep.sets, ep.sharedRules = [2]*policySet{}, nil
	// Cleared rather than made anew: a recompute usually gives about as
	// many entries as the last one, and the maps keep their room.
	if ep.contribs == nil {
		ep.contribs, ep.groups, ep.dirtyGroups = map[entryKey][]contribCount{}, map[groupKey][]portKey{}, map[groupKey]struct{}{}
	}
	clear(ep.contribs)
	clear(ep.groups)
	for gk := range ep.emitted {
		ep.dirtyGroups[gk] = struct{}{}
	}
	ep.policies, ep.usesNamedEgress, ep.ambiguous, ep.dns = nil, false, nil, nil
	ep.failClosed, ep.failIngress, ep.failEgress = nil, nil, nil
	ep.ingress, ep.egress = tables.EnforceOff, tables.EnforceOff
	ep.auditIngress, ep.auditEgress = false, false
	ep.rulesDeny = [2]bool{}
	ep.reason = ""
}

// unenforced gives ep its ID once it can have one, and says whether its
// policies are set aside (host network, identity pending, no interface),
// its state and reason set.
func (e *engine) unenforced(ep *endpoint) bool {
	// A pod whose identity is not known yet gets no ID (nothing is
	// written for it): the pod tree denies its processes as unclassified
	// until the identity comes, with no map write to undo then.
	if ep.id == 0 && ep.row.CgroupID != 0 && !e.pending(ep) {
		ep.id = e.allocateID(ep)
	}
	switch {
	case ep.row.HostNetwork:
		// Registered, so that its cgroup is not unclassified, and
		// never enforced: policy applies to it as the host.
		ep.reason = reasonHostNetwork
	case e.pending(ep):
		ep.ingress, ep.egress = tables.EnforceDefaultDeny, tables.EnforceDefaultDeny
		ep.reason = reasonPending
		if ep.row.Error != "" {
			ep.reason += ": " + ep.row.Error
		}
	case e.noIface[ep.row.Name] != "" && ep.id != 0:
		// Default deny with no entries: the cgroup programs deny it
		// both ways.
		ep.ingress, ep.egress = tables.EnforceDefaultDeny, tables.EnforceDefaultDeny
		ep.reason = tables.ReasonFailClosed + reasonNoInterface + ": " + e.noIface[ep.row.Name]
	default:
		return false
	}
	return true
}

// selectedSpec is a spec of a policy that selects an endpoint.
type selectedSpec struct {
	policy string
	spec   *tables.PolicySpec
}

// selectedSpecs returns the specs that select ep, by policy name.
func (e *engine) selectedSpecs(ep *endpoint) []selectedSpec {
	if ep.row.Identity == 0 {
		return nil
	}
	var selected []selectedSpec
	for _, name := range slices.Sorted(maps.Keys(e.specs)) {
		specs := e.specs[name]
		for i := range specs {
			if _, ok := e.selectors[specs[i].Subject][ep.row.Identity]; ok {
				selected = append(selected, selectedSpec{name, &specs[i]})
			}
		}
	}
	return selected
}

// directions sets ep's policies, the invalid ones it fails closed for and
// the state of each direction: on when a selecting spec has rules there
// (or always); default deny unless every such spec turned it off. It
// returns, by map direction, whether it is on, and when not default deny
// the policies that allow it all.
func (e *engine) directions(ep *endpoint, selected []selectedSpec) (on [2]bool, allow [2][]string) {
	var deny [2]bool
	// Default deny by a policy that is not audited (or by the mode).
	var enforced [2]bool
	if e.mode == ModeAlways {
		on, deny, enforced = [2]bool{true, true}, [2]bool{true, true}, [2]bool{true, true}
	}
	for _, s := range selected {
		if !slices.Contains(ep.policies, s.policy) {
			ep.policies = append(ep.policies, s.policy)
		}
		if _, bad := e.invalid[s.policy]; bad {
			if !slices.Contains(ep.failClosed, s.policy) {
				ep.failClosed = append(ep.failClosed, s.policy)
			}
			if s.spec.Ingress && !slices.Contains(ep.failIngress, s.policy) {
				ep.failIngress = append(ep.failIngress, s.policy)
			}
			if s.spec.Egress && !slices.Contains(ep.failEgress, s.policy) {
				ep.failEgress = append(ep.failEgress, s.policy)
			}
		}
		for _, d := range []struct {
			dir          uint8
			has, denyAll bool
		}{{dirIngress, s.spec.Ingress, s.spec.DefaultDenyIngress}, {dirEgress, s.spec.Egress, s.spec.DefaultDenyEgress}} {
			if !d.has {
				continue
			}
			on[d.dir] = true
			if d.denyAll {
				deny[d.dir] = true
				ep.rulesDeny[d.dir] = true
				enforced[d.dir] = enforced[d.dir] || !e.audited[s.policy]
			} else {
				allow[d.dir] = append(allow[d.dir], s.policy)
			}
		}
	}
	ep.ingress, ep.egress = enforceState(on[dirIngress], deny[dirIngress]), enforceState(on[dirEgress], deny[dirEgress])
	ep.auditIngress, ep.auditEgress = deny[dirIngress] && !enforced[dirIngress], deny[dirEgress] && !enforced[dirEgress]
	for dir := range allow {
		if !on[dir] || deny[dir] {
			allow[dir] = nil
		}
	}
	return on, allow
}

// addRules adds the rules of the selected specs in the directions that are
// on to ep, with their peers' identities, and its DNS rules. It returns
// the peers, by map direction, whose allows go into a policy set, and the
// first policy whose domainNames rule wants ep's DNS intercepted.
func (e *engine) addRules(ep *endpoint, selected []selectedSpec, on [2]bool) (shared [2][]sharedPeer, interceptBy string) {
	// A direction with ClusterNetworkPolicy rules shares nothing: its
	// tiered groups fold every rule of the peer (decideTiered).
	var tiered [2]bool
	for _, s := range selected {
		for i := range s.spec.Rules {
			if pr := &s.spec.Rules[i]; tierLayer(pr.Tier) != layerRules {
				tiered[ruleDir(pr)] = true
			}
		}
	}
	for _, s := range selected {
		for i := range s.spec.Rules {
			pr := &s.spec.Rules[i]
			dir := ruleDir(pr)
			if !on[dir] {
				continue
			}
			ports, ambiguous := portKeys(pr.Ports, e.namedPorts(ep, dir))
			for _, a := range ambiguous {
				where := "egress, among the pods of this node"
				if dir == dirIngress {
					where = "ingress of " + ep.row.Name
				}
				ep.ambiguous = append(ep.ambiguous, policyWarning{s.policy, where + ": " + a})
			}
			if dir == dirEgress && !pr.Deny && !pr.Pass && pr.Tier != "" && len(pr.DNS) > 0 {
				// A ClusterNetworkPolicy domainNames rule needs the
				// endpoint's DNS seen, not a name allowed: it must not
				// widen the names other policies' DNS rules allow.
				if interceptBy == "" && e.dnsProxy {
					interceptBy = s.policy
				}
			} else if dir == dirEgress && !pr.Deny && !pr.Pass {
				for _, n := range pr.DNS {
					if !slices.ContainsFunc(ep.dns, func(r tables.DNSRule) bool { return r.Pattern == n }) {
						ep.dns = append(ep.dns, tables.DNSRule{Pattern: n, Policy: s.policy})
					}
				}
			}
			peers := pr.Peers
			if dir == dirEgress && !pr.Deny && !pr.Pass {
				peers = withEndpointFQDN(peers, ep.row.Name)
			}
			if len(ports) == 0 {
				continue
			}
			if e.shareMin > 0 && !pr.Deny && !pr.Pass && tierLayer(pr.Tier) == layerRules && !tiered[dir] {
				peers = e.share(ep, s.policy, dir, peers, ports, &shared[dir])
				if len(peers) == 0 {
					continue
				}
			}
			e.addRule(ep, &rule{ep: ep, policy: s.policy, dir: dir, deny: pr.Deny, peers: peers, ports: ports,
				tier: tierLayer(pr.Tier), pass: pr.Pass, priority: pr.Priority, index: pr.Index, label: pr.Label})
		}
	}
	return shared, interceptBy
}

// ruleDir is the map direction of a spec's rule.
func ruleDir(pr *tables.PolicyRule) uint8 {
	if pr.Direction == tables.DirEgress {
		return dirEgress
	}
	return dirIngress
}

// addRule adds r to its endpoint with the identities of its peers, and
// indexes it under its peers so that a selector's change reaches it.
func (e *engine) addRule(ep *endpoint, r *rule) {
	ep.rules = append(ep.rules, r)
	for _, p := range r.peers {
		if p == tables.AnyPeer {
			ep.addIdentity(r, 0, 1, false)
			continue
		}
		if e.peerUsers[p] == nil {
			e.peerUsers[p] = map[*rule]struct{}{}
		}
		e.peerUsers[p][r] = struct{}{}
		podAddrs := tables.MatchesPodAddrs(p)
		for id := range e.selectors[p] {
			ep.addIdentity(r, id, 1, podAddrs)
		}
	}
}

// withEndpointFQDN returns peers with, for every FQDN selector
// "fqdn:<pattern>" among them, the selector of the same pattern for
// endpoint alone, "fqdn:<pattern>@<endpoint>": it selects the addresses a
// resolver the node does not trust gave that endpoint (see
// docs/fqdn.md), which no other endpoint's rule allows. peers is returned
// as it is when it has no FQDN selector.
func withEndpointFQDN(peers []string, endpoint string) []string {
	var out []string
	for _, p := range peers {
		if !strings.HasPrefix(p, tables.SourceFQDN+":") {
			continue
		}
		if out == nil {
			out = append(make([]string, 0, len(peers)+1), peers...)
		}
		out = append(out, tables.EndpointFQDNLabel(p, endpoint))
	}
	if out == nil {
		return peers
	}
	return out
}

func enforceState(on, deny bool) string {
	switch {
	case !on:
		return tables.EnforceOff
	case deny:
		return tables.EnforceDefaultDeny
	}
	return tables.EnforceDefaultAllow
}

// allocateID returns ep's endpoint ID: the one its cgroup had in the map
// before a restart, or the next free one after the last handed out.
func (e *engine) allocateID(ep *endpoint) uint32 {
	if id, ok := e.restored[ep.row.CgroupID]; ok && e.usedIDs[id] == nil {
		e.usedIDs[id] = ep
		return id
	}
	return e.freeID(ep)
}

// freeID hands ep (an endpoint or a policy set's pseudo-endpoint) the next
// ID that nothing uses and no restored endpoint or set may claim.
func (e *engine) freeID(ep *endpoint) uint32 {
	for {
		id := e.nextID
		e.nextID++
		if e.nextID == 0 {
			e.nextID = 1
		}
		if _, ok := e.reserved[id]; ok || e.usedIDs[id] != nil || id == 0 {
			continue
		}
		e.usedIDs[id] = ep
		return id
	}
}

// addIdentity adds (n=1) or removes (n=-1) the contributions of rule r
// for one remote identity, selected by a peer that matches pods' addresses
// too (podAddrs) or not.
func (ep *endpoint) addIdentity(r *rule, id uint32, n int, podAddrs bool) {
	c := contrib{policy: r.policy, deny: r.deny, podAddrs: podAddrs && !r.deny && r.tier == layerRules,
		tier: r.tier, pass: r.pass, priority: r.priority, index: r.index, label: r.label}
	for _, pk := range r.ports {
		ep.add(entryKey{identity: id, dir: r.dir, port: pk}, c, n)
	}
}

func (ep *endpoint) add(k entryKey, c contrib, n int) {
	gk := groupKey{k.identity, k.dir}
	ep.dirtyGroups[gk] = struct{}{}
	cs := ep.contribs[k]
	i := slices.IndexFunc(cs, func(cc contribCount) bool { return cc.contrib == c })
	switch {
	case i >= 0:
		cs[i].n += n
		if cs[i].n > 0 {
			return
		}
		cs = slices.Delete(cs, i, i+1)
	case n < 0:
		return
	default:
		if len(cs) == 0 {
			ep.groups[gk] = append(ep.groups[gk], k.port)
		}
		cs = append(cs, contribCount{c, n})
	}
	if len(cs) > 0 {
		ep.contribs[k] = cs
		return
	}
	delete(ep.contribs, k)
	ports := ep.groups[gk]
	if j := slices.Index(ports, k.port); j >= 0 {
		ports = slices.Delete(ports, j, j+1)
	}
	if len(ports) == 0 {
		delete(ep.groups, gk)
	} else {
		ep.groups[gk] = ports
	}
}

// portEntry is an entry of a group: its port prefix and what it decides.
// A group holds a few (the ports of the rules on one peer), so a sorted
// slice of them costs less than a map, of which a node would keep one
// per group (a hundred thousand for 1,000 peer identities on 100 pods).
type portEntry struct {
	port portKey
	v    entryValue
}

func comparePorts(a, b portKey) int {
	switch {
	case a.proto != b.proto:
		return int(a.proto) - int(b.proto)
	case a.port != b.port:
		return int(a.port) - int(b.port)
	}
	return int(a.bits) - int(b.bits)
}

// recomputeGroup returns the entries of one (identity, direction) group,
// sorted by port.
// The map's longest-prefix match returns one entry, so an entry inside a
// deny of the same group becomes a deny itself: then deny wins whatever
// prefix matches. (A deny of identity 0 is found by the datapath's second
// lookup.) Likewise an allow inside an allow that matches pods' addresses
// matches them too: the datapath's lookup by address finds the longer.
func (ep *endpoint) recomputeGroup(gk groupKey, audited func(policy string) bool, single func(policy string) []string) []portEntry {
	keys := ep.groups[gk]
	if len(keys) == 0 {
		return nil
	}
	if gk.identity != 0 && ep.hasTiered(gk, keys) {
		return ep.recomputeTiered(gk, keys, audited)
	}
	var denies, pods []portKey
	for _, pk := range keys {
		deny, podAddrs := false, false
		for _, c := range ep.contribs[entryKey{gk.identity, gk.dir, pk}] {
			deny, podAddrs = deny || c.deny, podAddrs || c.podAddrs
		}
		if deny {
			denies = append(denies, pk)
		}
		if podAddrs {
			pods = append(pods, pk)
		}
	}
	podsCover := func(pk portKey) bool {
		return slices.ContainsFunc(pods, func(p portKey) bool { return p.covers(pk) })
	}
	out := make([]portEntry, 0, len(keys))
	for _, pk := range keys {
		var v entryValue
		if cs := ep.contribs[entryKey{gk.identity, gk.dir, pk}]; len(denies) == 0 && len(cs) == 1 {
			// The common case: one policy allows it.
			v.policies = single(cs[0].policy)
			v.podAddrs = len(pods) > 0 && podsCover(pk)
			out = append(out, portEntry{pk, v})
			continue
		}
		for _, d := range denies {
			if d.covers(pk) {
				v.deny = true
				for _, c := range ep.contribs[entryKey{gk.identity, gk.dir, d}] {
					if c.deny && !slices.Contains(v.policies, c.policy) {
						v.policies = append(v.policies, c.policy)
					}
				}
			}
		}
		if !v.deny {
			for _, c := range ep.contribs[entryKey{gk.identity, gk.dir, pk}] {
				if !slices.Contains(v.policies, c.policy) {
					v.policies = append(v.policies, c.policy)
				}
			}
			v.podAddrs = podsCover(pk)
		}
		slices.Sort(v.policies)
		if v.deny {
			v.audit = true
			for _, p := range v.policies {
				v.audit = v.audit && audited(p)
			}
		}
		out = append(out, portEntry{pk, v})
	}
	if len(out) > 1 {
		slices.SortFunc(out, func(a, b portEntry) int { return comparePorts(a.port, b.port) })
	}
	return out
}

// output receives the engine's changes, an endpoint's entries before its
// row.
type output interface {
	upsertEntry(*tables.PolicyEntry)
	deleteEntry(*tables.PolicyEntry)
	upsertEndpoint(*tables.EndpointPolicy)
	deleteEndpoint(name string)
}

// flush recomputes what changed and hands the differences to out.
func (e *engine) flush(out output) {
	for name, ep := range e.gone {
		for gk, entries := range ep.emitted {
			for _, pe := range entries {
				out.deleteEntry(ep.entry(name, gk, pe.port, entryValue{}))
			}
		}
		out.deleteEndpoint(name)
	}
	clear(e.gone)
	// By name, so that new endpoints get their IDs in a stable order.
	names := slices.Sorted(maps.Keys(e.endpoints))
	for _, name := range names {
		if ep := e.endpoints[name]; ep != nil {
			if _, ok := e.dirty[ep]; ok {
				e.recompute(ep)
			}
		}
	}
	clear(e.dirty)
	audited := func(p string) bool { return e.audited[p] }
	// Entries of one policy share its one-element list (rows and
	// emitted values are never changed in place).
	singles := map[string][]string{}
	single := func(p string) []string {
		l, ok := singles[p]
		if !ok {
			l = []string{p}
			singles[p] = l
		}
		return l
	}
	// Sets no endpoint uses any more go, their rows and entries with
	// them; an endpoint's row names its set before the set's row goes.
	for key, set := range e.sets {
		if len(set.users) > 0 {
			continue
		}
		delete(e.sets, key)
		e.unindex(set.ep)
		delete(e.usedIDs, set.ep.id)
		for gk, entries := range set.ep.emitted {
			for _, pe := range entries {
				out.deleteEntry(set.ep.entry(set.name, gk, pe.port, entryValue{}))
			}
		}
		out.deleteEndpoint(set.name)
	}
	setNames := make([]string, 0, len(e.sets))
	byName := make(map[string]*policySet, len(e.sets))
	for _, set := range e.sets {
		setNames = append(setNames, set.name)
		byName[set.name] = set
	}
	slices.Sort(setNames)
	for _, name := range setNames {
		set := byName[name]
		e.emitGroups(out, name, set.ep, audited, single)
		row := &tables.EndpointPolicy{Name: name, ID: set.ep.id, Set: true,
			Ingress: tables.EnforceOff, Egress: tables.EnforceOff, Entries: set.ep.emittedCount, Policies: []string{}}
		if set.ep.lastRow == nil || !sameEndpointRow(set.ep.lastRow, row) {
			set.ep.lastRow = row
			out.upsertEndpoint(row)
		}
	}
	for _, name := range names {
		ep := e.endpoints[name]
		e.emitGroups(out, name, ep, audited, single)
		row := &tables.EndpointPolicy{
			Name: name, ID: ep.id, Cgroup: ep.row.Cgroup, CgroupID: ep.row.CgroupID,
			Ingress: ep.ingress, Egress: ep.egress, Audit: e.audit && ep.id != 0,
			AuditDefaultIngress: ep.auditIngress, AuditDefaultEgress: ep.auditEgress,
			Entries: ep.emittedCount, Policies: ep.policies,
			FailClosedIngress: ep.failIngress, FailClosedEgress: ep.failEgress,
			Reason: e.reason(ep), DNS: ep.dns, SharedRules: ep.sharedRules,
		}
		if done := e.ifaceDone[name]; ep.id != 0 && ep.row.CgroupID != 0 && done.cgroupID == ep.row.CgroupID && done.peerIfindex > 0 {
			row.PodIface, row.PodIfindex = true, done.peerIfindex
		}
		if row.Policies == nil {
			row.Policies = []string{}
		}
		if ep.lastRow == nil || !sameEndpointRow(ep.lastRow, row) {
			ep.lastRow = row
			out.upsertEndpoint(row)
		}
	}
}

// emitGroups hands out the entries of ep's groups that changed since the
// last flush.
func (e *engine) emitGroups(out output, name string, ep *endpoint, audited func(string) bool, single func(string) []string) {
	if len(ep.dirtyGroups) > 0 {
		for gk := range ep.dirtyGroups {
			next := ep.recomputeGroup(gk, audited, single)
			old := ep.emitted[gk]
			// Both sorted by port: one pass finds what changed.
			i, j := 0, 0
			for i < len(next) || j < len(old) {
				c := 0
				switch {
				case i == len(next):
					c = 1
				case j == len(old):
					c = -1
				default:
					c = comparePorts(next[i].port, old[j].port)
				}
				switch {
				case c < 0:
					out.upsertEntry(ep.entry(name, gk, next[i].port, next[i].v))
					i++
				case c > 0:
					out.deleteEntry(ep.entry(name, gk, old[j].port, entryValue{}))
					j++
				default:
					if !old[j].v.equal(next[i].v) {
						out.upsertEntry(ep.entry(name, gk, next[i].port, next[i].v))
					}
					i, j = i+1, j+1
				}
			}
			ep.emittedCount += len(next) - len(old)
			if len(next) == 0 {
				delete(ep.emitted, gk)
			} else {
				ep.emitted[gk] = next
			}
		}
		clear(ep.dirtyGroups)
	}
}

// pending says whether ep waits for its identity and is denied meanwhile
// (--unclassified-pods=deny).
func (e *engine) pending(ep *endpoint) bool {
	return e.denyPending && ep.row.Identity == 0 && !ep.row.HostNetwork
}

// reason says why ep is not enforced as its policies say: it is the host,
// it has no cgroup to be enforced on (so no ID, nothing in the maps), it
// waits for its identity, or invalid policies deny it.
func (e *engine) reason(ep *endpoint) string {
	switch {
	case e.mode == ModeNever || ep.row.HostNetwork || e.pending(ep) && ep.row.CgroupID != 0:
		return ep.reason
	case ep.id == 0:
		why := ep.row.CgroupError
		if why == "" {
			why = "no cgroup yet"
		}
		if e.denyPending {
			// The pod tree rows deny such a pod's processes, if any.
			why += "; a process of it under a pod tree is unclassified, denied (--" + UnclassifiedFlag + "=deny)"
		}
		return tables.ReasonNotEnforced + why
	case ep.reason != "":
		return ep.reason
	}
	var parts []string
	for _, p := range ep.failClosed {
		parts = append(parts, tables.ReasonFailClosed+p+": "+e.invalid[p])
	}
	return strings.Join(parts, "; ")
}

func sameEndpointRow(a, b *tables.EndpointPolicy) bool {
	return a.Name == b.Name && a.ID == b.ID && a.Cgroup == b.Cgroup && a.CgroupID == b.CgroupID &&
		a.Ingress == b.Ingress && a.Egress == b.Egress && a.Audit == b.Audit && a.Entries == b.Entries &&
		a.AuditDefaultIngress == b.AuditDefaultIngress && a.AuditDefaultEgress == b.AuditDefaultEgress &&
		slices.Equal(a.Policies, b.Policies) && a.Reason == b.Reason &&
		slices.Equal(a.FailClosedIngress, b.FailClosedIngress) && slices.Equal(a.FailClosedEgress, b.FailClosedEgress) &&
		slices.Equal(a.DNS, b.DNS) && a.Set == b.Set && slices.Equal(a.SharedRules, b.SharedRules) &&
		a.PodIface == b.PodIface && a.PodIfindex == b.PodIfindex
}

// Reasons of endpoint rows not enforced as their policies say.
const (
	reasonHostNetwork = "host-network pod: the host's policy applies, not a pod's"
	reasonNoInterface = "no pod interface"
	reasonPending     = "no identity yet: denied both ways until it resolves (unclassified under its pod tree, or by its entry if it had one; --" + UnclassifiedFlag + "=deny)"
)

// entry returns the table row of an entry of ep.
func (ep *endpoint) entry(name string, gk groupKey, pk portKey, v entryValue) *tables.PolicyEntry {
	pol := v.policies
	if pol == nil {
		pol = []string{}
	}
	cookie := uint32(0)
	switch {
	case gk.identity == tables.PolicySetRef && len(pol) > 0:
		// The set's ID, its name's number.
		if n, err := strconv.ParseUint(strings.TrimPrefix(pol[0], tables.PolicySetPrefix), 10, 32); err == nil {
			cookie = uint32(n)
		}
	case len(pol) > 0:
		cookie = policyCookie(pol[0])
	}
	return &tables.PolicyEntry{
		Endpoint: name, EndpointID: ep.id, Identity: gk.identity, Direction: dirName(gk.dir),
		Protocol: pk.proto, Port: pk.port, PortBits: pk.bits, Deny: v.deny, Audit: v.audit,
		PodAddrs: v.podAddrs, Final: v.final, Pass: v.pass, Drop: v.drop, Policies: pol, Cookie: cookie,
	}
}

// passArrow joins an Admin tier Pass rule's label and what decided after
// it, in entries and verdicts.
const passArrow = " → "
