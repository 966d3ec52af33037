package selectors

import (
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
)

// TestPrefixChangeOrder: applied one by one in the order flushPrefixes
// writes them (so in any chunks), the prefixes a change adds and removes
// give every address inside them its final longest policy prefix with the
// first step that changes it: an address of another owner changes
// identity at most once, as with the whole change in one transaction.
func TestPrefixChangeOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	// Prefixes of 10.0.0.0/16, nested every which way.
	random := func() netip.Prefix {
		bits := 16 + rng.IntN(17)
		a := netip.AddrFrom4([4]byte{10, 0, byte(rng.IntN(4)), byte(rng.IntN(256))})
		return netip.PrefixFrom(a, bits).Masked()
	}
	longest := func(set map[netip.Prefix]bool, a netip.Addr) netip.Prefix {
		var best netip.Prefix
		for p, in := range set {
			if in && p.Contains(a) && (!best.IsValid() || p.Bits() > best.Bits()) {
				best = p
			}
		}
		return best
	}
	for round := range 200 {
		before, after := map[netip.Prefix]bool{}, map[netip.Prefix]bool{}
		for range rng.IntN(30) {
			before[random()] = true
		}
		for range rng.IntN(30) {
			after[random()] = true
		}
		for p := range before {
			if rng.IntN(2) == 0 {
				after[p] = true // kept
			}
		}
		var upserts, deletes []netip.Prefix
		for p := range after {
			if !before[p] {
				upserts = append(upserts, p)
			}
		}
		for p := range before {
			if !after[p] {
				deletes = append(deletes, p)
			}
		}
		sortPrefixChanges(upserts, deletes)
		steps := append(slices.Clone(upserts), deletes...)
		for range 50 {
			addr := netip.AddrFrom4([4]byte{10, 0, byte(rng.IntN(4)), byte(rng.IntN(256))})
			cur := maps.Clone(before)
			seen := []netip.Prefix{longest(cur, addr)}
			for i, p := range steps {
				cur[p] = i < len(upserts)
				if l := longest(cur, addr); l != seen[len(seen)-1] {
					seen = append(seen, l)
				}
			}
			if len(seen) > 2 || seen[len(seen)-1] != longest(after, addr) {
				t.Fatalf("round %d: the longest prefix of %s went %v (adding %v, then removing %v)", round, addr, seen, upserts, deletes)
			}
		}
	}
}
