package selectors

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/apiary-net/apiary/tables"
)

// benchSelectors returns n selectors: half label selectors (app=app-<i>
// in a namespace), half CIDR selectors (/16s).
func benchSelectors(b *testing.B, n int) []Selector {
	out := make([]Selector, 0, n)
	for i := range n {
		if i%2 == 0 {
			s, err := ParseEndpointSelector(EndpointSelector{MatchLabels: map[string]string{"app": fmt.Sprintf("app-%d", i)}}, "default")
			if err != nil {
				b.Fatal(err)
			}
			out = append(out, s)
		} else {
			s, err := ParseCIDR(fmt.Sprintf("10.%d.0.0/16", i%256), nil)
			if err != nil {
				b.Fatal(err)
			}
			out = append(out, s)
		}
	}
	return out
}

// benchIdentities returns n label sets: half workloads, half CIDR /24s.
func benchIdentities(n int) []tables.Labels {
	out := make([]tables.Labels, n)
	for i := range n {
		if i%2 == 0 {
			out[i] = tables.NewLabels(fmt.Sprintf("k8s:app=app-%d", i%1000), "k8s:io.kubernetes.pod.namespace=default")
		} else {
			p := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i % 256), byte(i / 256), 0}), 24)
			out[i] = tables.NewLabels(tables.CIDRLabel(p), tables.LabelWorld)
		}
	}
	return out
}

// BenchmarkSelectorCache measures the incremental selector updates with
// 1,000 selectors and 10,000 identities:
//
//	identities  10,000 new identities arrive with 1,000 selectors in place
//	            (each matched against every selector once)
//	selectors   1,000 new selectors arrive with 10,000 identities in place
//	churn       one identity comes and goes with both in place
func BenchmarkSelectorCache(b *testing.B) {
	const nSel, nID = 1000, 10000
	sels := benchSelectors(b, nSel)
	ids := benchIdentities(nID)

	b.Run("identities", func(b *testing.B) {
		for range b.N {
			c := newSelectorCache()
			for _, s := range sels {
				c.addUser(s, "p")
			}
			c.takeDirty()
			for i, l := range ids {
				c.upsertIdentity(uint32(1000+i), l)
			}
			c.takeDirty()
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/nID, "ns/identity")
	})
	b.Run("selectors", func(b *testing.B) {
		for range b.N {
			c := newSelectorCache()
			for i, l := range ids {
				c.upsertIdentity(uint32(1000+i), l)
			}
			for _, s := range sels {
				c.addUser(s, "p")
			}
			c.takeDirty()
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/nSel, "ns/selector")
	})
	b.Run("churn", func(b *testing.B) {
		c := newSelectorCache()
		for _, s := range sels {
			c.addUser(s, "p")
		}
		for i, l := range ids {
			c.upsertIdentity(uint32(1000+i), l)
		}
		c.takeDirty()
		extra := tables.NewLabels("k8s:app=app-42", "k8s:io.kubernetes.pod.namespace=default", "k8s:version=2")
		b.ResetTimer()
		for range b.N {
			c.upsertIdentity(999, extra)
			c.deleteIdentity(999)
			c.takeDirty()
		}
	})
}
