package selectors

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"

	"github.com/apiary-net/apiary/tables"
)

// bruteCache is the selector cache without indexes: every identity
// matched against every selector. The indexed cache must select exactly
// what it selects.
type bruteCache struct {
	identities map[uint32]tables.Labels
	selectors  map[string]Selector
	users      map[string]map[string]struct{}
}

func (b *bruteCache) rows() map[string]*tables.Selector {
	out := map[string]*tables.Selector{}
	for key, sel := range b.selectors {
		row := &tables.Selector{Selector: key, Identities: []uint32{}, Policies: slices.Sorted(maps.Keys(b.users[key]))}
		for id, l := range b.identities {
			if sel.Matches(l) {
				row.Identities = append(row.Identities, id)
			}
		}
		slices.Sort(row.Identities)
		out[key] = row
	}
	return out
}

// cacheRows are the rows of every selector of c, as takeDirty makes them.
func cacheRows(c *selectorCache) map[string]*tables.Selector {
	for key := range c.selectors {
		c.dirty[key] = struct{}{}
	}
	out := c.takeDirty()
	maps.DeleteFunc(out, func(_ string, row *tables.Selector) bool { return row == nil })
	return out
}

// TestSelectorCacheMatchesBruteForce applies random changes of identities
// and selectors, of every kind, to the indexed cache and checks after each
// that it selects what matching every pair selects, and that takeDirty
// names every selector whose row changed. Label selectors get up to three
// requirements of every operator on keys with and without a source, and
// workloads the same key from several sources, so that every way of
// anchoring a label selector (and none) meets identities that have, lack
// or repeat its labels, in both orders of arrival.
func TestSelectorCacheMatchesBruteForce(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	pick := func(list []string) string { return list[rng.IntN(len(list))] }
	// A small space of prefixes, so that they nest and collide.
	v4 := func() netip.Prefix {
		bits := []int{0, 8, 16, 20, 24, 25, 26, 32}[rng.IntN(8)]
		a := netip.AddrFrom4([4]byte{10, byte(rng.IntN(2)), byte(rng.IntN(4) * 64), byte(rng.IntN(4) * 64)})
		return netip.PrefixFrom(a, bits).Masked()
	}
	v6 := func() netip.Prefix {
		bits := []int{0, 16, 32, 64, 128}[rng.IntN(5)]
		a := netip.AddrFrom16([16]byte{0xfd, 0, 0, byte(rng.IntN(2)), 15: byte(rng.IntN(2))})
		return netip.PrefixFrom(a, bits).Masked()
	}
	prefix := func() netip.Prefix {
		if rng.IntN(4) == 0 {
			return v6()
		}
		return v4()
	}
	fqdns := []string{"fqdn:*.example.com", "fqdn:a.example.com", "fqdn:**.example.org"}
	worlds := []string{tables.LabelWorld, tables.LabelWorldIPv4, tables.LabelWorldIPv6}
	// Workload labels: keys in several sources (one identity may have the
	// same key twice, with other values), values with and without '='.
	k8s := []string{
		"k8s:app=web", "k8s:app=db", "k8s:app=cache", "k8s:tier=front", "k8s:tier=",
		"k8s:io.kubernetes.pod.namespace=default", "k8s:io.kubernetes.pod.namespace=prod",
		"container:app=db", "container:tier=back", "unsourced=1", "k8s:unsourced=2",
	}
	randomLabels := func() tables.Labels {
		var l []string
		switch rng.IntN(6) {
		case 0: // a workload
			for range 1 + rng.IntN(4) {
				l = append(l, pick(k8s))
			}
		case 1: // reserved, as the identities have them
			l = append(l, reservedLabels[uint32(1+rng.IntN(len(reservedLabels)))]...)
		case 2: // a workload inside a CIDR (not normalised: labels as they come)
			l = append(l, pick(k8s), tables.CIDRLabel(prefix()))
			if rng.IntN(2) == 0 {
				// A pod inside a ClusterNetworkPolicy's networks.
				l = append(l, tables.PodNetLabel(prefix()))
			}
		case 3: // a mapped IPv4 CIDR label, as no resolver writes it
			l = append(l, "cidr:::ffff:10.0.0.0/104", pick(worlds))
		default: // CIDR and FQDN identities, sometimes several cidr: labels
			for range rng.IntN(3) {
				l = append(l, tables.CIDRLabel(prefix()))
			}
			if rng.IntN(2) == 0 {
				l = append(l, pick(fqdns))
			}
			if rng.IntN(4) != 0 {
				l = append(l, pick(worlds))
			}
		}
		return tables.NewLabels(l...)
	}
	randomSelector := func() Selector {
		switch rng.IntN(5) {
		case 0:
			p := prefix()
			var except []string
			if rng.IntN(3) == 0 && p.Bits() < p.Addr().BitLen() {
				e := netip.PrefixFrom(p.Addr(), p.Bits()+1+rng.IntN(p.Addr().BitLen()-p.Bits())).Masked()
				except = append(except, e.String())
			}
			s, err := ParseCIDR(p.String(), except)
			if err != nil {
				t.Fatal(err)
			}
			if len(except) == 0 && rng.IntN(2) == 0 {
				s.networks()
			}
			return s
		case 4:
			s, _, err := ParseEntity(pick([]string{EntityWorld, EntityWorldIPv4, EntityWorldIPv6, EntityHost, EntityCluster}))
			if err != nil {
				t.Fatal(err)
			}
			return s
		case 1:
			s, err := ParseFQDN(FQDNSelector{MatchPattern: pick([]string{"*.example.com", "a.example.com", "**.example.org"})})
			if err != nil {
				t.Fatal(err)
			}
			return s
		default:
			// Up to three requirements of every operator, on keys with
			// and without a source, so that label selectors are anchored
			// on each kind of requirement or on none.
			es := EndpointSelector{MatchLabels: map[string]string{}}
			key := func() string {
				return pick([]string{"app", "k8s:app", "container:app", "any:tier", "tier", "unsourced", "k8s:unsourced", "reserved:host"})
			}
			values := func() []string {
				var vs []string
				for range 1 + rng.IntN(3) {
					vs = append(vs, pick([]string{"web", "db", "cache", "", "1", "2"}))
				}
				return vs
			}
			for range rng.IntN(4) {
				switch rng.IntN(5) {
				case 0:
					es.MatchLabels[key()] = pick([]string{"web", "db", "", "1"})
				case 1:
					es.MatchExpressions = append(es.MatchExpressions, LabelSelectorRequirement{Key: key(), Operator: opIn, Values: values()})
				case 2:
					es.MatchExpressions = append(es.MatchExpressions, LabelSelectorRequirement{Key: key(), Operator: opExists})
				case 3:
					es.MatchExpressions = append(es.MatchExpressions, LabelSelectorRequirement{Key: key(), Operator: opDoesNotExist})
				default:
					es.MatchExpressions = append(es.MatchExpressions, LabelSelectorRequirement{Key: key(), Operator: opNotIn, Values: values()})
				}
			}
			s, err := ParseEndpointSelector(es, pick([]string{"", "default"}))
			if err != nil {
				t.Fatal(err)
			}
			return s
		}
	}

	c := newSelectorCache()
	b := &bruteCache{identities: map[uint32]tables.Labels{}, selectors: map[string]Selector{}, users: map[string]map[string]struct{}{}}
	prev := map[string]*tables.Selector{}
	policies := []string{"p1", "p2", "p3"}
	for step := range 3000 {
		var what string
		switch op := rng.IntN(10); {
		case op < 4:
			id, l := uint32(1+rng.IntN(60)), randomLabels()
			what = fmt.Sprintf("upsert identity %d %s", id, l)
			c.upsertIdentity(id, l)
			b.identities[id] = l
		case op < 5:
			id := uint32(1 + rng.IntN(60))
			what = fmt.Sprintf("delete identity %d", id)
			c.deleteIdentity(id)
			delete(b.identities, id)
		case op < 8:
			s, p := randomSelector(), pick(policies)
			what = fmt.Sprintf("add %s to %s", p, s)
			c.addUser(s, p)
			if _, ok := b.selectors[s.String()]; !ok {
				b.selectors[s.String()] = s
				b.users[s.String()] = map[string]struct{}{}
			}
			b.users[s.String()][p] = struct{}{}
		default:
			keys := slices.Sorted(maps.Keys(b.selectors))
			if len(keys) == 0 {
				continue
			}
			key, p := pick(keys), pick(policies)
			what = fmt.Sprintf("remove %s from %s", p, key)
			c.removeUser(key, p)
			delete(b.users[key], p)
			if len(b.users[key]) == 0 {
				delete(b.selectors, key)
				delete(b.users, key)
			}
		}
		dirty := c.takeDirty()
		want := b.rows()
		got := cacheRows(c)
		for key, w := range want {
			g := got[key]
			if g == nil || !slices.Equal(g.Identities, w.Identities) || !slices.Equal(g.Policies, w.Policies) {
				t.Fatalf("step %d (%s): selector %s has %+v, want %+v", step, what, key, g, w)
			}
			if p := prev[key]; p == nil || !slices.Equal(p.Identities, w.Identities) || !slices.Equal(p.Policies, w.Policies) {
				if _, ok := dirty[key]; !ok {
					t.Fatalf("step %d (%s): selector %s changed but is not dirty", step, what, key)
				}
			}
		}
		for key := range got {
			if _, ok := want[key]; !ok {
				t.Fatalf("step %d (%s): selector %s should be gone", step, what, key)
			}
		}
		for key := range prev {
			if _, ok := want[key]; !ok {
				if row, ok := dirty[key]; !ok || row != nil {
					t.Fatalf("step %d (%s): selector %s is gone but not reported", step, what, key)
				}
			}
		}
		for key, row := range dirty {
			if _, was := prev[key]; row == nil && !was {
				t.Fatalf("step %d (%s): selector %s reported gone but was not there", step, what, key)
			}
		}
		prev = want
	}
}

// TestCandidateIdentitiesOutsidePrefix: lpm's Prefix (statedb v0.8.3)
// hands back the subtree of a prefix that diverges from the one asked for
// when that one is not in the trie; the cache must not take those
// identities as candidates (Matches would reject them, at a cost).
func TestCandidateIdentitiesOutsidePrefix(t *testing.T) {
	c := newSelectorCache()
	c.upsertIdentity(1, tables.NewLabels("cidr:11.0.0.0/24", tables.LabelWorld))
	c.upsertIdentity(2, tables.NewLabels("cidr:10.1.0.0/16", tables.LabelWorld))
	for _, tc := range []struct {
		cidr string
		want []uint32
	}{
		{"10.0.0.0/8", []uint32{2}},
		{"10.1.2.0/24", nil},
		{"11.0.0.0/8", []uint32{1}},
		{"12.0.0.0/8", nil},
		{"0.0.0.0/0", []uint32{1, 2}},
	} {
		sel, err := ParseCIDR(tc.cidr, nil)
		if err != nil {
			t.Fatal(err)
		}
		var got []uint32
		c.candidateIdentities(&selectorState{sel: sel}, func(id uint32) { got = append(got, id) })
		slices.Sort(got)
		if !slices.Equal(slices.Compact(got), tc.want) {
			t.Errorf("candidates of %s: %v, want %v", tc.cidr, got, tc.want)
		}
	}
}

// TestEntitySelectorsInCache: entity selectors select in the cache what
// Matches says, whichever comes first (the selector or the identities),
// follow relabels and deletions, and are indexed: a new entity selector
// looks only at the identities it selects, and a new identity only at the
// entity selectors that select it.
func TestEntitySelectorsInCache(t *testing.T) {
	ids := entityTestIdentities()
	entities := []string{EntityWorld, EntityHost, EntityCluster}
	parse := func(entity string) *EntitySelector {
		s, _, err := ParseEntity(entity)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	check := func(t *testing.T, c *selectorCache, want map[string][]uint32) {
		t.Helper()
		rows := cacheRows(c)
		for _, e := range entities {
			key := parse(e).String()
			row := rows[key]
			if row == nil {
				t.Fatalf("no row for %s", key)
			}
			if !slices.Equal(row.Identities, want[e]) {
				t.Errorf("%s selects %v, want %v", key, row.Identities, want[e])
			}
		}
	}
	for _, tc := range []struct {
		name           string
		selectorsFirst bool
	}{
		{"identities first", false},
		{"selectors first", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newSelectorCache()
			addSelectors := func() {
				for _, e := range entities {
					c.addUser(parse(e), "cnp/default/p")
				}
			}
			if tc.selectorsFirst {
				addSelectors()
			}
			for _, id := range slices.Sorted(maps.Keys(ids)) {
				c.upsertIdentity(id, ids[id])
			}
			if !tc.selectorsFirst {
				addSelectors()
			}
			check(t, c, entitySelections)

			// A CIDR identity becomes a pod's (its address went to a pod),
			// and the host goes: both move between entities.
			c.takeDirty()
			c.upsertIdentity(16777217, tables.NewLabels("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"))
			c.deleteIdentity(1)
			dirty := c.takeDirty()
			for _, key := range []string{"entity:world", "entity:host", "entity:cluster"} {
				if _, ok := dirty[key]; !ok {
					t.Errorf("%s changed but is not dirty", key)
				}
			}
			check(t, c, map[string][]uint32{
				EntityWorld:   {2, 9, 10, 16777218, 16777219, 16777220, 16777221},
				EntityHost:    nil,
				EntityCluster: {3, 4, 5, 6, 7, 8, 256, 257, 16777217},
			})
			// And back.
			c.upsertIdentity(16777217, ids[16777217])
			c.upsertIdentity(1, ids[1])
			check(t, c, entitySelections)
		})
	}

	// The indexes: candidates are exactly the selection.
	c := newSelectorCache()
	for id, l := range ids {
		c.upsertIdentity(id, l)
	}
	states := map[string]*selectorState{}
	for _, e := range entities {
		sel := parse(e)
		c.addUser(sel, "p")
		states[e] = c.selectors[sel.String()]
		var got []uint32
		c.candidateIdentities(states[e], func(id uint32) { got = append(got, id) })
		slices.Sort(got)
		if !slices.Equal(got, entitySelections[e]) {
			t.Errorf("candidate identities of %s: %v, want %v", sel, got, entitySelections[e])
		}
	}
	for id, l := range ids {
		var got []string
		c.candidateSelectors(newIdentityState(l), func(s *selectorState) { got = append(got, s.key) })
		slices.Sort(got)
		var want []string
		for _, e := range entities {
			if slices.Contains(entitySelections[e], id) {
				want = append(want, parse(e).String())
			}
		}
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("candidate selectors of identity %d (%s): %v, want %v", id, l, got, want)
		}
	}
	// Gone with their last user, from the indexes too.
	for _, e := range entities {
		c.removeUser(parse(e).String(), "p")
	}
	if len(c.worldSels)+len(c.hostSels)+len(c.clusterSels)+len(c.otherSels) != 0 {
		t.Errorf("selectors left in the indexes: world %d, host %d, cluster %d, other %d",
			len(c.worldSels), len(c.hostSels), len(c.clusterSels), len(c.otherSels))
	}
}
