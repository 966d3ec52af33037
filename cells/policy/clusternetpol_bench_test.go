package policy_test

import (
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/selectors"
)

// Issue 38's scale: 100 ClusterNetworkPolicies of 25 rules each.
const (
	cnPolicies = 100
	cnRules    = 25
)

// clusterNetpols returns the benchmark's ClusterNetworkPolicies: policy i
// is of the Baseline tier when i mod 4 is 3, else of the Admin tier, of
// priority i mod 50 (so policies share priorities), and selects the
// namespaces of team t<i mod 10> (10 namespaces, so 10 local endpoints);
// its rules, alternately ingress and egress, Accept, Deny or Pass (by
// rule) the pods app=app-<r mod 5> of one namespace (2 identities: client
// and server) on one TCP port each.
func clusterNetpols() []*selectors.ClusterNetworkPolicy {
	var out []*selectors.ClusterNetworkPolicy
	for i := range cnPolicies {
		p := &selectors.ClusterNetworkPolicy{
			TypeMeta:   metav1.TypeMeta{APIVersion: "policy.networking.k8s.io/v1beta1", Kind: "ClusterNetworkPolicy"},
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("cn-%d", i)},
			Spec: selectors.ClusterNetworkPolicySpec{
				Tier: "Admin", Priority: int32(i % 50),
				Subject: selectors.ClusterNetpolSubject{Namespaces: &metav1.LabelSelector{
					MatchLabels: map[string]string{"team": fmt.Sprintf("t%d", i%10)}}},
			},
		}
		if i%4 == 3 {
			p.Spec.Tier = "Baseline"
		}
		for r := range cnRules {
			action := []string{"Deny", "Accept", "Pass"}[r%3]
			if p.Spec.Tier == "Baseline" && action == "Pass" {
				action = "Deny"
			}
			peer := selectors.ClusterNetpolPeer{Pods: &selectors.NamespacedPod{
				NamespaceSelector: metav1.LabelSelector{MatchLabels: map[string]string{
					"kubernetes.io/metadata.name": fmt.Sprintf("ns-%d", (i*7+r)%npNamespaces)}},
				PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": fmt.Sprintf("app-%d", r%5)}},
			}}
			proto := []selectors.ClusterNetpolProtocol{{TCP: &selectors.ClusterNetpolPorts{
				DestinationPort: &selectors.ClusterNetpolPort{Number: int32(1000 + r)}}}}
			if r%2 == 0 {
				p.Spec.Ingress = append(p.Spec.Ingress, selectors.ClusterNetpolIngress{
					Name: fmt.Sprintf("r%d", r), Action: action, From: []selectors.ClusterNetpolPeer{peer}, Protocols: proto})
			} else {
				p.Spec.Egress = append(p.Spec.Egress, selectors.ClusterNetpolEgressRule{
					Name: fmt.Sprintf("r%d", r), Action: action, To: []selectors.ClusterNetpolPeer{peer}, Protocols: proto})
			}
		}
		out = append(out, p)
	}
	return out
}

// BenchmarkAgentClusterNetworkPolicies: issue 38's case, beside
// BenchmarkAgentNetworkPolicies and on its cluster (2,000 pods in 100
// namespaces, 100 of them on this node): 100 ClusterNetworkPolicies of
// both tiers × 25 Accept, Deny and Pass rules handed to the selectors cell at
// once, timed until the 100 endpoints' entries are computed
// (to-entries-ms) and in the pinned map (to-map-ms); they all go again,
// untimed, after each run.
func BenchmarkAgentClusterNetworkPolicies(b *testing.B) {
	c := newNetpolCluster(false)
	policies := clusterNetpols()
	b.Run(fmt.Sprintf("from-scratch,pods=%d,namespaces=%d,policies=%d,rules=%d", len(c.pods), npNamespaces, len(policies), cnRules), func(b *testing.B) {
		bigBurst(b, 4*len(c.pods))
		a, _, _, cns := netpolAgent(b, c)
		none := map[string]int{}
		for _, n := range c.local {
			none[n] = 0
		}
		a.waitEndpoints(b, time.Minute, none, true)
		cns.send(k8s.Upsert, policies...)
		want := a.settle(b, c.local)
		total := 0
		for _, n := range want {
			total += n
		}
		cns.send(k8s.Delete, policies...)
		a.waitEndpoints(b, time.Minute, none, true)
		var toEntries, toMap, cpu, compute, write time.Duration
		b.ResetTimer()
		for range b.N {
			e0, w0 := a.engineTimes(b)
			t0, c0 := time.Now(), cpuTime()
			cns.send(k8s.Upsert, policies...)
			a.waitEndpoints(b, time.Minute, want, false)
			toEntries += time.Since(t0)
			a.waitEndpoints(b, time.Minute, want, true)
			toMap += time.Since(t0)
			cpu += cpuTime() - c0
			e1, w1 := a.engineTimes(b)
			compute, write = compute+e1-e0, write+w1-w0
			b.StopTimer()
			cns.send(k8s.Delete, policies...)
			a.waitEndpoints(b, time.Minute, none, true)
			b.StartTimer()
		}
		b.ReportMetric(ms(toEntries, b.N), "to-entries-ms")
		b.ReportMetric(ms(toMap, b.N), "to-map-ms")
		b.ReportMetric(ms(cpu, b.N), "cpu-ms")
		b.ReportMetric(ms(compute, b.N), "compute-ms")
		b.ReportMetric(ms(write, b.N), "table-write-ms")
		b.ReportMetric(float64(total), "entries")
	})
}
