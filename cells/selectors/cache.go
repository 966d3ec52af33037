package selectors

import (
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/statedb/lpm"

	"github.com/apiary-net/apiary/tables"
)

// selectorCache keeps, for every selector in use, the identities it
// selects, updated incrementally. Both sides are indexed so that a change
// looks only at its candidates, never at every selector or every identity:
//
//   - a new or changed identity is matched against the CIDR selectors
//     whose prefix contains one of its cidr: labels (a map lookup per
//     prefix length in use), the FQDN selectors of its fqdn: labels, the
//     whole-family CIDR selectors and entity world if it has a world
//     label, entity host if it has reserved:host, and, if it is an
//     identity of the cluster, the label selectors anchored on one of its
//     labels (by key and value, or by key for Exists), the label selectors
//     without anchor and entity cluster;
//   - a new selector is matched against the identities with a cidr: label
//     inside its prefix (a subtree of a trie), with its fqdn: label, with a
//     world label (whole-family CIDR selectors, entity world), with
//     reserved:host (entity host), of the cluster (entity cluster, label
//     selectors without In or Exists requirement) or, for a label
//     selector, those of the cluster with the labels of its In or Exists
//     requirement that fewest identities have;
//   - a deleted identity or selector drops out of the selections that hold
//     it, found through the identity's own record of its selectors.
//
// A label selector is anchored, when it is indexed, on the In or Exists
// requirement that costs least then: fewest identities and selectors
// already under its labels. The anchor of 3,000 selectors "app=peer-N in
// namespace default" is each one's app, not the namespace they share, so
// a new identity is matched against the few selectors of its own labels.
//
// Candidates are confirmed with Selector.Matches, which alone decides; the
// indexes only ever skip pairs that cannot match.
type selectorCache struct {
	identities map[uint32]*identityState
	selectors  map[string]*selectorState
	// dirty are the selectors whose users or identities changed since the
	// last takeDirty.
	dirty map[string]struct{}

	// Selectors by what they can match.
	cidrSels     map[netip.Prefix]map[*selectorState]struct{} // by CIDRSelector.Prefix
	cidrSelsLens [2][129]int                                  // distinct keys of cidrSels by family and length
	fqdnSels     map[string]map[*selectorState]struct{}       // by FQDNPeer.Label
	worldSels    map[*selectorState]struct{}                  // 0.0.0.0/0 and ::/0 without except, entity world: they select world identities
	hostSels     map[*selectorState]struct{}                  // entity host: identities with reserved:host only
	clusterSels  map[*selectorState]struct{}                  // entity cluster, label selectors without anchor: identities of the cluster only
	kvSels       map[labelKV]map[*selectorState]struct{}      // label selectors anchored on an In requirement, by each of its values
	keySels      map[string]map[*selectorState]struct{}       // label selectors anchored on an Exists requirement, by its key
	otherSels    map[*selectorState]struct{}                  // any other kind: every identity

	// Identities by what can match them.
	cidrIDs    [2]*lpm.Txn[map[uint32]struct{}] // by each cidr: label's prefix, by family
	fqdnIDs    map[string]map[uint32]struct{}   // by each fqdn: label
	worldIDs   map[uint32]struct{}              // with a world label
	hostIDs    map[uint32]struct{}              // with reserved:host (identity 1)
	clusterIDs map[uint32]struct{}              // of the cluster (see outsideCluster)
	kvIDs      map[labelKV]map[uint32]struct{}  // of the cluster, by each label's key and value
	keyIDs     map[string]map[uint32]struct{}   // of the cluster, by each label's key
}

// labelKV is a label's key and value, whatever its source: label
// requirements with a source are confirmed by Matches.
type labelKV struct{ key, value string }

type selectorState struct {
	key   string
	sel   Selector
	users []string // sorted: a row lists them so, and a subject may have thousands
	ids   map[uint32]struct{}
	// anchor is the requirement a label selector is indexed by (nil: it
	// has no In or Exists requirement, and is in clusterSels).
	anchor *requirement
}

// identityState is an identity with its labels sorted out for the indexes.
type identityState struct {
	labels    tables.Labels
	cidrs     []netip.Prefix // of its cidr: and podnet: labels
	fqdns     []string       // its fqdn: labels
	world     bool           // has reserved:world, world-ipv4 or world-ipv6
	host      bool           // has reserved:host
	inCluster bool           // !outsideCluster(labels)
	kvs       []labelKV      // its labels' keys and values, if inCluster
	// sels are the selectors that select it.
	sels map[*selectorState]struct{}
}

func newSelectorCache() *selectorCache {
	trie := func() *lpm.Txn[map[uint32]struct{}] {
		t := lpm.New[map[uint32]struct{}]()
		return t.Txn()
	}
	return &selectorCache{
		identities:  map[uint32]*identityState{},
		selectors:   map[string]*selectorState{},
		dirty:       map[string]struct{}{},
		cidrSels:    map[netip.Prefix]map[*selectorState]struct{}{},
		fqdnSels:    map[string]map[*selectorState]struct{}{},
		worldSels:   map[*selectorState]struct{}{},
		hostSels:    map[*selectorState]struct{}{},
		clusterSels: map[*selectorState]struct{}{},
		kvSels:      map[labelKV]map[*selectorState]struct{}{},
		keySels:     map[string]map[*selectorState]struct{}{},
		otherSels:   map[*selectorState]struct{}{},
		cidrIDs:     [2]*lpm.Txn[map[uint32]struct{}]{trie(), trie()},
		fqdnIDs:     map[string]map[uint32]struct{}{},
		worldIDs:    map[uint32]struct{}{},
		hostIDs:     map[uint32]struct{}{},
		clusterIDs:  map[uint32]struct{}{},
		kvIDs:       map[labelKV]map[uint32]struct{}{},
		keyIDs:      map[string]map[uint32]struct{}{},
	}
}

func familyOf(a netip.Addr) int {
	if a.Is4() {
		return 0
	}
	return 1
}

// trieKey is the key of prefix p in the cidrIDs trie of its family.
func trieKey(p netip.Prefix) []byte {
	if p.Addr().Is4() {
		a := p.Addr().As4()
		return lpm.EncodeLPMKey(a[:], lpm.PrefixLen(p.Bits()))
	}
	a := p.Addr().As16()
	return lpm.EncodeLPMKey(a[:], lpm.PrefixLen(p.Bits()))
}

// isWorld reports whether label is one of the world labels.
func isWorld(label string) bool {
	return label == tables.LabelWorld || label == tables.LabelWorldIPv4 || label == tables.LabelWorldIPv6
}

func newIdentityState(labels tables.Labels) *identityState {
	e := &identityState{labels: labels, inCluster: !outsideCluster(labels), sels: map[*selectorState]struct{}{}}
	for _, l := range labels {
		switch {
		case isWorld(l):
			e.world = true
		case l == tables.LabelHost:
			e.host = true
		case strings.HasPrefix(l, tables.SourceFQDN+":"):
			e.fqdns = append(e.fqdns, l)
		default:
			if p, ok := tables.ParseCIDRLabel(l); ok {
				e.cidrs = append(e.cidrs, p)
			}
			// A pod's podnet: label (ClusterNetworkPolicy networks)
			// is a candidate of the CIDR selectors around it, which
			// Matches sorts out (only networks ones select it).
			if p, ok := tables.ParsePodNetLabel(l); ok {
				e.cidrs = append(e.cidrs, p)
			}
		}
		if e.inCluster {
			_, key, value, _ := tables.SplitLabel(l)
			if kv := (labelKV{key, value}); !slices.Contains(e.kvs, kv) {
				e.kvs = append(e.kvs, kv)
			}
		}
	}
	return e
}

func addTo[K comparable, V comparable](m map[K]map[V]struct{}, k K, v V) {
	set, ok := m[k]
	if !ok {
		set = map[V]struct{}{}
		m[k] = set
	}
	set[v] = struct{}{}
}

func removeFrom[K comparable, V comparable](m map[K]map[V]struct{}, k K, v V) {
	if set, ok := m[k]; ok {
		delete(set, v)
		if len(set) == 0 {
			delete(m, k)
		}
	}
}

func (c *selectorCache) indexIdentity(id uint32, e *identityState) {
	for _, p := range e.cidrs {
		t := c.cidrIDs[familyOf(p.Addr())]
		key := trieKey(p)
		set, ok := t.LookupExact(key)
		if !ok {
			set = map[uint32]struct{}{}
			t.Insert(key, set)
		}
		set[id] = struct{}{}
	}
	for _, l := range e.fqdns {
		addTo(c.fqdnIDs, l, id)
	}
	if e.world {
		c.worldIDs[id] = struct{}{}
	}
	if e.host {
		c.hostIDs[id] = struct{}{}
	}
	if e.inCluster {
		c.clusterIDs[id] = struct{}{}
	}
	for i, kv := range e.kvs {
		addTo(c.kvIDs, kv, id)
		if firstKey(e.kvs, i) {
			addTo(c.keyIDs, kv.key, id)
		}
	}
}

// firstKey reports whether kvs[i] is the first of kvs with its key, so
// that a key is indexed and looked up once per identity.
func firstKey(kvs []labelKV, i int) bool {
	for _, kv := range kvs[:i] {
		if kv.key == kvs[i].key {
			return false
		}
	}
	return true
}

func (c *selectorCache) unindexIdentity(id uint32, e *identityState) {
	for _, p := range e.cidrs {
		t := c.cidrIDs[familyOf(p.Addr())]
		key := trieKey(p)
		if set, ok := t.LookupExact(key); ok {
			delete(set, id)
			if len(set) == 0 {
				t.Delete(key)
			}
		}
	}
	for _, l := range e.fqdns {
		removeFrom(c.fqdnIDs, l, id)
	}
	delete(c.worldIDs, id)
	delete(c.hostIDs, id)
	delete(c.clusterIDs, id)
	for _, kv := range e.kvs {
		removeFrom(c.kvIDs, kv, id)
		removeFrom(c.keyIDs, kv.key, id)
	}
}

// candidateSelectors calls yield with every selector that may select an
// identity like e (some more than once).
func (c *selectorCache) candidateSelectors(e *identityState, yield func(*selectorState)) {
	for _, q := range e.cidrs {
		// The CIDR selectors whose prefix contains q: one lookup per
		// length in use up to q's.
		fam := familyOf(q.Addr())
		for bits := 0; bits <= q.Bits(); bits++ {
			if c.cidrSelsLens[fam][bits] == 0 {
				continue
			}
			for s := range c.cidrSels[netip.PrefixFrom(q.Addr(), bits).Masked()] {
				yield(s)
			}
		}
	}
	for _, l := range e.fqdns {
		for s := range c.fqdnSels[l] {
			yield(s)
		}
	}
	if e.world {
		for s := range c.worldSels {
			yield(s)
		}
	}
	if e.host {
		for s := range c.hostSels {
			yield(s)
		}
	}
	if e.inCluster {
		for s := range c.clusterSels {
			yield(s)
		}
		for i, kv := range e.kvs {
			for s := range c.kvSels[kv] {
				yield(s)
			}
			if firstKey(e.kvs, i) {
				for s := range c.keySels[kv.key] {
					yield(s)
				}
			}
		}
	}
	for s := range c.otherSels {
		yield(s)
	}
}

// candidateIdentities calls yield with every identity that s may select
// (some more than once).
func (c *selectorCache) candidateIdentities(s *selectorState, yield func(uint32)) {
	switch sel := s.sel.(type) {
	case *CIDRSelector:
		p := sel.Prefix
		fam := familyOf(p.Addr())
		// The identities with a cidr: label inside p. lpm's Prefix may
		// hand back a subtree that diverges from p when p itself is not in
		// the trie (statedb v0.8.3): then every entry is outside, and the
		// first one says so.
		for key, ids := range c.cidrIDs[fam].Prefix(trieKey(p)).All {
			data, bits := lpm.DecodeLPMKey(key)
			if !trieKeyInside(p, data, bits) {
				break
			}
			for id := range ids {
				yield(id)
			}
		}
		if p.Bits() == 0 && len(sel.Except) == 0 {
			for id := range c.worldIDs {
				yield(id)
			}
		}
	case *FQDNPeer:
		for id := range c.fqdnIDs[sel.Label] {
			yield(id)
		}
	case *LabelSelector:
		r := c.cheapest(sel, func(kv labelKV) int { return len(c.kvIDs[kv]) }, func(key string) int { return len(c.keyIDs[key]) })
		if r == nil {
			for id := range c.clusterIDs {
				yield(id)
			}
			return
		}
		if r.op == opExists {
			for id := range c.keyIDs[r.key] {
				yield(id)
			}
			return
		}
		for _, v := range r.values {
			for id := range c.kvIDs[labelKV{r.key, v}] {
				yield(id)
			}
		}
	case *EntitySelector:
		for id := range c.entityIDs(sel) {
			yield(id)
		}
	default:
		for id := range c.identities {
			yield(id)
		}
	}
}

// cheapest returns the In or Exists requirement of sel whose labels have
// the lowest cost: the sum of byKV over an In requirement's values, or
// byKey of an Exists requirement's key. Ties go to In, then to the
// requirement first in sel's text, so that the choice does not depend on
// the order of a policy's matchLabels. Nil if sel has neither.
func (c *selectorCache) cheapest(sel *LabelSelector, byKV func(labelKV) int, byKey func(string) int) *requirement {
	var best *requirement
	bestCost := 0
	for i := range sel.reqs {
		r := &sel.reqs[i]
		cost := 0
		switch r.op {
		case opIn:
			for _, v := range r.values {
				cost += byKV(labelKV{r.key, v})
			}
		case opExists:
			cost = byKey(r.key)
		default:
			continue
		}
		if best == nil || cost < bestCost ||
			cost == bestCost && (best.op == opExists && r.op == opIn ||
				best.op == r.op && r.String() < best.String()) {
			best, bestCost = r, cost
		}
	}
	return best
}

// entitySels is the index of the selectors like sel; nil for an entity
// without one (matched against every identity, like an unknown kind).
func (c *selectorCache) entitySels(sel *EntitySelector) map[*selectorState]struct{} {
	switch sel.Entity {
	case EntityWorld, EntityWorldIPv4, EntityWorldIPv6:
		return c.worldSels
	case EntityHost:
		return c.hostSels
	case EntityCluster:
		return c.clusterSels
	}
	return nil
}

// entityIDs is the index of the identities sel may select: exactly those
// it selects for world, host and cluster, as Matches tests the same flags
// the index was built from; the world of each family is a subset of the
// world's.
func (c *selectorCache) entityIDs(sel *EntitySelector) map[uint32]struct{} {
	switch sel.Entity {
	case EntityWorld, EntityWorldIPv4, EntityWorldIPv6:
		// A superset for the family entities: Matches narrows it.
		return c.worldIDs
	case EntityHost:
		return c.hostIDs
	case EntityCluster:
		return c.clusterIDs
	}
	// Not reached (ParseEntity knows no other), but safe: every identity.
	all := make(map[uint32]struct{}, len(c.identities))
	for id := range c.identities {
		all[id] = struct{}{}
	}
	return all
}

// trieKeyInside reports whether the trie key (data, bits) of p's family
// lies inside p.
func trieKeyInside(p netip.Prefix, data []byte, bits uint16) bool {
	if int(bits) < p.Bits() {
		return false
	}
	var addr netip.Addr
	if p.Addr().Is4() {
		var a [4]byte
		copy(a[:], data)
		addr = netip.AddrFrom4(a)
	} else {
		var a [16]byte
		copy(a[:], data)
		addr = netip.AddrFrom16(a)
	}
	return p.Contains(addr)
}

func (c *selectorCache) indexSelector(s *selectorState) {
	switch sel := s.sel.(type) {
	case *CIDRSelector:
		if _, ok := c.cidrSels[sel.Prefix]; !ok {
			c.cidrSelsLens[familyOf(sel.Prefix.Addr())][sel.Prefix.Bits()]++
		}
		addTo(c.cidrSels, sel.Prefix, s)
		if sel.Prefix.Bits() == 0 && len(sel.Except) == 0 {
			c.worldSels[s] = struct{}{}
		}
	case *FQDNPeer:
		addTo(c.fqdnSels, sel.Label, s)
	case *LabelSelector:
		// A new identity costs the selectors under its labels, a new
		// selector the identities under its anchor's: both count.
		s.anchor = c.cheapest(sel,
			func(kv labelKV) int { return len(c.kvIDs[kv]) + len(c.kvSels[kv]) },
			func(key string) int { return len(c.keyIDs[key]) + len(c.keySels[key]) })
		switch {
		case s.anchor == nil:
			c.clusterSels[s] = struct{}{}
		case s.anchor.op == opExists:
			addTo(c.keySels, s.anchor.key, s)
		default:
			for _, v := range s.anchor.values {
				addTo(c.kvSels, labelKV{s.anchor.key, v}, s)
			}
		}
	case *EntitySelector:
		if set := c.entitySels(sel); set != nil {
			set[s] = struct{}{}
		} else {
			c.otherSels[s] = struct{}{}
		}
	default:
		c.otherSels[s] = struct{}{}
	}
}

func (c *selectorCache) unindexSelector(s *selectorState) {
	switch sel := s.sel.(type) {
	case *CIDRSelector:
		removeFrom(c.cidrSels, sel.Prefix, s)
		if _, ok := c.cidrSels[sel.Prefix]; !ok {
			c.cidrSelsLens[familyOf(sel.Prefix.Addr())][sel.Prefix.Bits()]--
		}
		delete(c.worldSels, s)
	case *FQDNPeer:
		removeFrom(c.fqdnSels, sel.Label, s)
	case *LabelSelector:
		switch {
		case s.anchor == nil:
			delete(c.clusterSels, s)
		case s.anchor.op == opExists:
			removeFrom(c.keySels, s.anchor.key, s)
		default:
			for _, v := range s.anchor.values {
				removeFrom(c.kvSels, labelKV{s.anchor.key, v}, s)
			}
		}
	case *EntitySelector:
		if set := c.entitySels(sel); set != nil {
			delete(set, s)
		} else {
			delete(c.otherSels, s)
		}
	default:
		delete(c.otherSels, s)
	}
}

// upsertIdentity adds an identity or changes its labels.
func (c *selectorCache) upsertIdentity(id uint32, labels tables.Labels) {
	old, ok := c.identities[id]
	if ok && old.labels.Equal(labels) {
		return
	}
	e := newIdentityState(labels)
	if ok {
		c.unindexIdentity(id, old)
		// The selectors that selected it with its old labels.
		for s := range old.sels {
			if s.sel.Matches(labels) {
				e.sels[s] = struct{}{}
				continue
			}
			delete(s.ids, id)
			c.dirty[s.key] = struct{}{}
		}
	}
	c.identities[id] = e
	c.indexIdentity(id, e)
	c.candidateSelectors(e, func(s *selectorState) {
		if _, had := e.sels[s]; had {
			return
		}
		if ok && old.sels != nil {
			if _, was := old.sels[s]; was {
				return // already found not to match
			}
		}
		if s.sel.Matches(labels) {
			e.sels[s] = struct{}{}
			s.ids[id] = struct{}{}
			c.dirty[s.key] = struct{}{}
		}
	})
}

// deleteIdentity removes an identity from every selection.
func (c *selectorCache) deleteIdentity(id uint32) {
	e, ok := c.identities[id]
	if !ok {
		return
	}
	for s := range e.sels {
		delete(s.ids, id)
		c.dirty[s.key] = struct{}{}
	}
	c.unindexIdentity(id, e)
	delete(c.identities, id)
}

// addUser records that policy uses sel, matching a new selector against
// its candidate identities.
func (c *selectorCache) addUser(sel Selector, policy string) {
	key := sel.String()
	s, ok := c.selectors[key]
	if !ok {
		s = &selectorState{key: key, sel: sel, ids: map[uint32]struct{}{}}
		c.candidateIdentities(s, func(id uint32) {
			e := c.identities[id]
			if _, had := s.ids[id]; !had && sel.Matches(e.labels) {
				s.ids[id] = struct{}{}
				e.sels[s] = struct{}{}
			}
		})
		c.selectors[key] = s
		c.indexSelector(s)
	}
	if i, found := slices.BinarySearch(s.users, policy); !found {
		s.users = slices.Insert(s.users, i, policy)
	}
	c.dirty[key] = struct{}{}
}

// removeUser drops policy from the users of the selector key; a selector
// nobody uses goes.
func (c *selectorCache) removeUser(key, policy string) {
	s, ok := c.selectors[key]
	if !ok {
		return
	}
	if i, found := slices.BinarySearch(s.users, policy); found {
		s.users = slices.Delete(s.users, i, i+1)
	}
	if len(s.users) == 0 {
		for id := range s.ids {
			delete(c.identities[id].sels, s)
		}
		c.unindexSelector(s)
		delete(c.selectors, key)
	}
	c.dirty[key] = struct{}{}
}

// takeDirty returns the rows of the selectors changed since the last call;
// a nil row means the selector is gone.
func (c *selectorCache) takeDirty() map[string]*tables.Selector {
	out := make(map[string]*tables.Selector, len(c.dirty))
	for key := range c.dirty {
		s, ok := c.selectors[key]
		if !ok {
			out[key] = nil
			continue
		}
		// Non-nil, so that JSON has [] rather than null.
		ids := make([]uint32, 0, len(s.ids))
		for id := range s.ids {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		out[key] = &tables.Selector{Selector: key, Identities: ids, Policies: append([]string{}, s.users...)}
	}
	clear(c.dirty)
	return out
}
