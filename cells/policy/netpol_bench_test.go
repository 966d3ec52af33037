package policy_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/cells/policy"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// directResource is a k8s.Resource whose events the benchmark sends as
// decoded objects (see directCNPs), of any kind. What is sent before the
// selectors cell subscribes is lost.
type directResource[T k8s.Object] struct {
	mu   sync.Mutex
	subs map[chan k8s.Event[T]]struct{}
}

func newDirectResource[T k8s.Object]() *directResource[T] {
	return &directResource[T]{subs: map[chan k8s.Event[T]]struct{}{}}
}

// Events implements k8s.Resource: Sync at once, then what send sends.
func (d *directResource[T]) Events(ctx context.Context) <-chan k8s.Event[T] {
	ch := make(chan k8s.Event[T], 1024)
	ch <- k8s.Event[T]{Kind: k8s.Sync}
	d.mu.Lock()
	d.subs[ch] = struct{}{}
	d.mu.Unlock()
	go func() {
		<-ctx.Done()
		d.mu.Lock()
		delete(d.subs, ch)
		close(ch)
		d.mu.Unlock()
	}()
	return ch
}

func (d *directResource[T]) send(kind k8s.EventKind, objs ...T) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for ch := range d.subs {
		for _, o := range objs {
			ch <- k8s.Event[T]{Kind: kind, Key: k8s.KeyOf(o), Object: o}
		}
	}
}

// The cluster of BenchmarkAgentNetworkPolicies: namespaces ns-<i>
// (team=t<i mod 10>), 20 pods each (app=app-<j mod 5>, role client for odd
// j, server for even, container port http 8080), pod 0 of each on this
// node.
const (
	npNamespaces    = 100
	npPodsPerNS     = 20
	npPoliciesPerNS = 5
)

// netpolCluster is the namespaces, the pods and the policies of the
// benchmark, the policies as NetworkPolicies and as the equivalent CNPs.
type netpolCluster struct {
	namespaces []*corev1.Namespace
	pods       []*corev1.Pod
	netpols    []*networkingv1.NetworkPolicy
	cnps       []*selectors.CiliumNetworkPolicy
	local      []string // the local pods' keys
}

func newNetpolCluster(dnsToEveryPod bool) *netpolCluster {
	c := &netpolCluster{}
	tcp, udp := corev1.ProtocolTCP, corev1.ProtocolUDP
	port := func(p intstr.IntOrString, proto corev1.Protocol, end int32) networkingv1.NetworkPolicyPort {
		out := networkingv1.NetworkPolicyPort{Port: &p, Protocol: &proto}
		if end != 0 {
			out.EndPort = &end
		}
		return out
	}
	labels := func(kv ...string) *metav1.LabelSelector {
		s := &metav1.LabelSelector{MatchLabels: map[string]string{}}
		for i := 0; i < len(kv); i += 2 {
			s.MatchLabels[kv[i]] = kv[i+1]
		}
		return s
	}
	es := func(kv ...string) selectors.EndpointSelector {
		return selectors.EndpointSelector{MatchLabels: labels(kv...).MatchLabels}
	}
	cnpPorts := func(proto string, ports ...string) []selectors.PortRule {
		var pp []selectors.PortProtocol
		for _, p := range ports {
			port, end, _ := cutRange(p)
			pp = append(pp, selectors.PortProtocol{Port: selectors.PortValue(port), EndPort: selectors.PortValue(end), Protocol: proto})
		}
		return []selectors.PortRule{{Ports: pp}}
	}
	for i := range npNamespaces {
		ns := fmt.Sprintf("ns-%d", i)
		next := fmt.Sprintf("ns-%d", (i+1)%npNamespaces)
		team := fmt.Sprintf("t%d", (i+1)%10)
		c.namespaces = append(c.namespaces, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
			Name: ns, Labels: map[string]string{"team": fmt.Sprintf("t%d", i%10)}}})
		for j := range npPodsPerNS {
			role, node := "server", "other-node"
			if j%2 == 1 {
				role = "client"
			}
			if j == 0 {
				node = "test-node"
				c.local = append(c.local, ns+"/pod-0")
			}
			n := i*npPodsPerNS + j
			c.pods = append(c.pods, &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("pod-%d", j), Namespace: ns,
					UID:    types.UID(fmt.Sprintf("00000000-0000-4000-8000-%012d", n)),
					Labels: map[string]string{"app": fmt.Sprintf("app-%d", j%5), "role": role}},
				Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "i",
					Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: tcp}}}}},
				Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: fmt.Sprintf("10.%d.%d.%d", 10+n/62500, n/250%250, 1+n%250)},
			})
		}
		meta := func(name string) metav1.ObjectMeta { return metav1.ObjectMeta{Name: name, Namespace: ns} }
		nsLabel := func(k string) string { return "k8s:" + selectors.NamespaceLabelsPrefix + k }
		cidr, except := fmt.Sprintf("10.200.%d.0/24", i), fmt.Sprintf("10.200.%d.0/28", i)
		// 1. default deny ingress; 2. app-0 from role=client on 8080;
		// 3. app-0 from the next team's clients on the named port http;
		// 4. every pod out to a block less its except on 5432 and to the
		// next namespace's app-1 on 8000-8099; 5. every pod out on UDP 53
		// to ns-0's app-4 pods (the cluster's DNS) or, dnsToEveryPod, to
		// every pod (namespaceSelector {}: an entry per pod identity).
		dnsPeer := networkingv1.NetworkPolicyPeer{NamespaceSelector: labels(endpoints.NamespaceNameLabel, "ns-0"), PodSelector: labels("app", "app-4")}
		cnpDNSPeer := es("k8s:app", "app-4", nsLabel(endpoints.NamespaceNameLabel), "ns-0")
		if dnsToEveryPod {
			dnsPeer = networkingv1.NetworkPolicyPeer{NamespaceSelector: &metav1.LabelSelector{}}
			cnpDNSPeer = selectors.EndpointSelector{MatchExpressions: []selectors.LabelSelectorRequirement{{Key: "k8s:" + selectors.NamespaceLabel, Operator: "Exists"}}}
		}
		c.netpols = append(c.netpols,
			&networkingv1.NetworkPolicy{ObjectMeta: meta("deny"), Spec: networkingv1.NetworkPolicySpec{
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}}},
			&networkingv1.NetworkPolicy{ObjectMeta: meta("web"), Spec: networkingv1.NetworkPolicySpec{
				PodSelector: *labels("app", "app-0"),
				Ingress: []networkingv1.NetworkPolicyIngressRule{{
					From:  []networkingv1.NetworkPolicyPeer{{PodSelector: labels("role", "client")}},
					Ports: []networkingv1.NetworkPolicyPort{port(intstr.FromInt32(8080), tcp, 0)}}}}},
			&networkingv1.NetworkPolicy{ObjectMeta: meta("cross"), Spec: networkingv1.NetworkPolicySpec{
				PodSelector: *labels("app", "app-0"),
				Ingress: []networkingv1.NetworkPolicyIngressRule{{
					From:  []networkingv1.NetworkPolicyPeer{{NamespaceSelector: labels("team", team), PodSelector: labels("role", "client")}},
					Ports: []networkingv1.NetworkPolicyPort{port(intstr.FromString("http"), tcp, 0)}}}}},
			&networkingv1.NetworkPolicy{ObjectMeta: meta("egress"), Spec: networkingv1.NetworkPolicySpec{
				Egress: []networkingv1.NetworkPolicyEgressRule{
					{To: []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: cidr, Except: []string{except}}}},
						Ports: []networkingv1.NetworkPolicyPort{port(intstr.FromInt32(5432), tcp, 0)}},
					{To: []networkingv1.NetworkPolicyPeer{{NamespaceSelector: labels(endpoints.NamespaceNameLabel, next), PodSelector: labels("app", "app-1")}},
						Ports: []networkingv1.NetworkPolicyPort{port(intstr.FromInt32(8000), tcp, 8099)}}}}},
			&networkingv1.NetworkPolicy{ObjectMeta: meta("dns"), Spec: networkingv1.NetworkPolicySpec{
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeEgress},
				Egress: []networkingv1.NetworkPolicyEgressRule{{
					To:    []networkingv1.NetworkPolicyPeer{dnsPeer},
					Ports: []networkingv1.NetworkPolicyPort{{Protocol: &udp, Port: ptr(intstr.FromInt32(53))}}}}}},
		)
		cnpMeta := func(name string) metav1.ObjectMeta { return metav1.ObjectMeta{Name: name, Namespace: ns} }
		rule := func(subject selectors.EndpointSelector, r selectors.Rule) *selectors.CiliumNetworkPolicy {
			r.EndpointSelector = &subject
			return &selectors.CiliumNetworkPolicy{ObjectMeta: cnpMeta(""), Spec: &r}
		}
		same := []*selectors.CiliumNetworkPolicy{
			rule(es(), selectors.Rule{Ingress: []selectors.IngressRule{{}}}),
			rule(es("k8s:app", "app-0"), selectors.Rule{Ingress: []selectors.IngressRule{{
				FromEndpoints: []selectors.EndpointSelector{es("k8s:role", "client")}, ToPorts: cnpPorts("TCP", "8080")}}}),
			rule(es("k8s:app", "app-0"), selectors.Rule{Ingress: []selectors.IngressRule{{
				FromEndpoints: []selectors.EndpointSelector{es("k8s:role", "client", nsLabel("team"), team)}, ToPorts: cnpPorts("TCP", "http")}}}),
			rule(es(), selectors.Rule{Ingress: []selectors.IngressRule{{}}, Egress: []selectors.EgressRule{
				{ToCIDRSet: []selectors.CIDRRule{{CIDR: cidr, Except: []string{except}}}, ToPorts: cnpPorts("TCP", "5432")},
				{ToEndpoints: []selectors.EndpointSelector{es("k8s:app", "app-1", nsLabel(endpoints.NamespaceNameLabel), next)}, ToPorts: cnpPorts("TCP", "8000-8099")}}}),
			rule(es(), selectors.Rule{Egress: []selectors.EgressRule{{
				ToEndpoints: []selectors.EndpointSelector{cnpDNSPeer},
				ToPorts:     cnpPorts("UDP", "53")}}}),
		}
		for k, p := range same {
			p.Name = c.netpols[len(c.netpols)-npPoliciesPerNS+k].Name
		}
		c.cnps = append(c.cnps, same...)
	}
	return c
}

func ptr[T any](v T) *T { return &v }

// cutRange splits "8000-8099" into its ends.
func cutRange(s string) (string, string, bool) {
	for i := range s {
		if s[i] == '-' {
			return s[:i], s[i+1:], true
		}
	}
	return s, "", false
}

// netpolAgent starts the policy cells on c's namespaces and pods (through
// the fake clientset), with the policies of either kind sent directly.
func netpolAgent(b *testing.B, c *netpolCluster) (*policyAgent, *directResource[*networkingv1.NetworkPolicy], *directResource[*selectors.CiliumNetworkPolicy], *directResource[*selectors.ClusterNetworkPolicy]) {
	b.Helper()
	testenv.RequireRoot(b)
	a := &policyAgent{fake: k8sfake.New(), root: testenv.Cgroup(b)} //nolint:staticcheck // CRDs need the untyped tracker
	b.Cleanup(func() { removeCgroupsBelow(b, a.root) })
	netpols, cnps := newDirectResource[*networkingv1.NetworkPolicy](), newDirectResource[*selectors.CiliumNetworkPolicy]()
	clusterNetpols := newDirectResource[*selectors.ClusterNetworkPolicy]()
	a.hive = hive.NewWithOptions(core.HiveOptions(),
		infra.Cell, k8sfake.NewCell(a.fake),
		identity.Cell, ipcache.Cell,
		cell.Decorate(
			func(k8s.Resource[*networkingv1.NetworkPolicy]) k8s.Resource[*networkingv1.NetworkPolicy] {
				return netpols
			},
			cell.Decorate(
				func(k8s.Resource[*selectors.CiliumNetworkPolicy]) k8s.Resource[*selectors.CiliumNetworkPolicy] {
					return cnps
				},
				cell.Decorate(
					func(k8s.Resource[*selectors.ClusterNetworkPolicy]) k8s.Resource[*selectors.ClusterNetworkPolicy] {
						return clusterNetpols
					},
					selectors.Cell))),
		endpoints.Cell, policy.Cell,
		cell.Invoke(func(db *statedb.DB, ep statedb.Table[*tables.EndpointPolicy], entries statedb.Table[*tables.PolicyEntry], reg *prometheus.Registry) {
			a.db, a.epPolicy, a.entries, a.registry = db, ep, entries, reg
		}))
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	a.hive.RegisterFlags(fs)
	if err := fs.Parse([]string{
		"--api-addr=127.0.0.1:0", "--bpf-pin-dir=" + testenv.BPFPinDir(b), "--state-dir=" + b.TempDir(),
		"--config-dir=" + b.TempDir(), "--node-name=test-node", "--node-ips=192.168.1.10",
		"--cgroup-root=" + a.root, "--bpf-policy-map-max=1048576",
	}); err != nil {
		b.Fatal(err)
	}
	a.log = hivetest.Logger(b, hivetest.LogLevel(slog.LevelWarn))
	ctx := context.Background()
	for _, ns := range c.namespaces {
		if _, err := a.fake.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	for _, p := range c.pods {
		if p.Spec.NodeName == "test-node" {
			if err := os.MkdirAll(filepath.Join(a.root, "kubepods", "pod"+string(p.UID)), 0o755); err != nil {
				b.Fatal(err)
			}
		}
		a.createPod(b, p)
	}
	a.start(b)
	return a, netpols, cnps, clusterNetpols
}

// settle waits until the local endpoints' rows have entries, have been
// reconciled and have stayed unchanged for a second, and returns their entry counts: what the
// timed runs then wait for.
func (a *policyAgent) settle(b *testing.B, names []string) map[string]int {
	b.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	var last string
	stableSince := time.Now()
	for time.Now().Before(deadline) {
		rtxn := a.db.ReadTxn()
		counts := map[string]int{}
		ok := true
		for _, n := range names {
			row, _, found := a.epPolicy.Get(rtxn, tables.EndpointPolicyNameIndex.Query(n))
			// Every local pod is selected by a policy (at least its
			// allow-localhost entry): no entries is not settled.
			if !found || row.ID == 0 || row.Status.Kind != reconciler.StatusKindDone || row.Entries == 0 {
				ok = false
				break
			}
			counts[n] = row.Entries
		}
		now := fmt.Sprint(counts)
		if !ok || now != last {
			last, stableSince = now, time.Now()
		} else if time.Since(stableSince) > time.Second {
			return counts
		}
		time.Sleep(20 * time.Millisecond)
	}
	b.Fatalf("endpoints did not settle: %s", last)
	return nil
}

// BenchmarkAgentNetworkPolicies is issue 26's case: 2,000 pods in 100
// namespaces (20 each, one of them on this node: 100 local endpoints),
// 500 policies (5 a namespace: default deny ingress; ingress from the
// namespace's clients on a port; from another namespace's clients by
// namespace label on a named port; egress to an ipBlock with except and
// to another namespace's pods by kubernetes.io/metadata.name on a port
// range; egress on UDP 53 to the DNS pods (udp53=dns) or to every pod
// (udp53=every-pod, 1,000 pod identities: an entry each for every
// endpoint)), written as NetworkPolicies (kind=netpol) or as the
// equivalent CNPs (kind=cnp), which give the same number of entries.
//
// from-scratch: every policy handed to the selectors cell at once
// (decoded objects), timed until the 100 endpoints' entries are computed
// (to-entries-ms) and in the pinned map (to-map-ms); they all go again,
// untimed, after each run. label-change: a local pod's labels change from
// app=app-0 to app=app-3 and back (the web and cross policies no longer
// select it, then again), timed from the update in the fake clientset
// until its entries are in the map (relabel-ms, per change).
func BenchmarkAgentNetworkPolicies(b *testing.B) {
	for _, bench := range []struct {
		kind, dns string
	}{{"netpol", "dns"}, {"cnp", "dns"}, {"netpol", "every-pod"}, {"cnp", "every-pod"}} {
		kind := bench.kind
		c := newNetpolCluster(bench.dns == "every-pod")
		send := func(netpols *directResource[*networkingv1.NetworkPolicy], cnps *directResource[*selectors.CiliumNetworkPolicy], ev k8s.EventKind) {
			if kind == "netpol" {
				netpols.send(ev, c.netpols...)
			} else {
				cnps.send(ev, c.cnps...)
			}
		}
		b.Run(fmt.Sprintf("from-scratch,kind=%s,udp53=%s,pods=%d,namespaces=%d,policies=%d", kind, bench.dns, len(c.pods), npNamespaces, len(c.netpols)), func(b *testing.B) {
			bigBurst(b, 4*len(c.pods))
			a, netpols, cnps, _ := netpolAgent(b, c)
			none := map[string]int{}
			for _, n := range c.local {
				none[n] = 0
			}
			a.waitEndpoints(b, time.Minute, none, true)
			send(netpols, cnps, k8s.Upsert)
			want := a.settle(b, c.local)
			total := 0
			for _, n := range want {
				total += n
			}
			sets, setEntries := a.policySets()
			send(netpols, cnps, k8s.Delete)
			a.waitEndpoints(b, time.Minute, none, true)
			var toEntries, toMap, cpu, compute, write time.Duration
			b.ResetTimer()
			for range b.N {
				e0, w0 := a.engineTimes(b)
				t0, c0 := time.Now(), cpuTime()
				send(netpols, cnps, k8s.Upsert)
				a.waitEndpoints(b, time.Minute, want, false)
				toEntries += time.Since(t0)
				a.waitEndpoints(b, time.Minute, want, true)
				toMap += time.Since(t0)
				cpu += cpuTime() - c0
				e1, w1 := a.engineTimes(b)
				compute, write = compute+e1-e0, write+w1-w0
				b.StopTimer()
				send(netpols, cnps, k8s.Delete)
				a.waitEndpoints(b, time.Minute, none, true)
				b.StartTimer()
			}
			b.ReportMetric(ms(toEntries, b.N), "to-entries-ms")
			b.ReportMetric(ms(toMap, b.N), "to-map-ms")
			b.ReportMetric(ms(cpu, b.N), "cpu-ms")
			b.ReportMetric(ms(compute, b.N), "compute-ms")
			b.ReportMetric(ms(write, b.N), "table-write-ms")
			b.ReportMetric(float64(total), "entries")
			b.ReportMetric(float64(sets), "sets")
			b.ReportMetric(float64(setEntries), "set-entries")
		})
		b.Run(fmt.Sprintf("label-change,kind=%s,udp53=%s,pods=%d,namespaces=%d,policies=%d", kind, bench.dns, len(c.pods), npNamespaces, len(c.netpols)), func(b *testing.B) {
			bigBurst(b, 4*len(c.pods))
			a, netpols, cnps, _ := netpolAgent(b, c)
			none := map[string]int{}
			for _, n := range c.local {
				none[n] = 0
			}
			// The selectors cell has subscribed (directResource drops what
			// is sent before).
			a.waitEndpoints(b, time.Minute, none, true)
			send(netpols, cnps, k8s.Upsert)
			pod := c.pods[0] // ns-0/pod-0, app=app-0, local
			name := pod.Namespace + "/" + pod.Name
			all := a.settle(b, c.local)
			selected := all[name]
			relabel := func(app string) {
				pod = pod.DeepCopy()
				pod.Labels = map[string]string{"app": app, "role": "server"}
				if _, err := a.fake.CoreV1().Pods(pod.Namespace).Update(context.Background(), pod, metav1.UpdateOptions{}); err != nil {
					b.Fatal(err)
				}
			}
			relabel("app-3")
			unselected := a.settle(b, c.local)[name]
			if unselected == selected {
				b.Fatalf("relabelling changed nothing: %d entries", selected)
			}
			var d, cpu, compute, write time.Duration
			b.ResetTimer()
			for range b.N {
				for _, step := range []struct {
					app     string
					entries int
				}{{"app-0", selected}, {"app-3", unselected}} {
					e0, w0 := a.engineTimes(b)
					t0, c0 := time.Now(), cpuTime()
					relabel(step.app)
					all[name] = step.entries // the others' stay
					a.waitEndpoints(b, time.Minute, all, true)
					d += time.Since(t0)
					cpu += cpuTime() - c0
					e1, w1 := a.engineTimes(b)
					compute, write = compute+e1-e0, write+w1-w0
				}
			}
			b.ReportMetric(ms(d, 2*b.N), "relabel-ms")
			b.ReportMetric(ms(cpu, 2*b.N), "cpu-ms")
			b.ReportMetric(ms(compute, 2*b.N), "compute-ms")
			b.ReportMetric(ms(write, 2*b.N), "table-write-ms")
			b.ReportMetric(float64(selected), "entries-selected")
			b.ReportMetric(float64(unselected), "entries-unselected")
		})
	}
}
