package selectors

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"runtime"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/apiary-net/apiary/tables"
)

// bigPolicyRules is the shape of issue 29's comparison with the reference:
// rule r of n allows egress from app=web to 1–3 peers app=peer-N (N below
// peers) on 1–2 TCP ports. cells/policy's benchmarks build the same shape
// (bigPolicy there); keep the two in step.
func bigPolicyRules(n, peers int) []EgressRule {
	out := make([]EgressRule, n)
	for r := range out {
		for k := range 1 + r%3 {
			out[r].ToEndpoints = append(out[r].ToEndpoints, EndpointSelector{
				MatchLabels: map[string]string{"app": fmt.Sprintf("peer-%d", (r*7+k*331)%peers)},
			})
		}
		ports := []PortProtocol{{Port: PortValue(fmt.Sprint(1000 + r%17)), Protocol: "TCP"}}
		if r%2 == 1 {
			ports = append(ports, PortProtocol{Port: PortValue(fmt.Sprint(2000 + r%13)), Protocol: "TCP"})
		}
		out[r].ToPorts = []PortRule{{Ports: ports}}
	}
	return out
}

// peerLabels are the labels of pod app=<app> in namespace default.
func peerLabels(app string) tables.Labels {
	return tables.NewLabels("k8s:app="+app, "k8s:"+NamespaceLabel+"=default")
}

// heapInUse is the heap live after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkNewPolicy times the selectors' part of a new policy of 3,000
// rules (bigPolicyRules: 1–3 toEndpoints selectors and 1–2 ports each)
// over 1,000 peer identities in place, from the decoded policy object to
// the rows of the policies and selectors tables: parsing, matching its
// selectors against the identities, and the rows. The policy goes again,
// untimed, after each iteration. retained-B is the heap the policy keeps
// (its parsed form, its selectors and their selections).
func BenchmarkNewPolicy(b *testing.B) {
	const rules, peers = 3000, 1000
	b.Run(fmt.Sprintf("rules=%d,peers=%d", rules, peers), func(b *testing.B) {
		spec := &Rule{
			EndpointSelector: &EndpointSelector{MatchLabels: map[string]string{"app": "web"}},
			Egress:           bigPolicyRules(rules, peers),
		}
		c := &controller{
			cache: newSelectorCache(), policies: map[string]*parsedPolicy{}, cidrRefs: map[netip.Prefix]int{},
			dirtyPolicies: map[string]struct{}{}, dirtyCIDRs: map[netip.Prefix]struct{}{},
		}
		c.cache.upsertIdentity(256, peerLabels("web"))
		for i := range peers {
			c.cache.upsertIdentity(uint32(1000+i), peerLabels(fmt.Sprintf("peer-%d", i)))
		}
		c.cache.takeDirty()
		var retained uint64
		selected := 0
		b.ResetTimer()
		for range b.N {
			b.StopTimer()
			before := heapInUse()
			b.StartTimer()
			c.setPolicy("cnp/default/big", parsePolicy("cnp/default/big", "default", spec, nil, nil))
			rows := c.cache.takeDirty()
			row := policyRow("cnp/default/big", c.policies["cnp/default/big"], true)
			b.StopTimer()
			if row.Status != tables.PolicyOK {
				b.Fatalf("policy: %s", row.Error)
			}
			selected = 0
			for _, r := range rows {
				selected += len(r.Identities)
			}
			retained += heapInUse() - before
			c.setPolicy("cnp/default/big", nil)
			c.cache.takeDirty()
			clear(c.dirtyPolicies)
			b.StartTimer()
		}
		b.ReportMetric(float64(selected), "selections")
		b.ReportMetric(float64(retained)/float64(b.N), "retained-B")
	})
}

// BenchmarkScaleUp times 1,000 new identities (pods of a scale-up, each a
// new label set) arriving with 3,000 label selectors in place, one of
// which selects each, until the selectors' rows are ready to write. The
// identities go again, untimed, after each iteration.
func BenchmarkScaleUp(b *testing.B) {
	const identities, selectors = 1000, 3000
	b.Run(fmt.Sprintf("identities=%d,selectors=%d", identities, selectors), func(b *testing.B) {
		c := newSelectorCache()
		for i := range selectors {
			s, err := ParseEndpointSelector(EndpointSelector{MatchLabels: map[string]string{"app": fmt.Sprintf("peer-%d", i)}}, "default")
			if err != nil {
				b.Fatal(err)
			}
			c.addUser(s, "cnp/default/big")
		}
		c.takeDirty()
		labels := make([]tables.Labels, identities)
		for i := range labels {
			labels[i] = peerLabels(fmt.Sprintf("peer-%d", i*3))
		}
		b.ResetTimer()
		for range b.N {
			for i, l := range labels {
				c.upsertIdentity(uint32(1000+i), l)
			}
			if rows := c.takeDirty(); len(rows) != identities {
				b.Fatalf("%d selectors changed, want %d", len(rows), identities)
			}
			b.StopTimer()
			for i := range labels {
				c.deleteIdentity(uint32(1000 + i))
			}
			c.takeDirty()
			b.StartTimer()
		}
	})
}

// BenchmarkDecodePolicy decodes the JSON of the policy of
// BenchmarkNewPolicy as a watch hands it to the agent (the decode,
// including the search for unknown fields, that precedes what
// BenchmarkNewPolicy times).
func BenchmarkDecodePolicy(b *testing.B) {
	const rules, peers = 3000, 1000
	b.Run(fmt.Sprintf("rules=%d,peers=%d", rules, peers), func(b *testing.B) {
		data, err := json.Marshal(&CiliumNetworkPolicy{
			TypeMeta:   metav1.TypeMeta{APIVersion: "cilium.io/v2", Kind: "CiliumNetworkPolicy"},
			ObjectMeta: metav1.ObjectMeta{Name: "big", Namespace: "default"},
			Spec: &Rule{
				EndpointSelector: &EndpointSelector{MatchLabels: map[string]string{"app": "web"}},
				Egress:           bigPolicyRules(rules, peers),
			},
		})
		if err != nil {
			b.Fatal(err)
		}
		b.SetBytes(int64(len(data)))
		for range b.N {
			var p CiliumNetworkPolicy
			if err := json.Unmarshal(data, &p); err != nil {
				b.Fatal(err)
			}
			if len(p.Spec.Egress) != rules || len(p.UnknownFields()) != 0 {
				b.Fatalf("decoded %d rules, unknown fields %v", len(p.Spec.Egress), p.UnknownFields())
			}
		}
	})
}
