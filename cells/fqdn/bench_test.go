package fqdn_test

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/miekg/dns"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/cells/policy"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// BenchmarkProxyNewIP measures the latency the proxy adds to answers that
// bring a new address for a known selector (the common case of a name
// with rotating addresses): labelling, the ipcache resolution and the map
// write the answer waits for. Queries are paced at 1000/s, alternating
// through the proxy and directly to the same upstream; it reports p50 and
// p99 of both and of the difference.
func BenchmarkProxyNewIP(b *testing.B) {
	testenv.RequireRoot(b)
	up := startUpstream(b)
	a := startAgent(b, up.addr, "--tofqdns-max-ips-per-name=1000000")
	measureProxyNewIP(b, a, up)
}

// BenchmarkProxyNewIPPolicy is BenchmarkProxyNewIP with policy
// enforcement: a pod of this node, whose kubelet cgroup exists under
// --cgroup-root, is selected by examplePolicy, whose toFQDNs rule selects
// the benchmark's names; so the proxy also holds every answer (fqdn.Gate,
// from the policy cell) until the policy map has the pod's entries for
// the answer's identity. It waits for those to be in the pinned maps
// before measuring.
func BenchmarkProxyNewIPPolicy(b *testing.B) {
	testenv.RequireRoot(b)
	root := testenv.Cgroup(b)
	const uid = "0b5e7c1a-2d3f-4a5b-8c6d-7e8f9a0b1c2d"
	podCgroup := filepath.Join(root, "kubepods", "pod"+uid)
	if err := os.MkdirAll(podCgroup, 0o755); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		// Deepest first: a cgroup goes with rmdir only, once empty.
		for _, dir := range []string{podCgroup, filepath.Dir(podCgroup)} {
			if err := os.Remove(dir); err != nil {
				b.Errorf("remove cgroup %s: %v", dir, err)
			}
		}
	})
	cgroupID, err := cgroups.ID(podCgroup)
	if err != nil {
		b.Fatal(err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "client", Namespace: "default", UID: types.UID(uid), Labels: map[string]string{"app": "client"}},
		Spec:       corev1.PodSpec{NodeName: "test", Containers: []corev1.Container{{Name: "client", Image: "client"}}},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.244.0.5"},
	}
	var (
		endpointPolicy statedb.Table[*tables.EndpointPolicy]
		entries        statedb.Table[*tables.PolicyEntry]
	)
	up := startUpstream(b)
	a := startAgentWith(b, up.addr,
		[]cell.Cell{endpoints.Cell, policy.Cell, cell.Invoke(func(ep statedb.Table[*tables.EndpointPolicy], pe statedb.Table[*tables.PolicyEntry]) {
			endpointPolicy, entries = ep, pe
		})},
		[]k8sruntime.Object{pod},
		"--tofqdns-max-ips-per-name=1000000", "--cgroup-root="+root)

	// The pod is enforced (its cgroup in policy_endpoints) with an egress
	// entry for the FQDN identity in the policy map: what the gate checks
	// for every answer.
	var fqdnID uint32
	for id := range a.identities.All(a.db.ReadTxn()) {
		if id.Labels.HasSource(tables.SourceFQDN) {
			fqdnID = id.ID
		}
	}
	if fqdnID == 0 {
		b.Fatal("no FQDN identity")
	}
	var epID uint32
	testenv.Eventually(b, 10*time.Second, "the client's egress entry for the FQDN identity", func() (bool, string) {
		txn := a.db.ReadTxn()
		row, _, found := endpointPolicy.Get(txn, tables.EndpointPolicyNameIndex.Query("default/client"))
		if !found || row.ID == 0 || row.CgroupID != cgroupID || row.Egress != tables.EnforceDefaultDeny ||
			row.Status.Kind != reconciler.StatusKindDone {
			return false, fmt.Sprintf("endpoint-policy row: %v", row)
		}
		epID = row.ID
		for e := range entries.List(txn, tables.PolicyEntryIdentityIndex.Query(fqdnID)) {
			if e.Endpoint == row.Name && e.Direction == tables.DirEgress { // written: the row is Done
				return true, ""
			}
		}
		return false, "no egress entry yet"
	})
	eps, mapEntries, err := policy.ReadPinned(a.pinDir)
	if err != nil {
		b.Fatal(err)
	}
	if !slices.Contains(eps, policy.Endpoint{CgroupID: cgroupID, Value: bpf.PolicyEndpointValue{EndpointID: epID, Flags: bpf.PolicyEnforceEgress}}) {
		b.Fatalf("policy_endpoints has not the pod's cgroup %d as endpoint %d enforced on egress: %v", cgroupID, epID, eps)
	}
	if !slices.ContainsFunc(mapEntries, func(e policy.Entry) bool {
		return e.Key.EndpointID == epID && e.Key.Identity == fqdnID && e.Key.Egress == bpf.PolicyEgress
	}) {
		b.Fatalf("the policy map has no egress entry of endpoint %d for identity %d: %v", epID, fqdnID, mapEntries)
	}
	measureProxyNewIP(b, a, up)
}

// measureProxyNewIP runs the loop of BenchmarkProxyNewIP on a started
// agent and reports its figures.
func measureProxyNewIP(b *testing.B, a *agent, up *upstream) {
	c := &dns.Client{Timeout: 5 * time.Second}
	query := func(addr, name string) time.Duration {
		start := time.Now()
		resp, _, err := c.Exchange(new(dns.Msg).SetQuestion(name, dns.TypeA), addr)
		if err != nil || len(resp.Answer) != 1 {
			b.Fatalf("query %s at %s: %v", name, addr, err)
		}
		return time.Since(start)
	}
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	var viaProxy, direct []time.Duration
	b.ResetTimer()
	for b.Loop() {
		<-tick.C
		viaProxy = append(viaProxy, query(a.proxy.Addr(), "seq.example.com."))
		direct = append(direct, query(up.addr, "seq.example.org."))
	}
	b.StopTimer()
	if a.counter(b, "apiary_fqdn_proxy_response_delay_exceeded_total") != 0 {
		b.Log("some answers exceeded --tofqdns-proxy-response-max-delay")
	}
	pct := func(d []time.Duration, p float64) float64 {
		s := slices.Clone(d)
		slices.Sort(s)
		return float64(s[int(float64(len(s)-1)*p)].Microseconds()) / 1000
	}
	b.ReportMetric(pct(viaProxy, 0.5), "proxy-p50-ms")
	b.ReportMetric(pct(viaProxy, 0.99), "proxy-p99-ms")
	b.ReportMetric(pct(direct, 0.5), "direct-p50-ms")
	b.ReportMetric(pct(direct, 0.99), "direct-p99-ms")
	b.ReportMetric(pct(viaProxy, 0.5)-pct(direct, 0.5), "added-p50-ms")
	b.ReportMetric(pct(viaProxy, 0.99)-pct(direct, 0.99), "added-p99-ms")
	b.ReportMetric(float64(a.fqdnIdentities()), "fqdn-identities")
	mfs, _ := a.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == "apiary_fqdn_proxy_hold_seconds" {
			h := mf.GetMetric()[0].GetHistogram()
			b.ReportMetric(h.GetSampleSum()/float64(h.GetSampleCount())*1000, "hold-mean-ms")
		}
	}
}

// BenchmarkName10000IPs: a name answering 10,000 distinct addresses over
// ten answers of 1,000 (a DNS message holds at most about 4,000) uses one
// identity; it reports the identities and the heap the cache, prefixes and
// ipcache rows take.
func BenchmarkName10000IPs(b *testing.B) {
	testenv.RequireRoot(b)
	for b.Loop() {
		b.StopTimer()
		up := startUpstream(b)
		a := startAgent(b, up.addr, "--tofqdns-max-ips-per-name=10000")
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		b.StartTimer()
		for i := range 10 {
			up.set(b, "s3.example.com", records(1000, 1+1000*i)...)
			if _, err := fqdn.Query(a.proxy.Addr(), "s3.example.com", dns.TypeA, true, 10*time.Second); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		runtime.GC()
		runtime.ReadMemStats(&after)
		if id, ok := a.mapIdentity(b, netip.MustParseAddr("10.0.39.16")); !ok || id == 0 {
			b.Fatal("the last address is not in the map")
		}
		b.ReportMetric(float64(a.fqdnIdentities()), "fqdn-identities")
		b.ReportMetric(float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/1e6, "heap-MB")
		b.StartTimer()
	}
}
