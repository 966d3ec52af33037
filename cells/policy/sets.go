package policy

import (
	"slices"
	"strconv"
	"strings"

	"github.com/apiary-net/apiary/tables"
)

// Policy sets: the allows of wide peers that endpoints share
// (docs/policy.md, Shared policy sets).

// policySet is a set of allows that endpoints share: those of the rules
// whose peer selects many identities (engine.shareMin), which the
// endpoints of a direction with the same such rules (peer and ports,
// whichever policy) would each have had an entry of, for every identity.
// A pseudo-endpoint with an ID of its own holds its entries; each of its
// endpoints has one reference entry to it (docs/policy.md, Shared policy
// sets).
type policySet struct {
	key   string
	name  string
	ep    *endpoint
	users map[*endpoint]struct{}
}

// sharedPeer is an allow rule's peer and ports kept in a policy set.
type sharedPeer struct {
	peer  string
	ports []portKey
}

// share moves the peers of an allow rule that are shareable into shared
// (with what ep's verdicts name them by) and returns the others.
func (e *engine) share(ep *endpoint, policy string, dir uint8, peers []string, ports []portKey, shared *[]sharedPeer) []string {
	var own []string
	for _, p := range peers {
		if !e.shareable(p) {
			own = append(own, p)
			continue
		}
		*shared = append(*shared, sharedPeer{p, ports})
		for _, pk := range ports {
			ep.sharedRules = append(ep.sharedRules, tables.SharedRule{Policy: policy, Direction: dirName(dir),
				Peer: p, Protocol: pk.proto, Port: pk.port, PortBits: pk.bits})
		}
	}
	return own
}

// shareable says whether a peer selector's allows go into policy sets:
// one that selects at least shareMin identities, unless it is any peer
// (identity 0), matches pods' addresses (ipBlock, by_address reads the
// endpoint's own entries) or names DNS answers (the FQDN selectors, one
// of which is the endpoint's own).
func (e *engine) shareable(peer string) bool {
	return peer != tables.AnyPeer && !tables.MatchesPodAddrs(peer) &&
		!strings.HasPrefix(peer, tables.SourceFQDN+":") && len(e.selectors[peer]) >= e.shareMin
}

// acquireSet returns the policy set of the shared peers of a direction,
// made if no endpoint has it yet, with ep among its users.
func (e *engine) acquireSet(dir uint8, peers []sharedPeer, ep *endpoint) *policySet {
	slices.SortFunc(peers, func(a, b sharedPeer) int {
		if c := strings.Compare(a.peer, b.peer); c != 0 {
			return c
		}
		return slices.CompareFunc(a.ports, b.ports, comparePorts)
	})
	peers = slices.CompactFunc(peers, func(a, b sharedPeer) bool {
		return a.peer == b.peer && slices.Equal(a.ports, b.ports)
	})
	var b strings.Builder
	b.WriteString(dirName(dir))
	for _, p := range peers {
		b.WriteString("|")
		b.WriteString(p.peer)
		for _, pk := range p.ports {
			b.WriteString(" " + strconv.Itoa(int(pk.proto)) + "/" + strconv.Itoa(int(pk.port)) + "/" + strconv.Itoa(int(pk.bits)))
		}
	}
	key := b.String()
	if s := e.sets[key]; s != nil {
		s.users[ep] = struct{}{}
		return s
	}
	s := &policySet{key: key, users: map[*endpoint]struct{}{ep: {}}}
	s.ep = &endpoint{emitted: map[groupKey][]portEntry{}, set: s,
		contribs: map[entryKey][]contribCount{}, groups: map[groupKey][]portKey{}, dirtyGroups: map[groupKey]struct{}{}}
	s.ep.id = e.freeID(s.ep)
	s.name = tables.PolicySetName(s.ep.id)
	e.sets[key] = s
	for _, p := range peers {
		r := &rule{ep: s.ep, policy: s.name, dir: dir, peers: []string{p.peer}, ports: p.ports}
		s.ep.rules = append(s.ep.rules, r)
		if e.peerUsers[p.peer] == nil {
			e.peerUsers[p.peer] = map[*rule]struct{}{}
		}
		e.peerUsers[p.peer][r] = struct{}{}
		for id := range e.selectors[p.peer] {
			s.ep.addIdentity(r, id, 1, false)
		}
	}
	return s
}

// releaseSets takes ep out of the users of the sets in old it no longer
// has; a set without users goes at the next flush.
func (e *engine) releaseSets(ep *endpoint, old [2]*policySet) {
	for _, s := range old {
		if s != nil && s != ep.sets[0] && s != ep.sets[1] {
			delete(s.users, ep)
		}
	}
}
