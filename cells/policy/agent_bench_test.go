package policy_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
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
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

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

// policyAgent is a started hive of the cells a node's policy takes
// (identities, ipcache, policies and selectors, endpoints, policy) on real
// pinned maps and a cgroup root of its own, fed through a fake clientset.
type policyAgent struct {
	db       *statedb.DB
	fake     *k8sfake.Clients
	epPolicy statedb.Table[*tables.EndpointPolicy]
	entries  statedb.Table[*tables.PolicyEntry]
	registry *prometheus.Registry
	root     string
	hive     *hive.Hive
	log      *slog.Logger
	// cnps, if not nil, hands the selectors cell its CiliumNetworkPolicy
	// events instead of the fake clientset.
	cnps *directCNPs
}

// directCNPs is a k8s.Resource of CiliumNetworkPolicy events sent by the
// benchmark, as decoded objects: without the fake clientset's copies of
// the object through JSON (three for a create, each dearer than the
// single decode of a real watch) that would dominate what is timed.
type directCNPs struct {
	mu   sync.Mutex
	subs map[chan k8s.Event[*selectors.CiliumNetworkPolicy]]struct{}
}

// Events implements k8s.Resource: Sync at once (there is no listing),
// then what send sends.
func (d *directCNPs) Events(ctx context.Context) <-chan k8s.Event[*selectors.CiliumNetworkPolicy] {
	ch := make(chan k8s.Event[*selectors.CiliumNetworkPolicy], 16)
	ch <- k8s.Event[*selectors.CiliumNetworkPolicy]{Kind: k8s.Sync}
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

func (d *directCNPs) send(kind k8s.EventKind, p *selectors.CiliumNetworkPolicy) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for ch := range d.subs {
		ch <- k8s.Event[*selectors.CiliumNetworkPolicy]{Kind: kind, Key: k8s.Key{Namespace: p.Namespace, Name: p.Name}, Object: p}
	}
}

// newPolicyAgent builds the hive; start starts it. With direct, its
// CiliumNetworkPolicy events come from addPolicy and deletePolicy
// directly (directCNPs), not through the fake clientset.
func newPolicyAgent(b *testing.B, direct bool, args ...string) *policyAgent {
	b.Helper()
	testenv.RequireRoot(b)
	a := &policyAgent{fake: k8sfake.New(), root: testenv.Cgroup(b)} //nolint:staticcheck // CRDs need the untyped tracker
	b.Cleanup(func() { removeCgroupsBelow(b, a.root) })
	selectorsCell := selectors.Cell
	if direct {
		a.cnps = &directCNPs{subs: map[chan k8s.Event[*selectors.CiliumNetworkPolicy]]struct{}{}}
		selectorsCell = cell.Decorate(
			func(k8s.Resource[*selectors.CiliumNetworkPolicy]) k8s.Resource[*selectors.CiliumNetworkPolicy] {
				return a.cnps
			},
			selectors.Cell)
	}
	a.hive = hive.NewWithOptions(core.HiveOptions(),
		infra.Cell, k8sfake.NewCell(a.fake),
		identity.Cell, ipcache.Cell, selectorsCell, endpoints.Cell, policy.Cell,
		cell.Invoke(func(db *statedb.DB, ep statedb.Table[*tables.EndpointPolicy], entries statedb.Table[*tables.PolicyEntry], reg *prometheus.Registry) {
			a.db, a.epPolicy, a.entries, a.registry = db, ep, entries, reg
		}))
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	a.hive.RegisterFlags(fs)
	flags := append([]string{
		"--api-addr=127.0.0.1:0", "--bpf-pin-dir=" + testenv.BPFPinDir(b), "--state-dir=" + b.TempDir(),
		"--config-dir=" + b.TempDir(), "--node-name=test-node", "--node-ips=192.168.1.10",
		"--cgroup-root=" + a.root,
	}, args...)
	if err := fs.Parse(flags); err != nil {
		b.Fatal(err)
	}
	a.log = hivetest.Logger(b, hivetest.LogLevel(slog.LevelWarn))
	return a
}

func (a *policyAgent) start(b *testing.B) {
	b.Helper()
	if err := a.hive.Start(a.log, context.Background()); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { a.hive.Stop(a.log, context.Background()) })
}

// bigBurst lets the fake clientset's watches take a burst of objects
// (they hold watch.DefaultChanSize events and panic when one is full).
func bigBurst(b *testing.B, n int) {
	old := watch.DefaultChanSize
	watch.DefaultChanSize = int32(n)
	b.Cleanup(func() { watch.DefaultChanSize = old })
}

// localPod adds pod name of this node with labels, and its cgroup.
func (a *policyAgent) localPod(b *testing.B, i int, name string, labels map[string]string) *corev1.Pod {
	b.Helper()
	uid := fmt.Sprintf("00000000-0000-4000-8000-%012d", i)
	if err := os.MkdirAll(filepath.Join(a.root, "kubepods", "pod"+uid), 0o755); err != nil {
		b.Fatal(err)
	}
	p := benchPod(name, uid, "test-node", fmt.Sprintf("10.0.%d.%d", i/250, 1+i%250), labels)
	a.createPod(b, p)
	return p
}

// peerPod adds pod name of another node with labels.
func (a *policyAgent) peerPod(b *testing.B, i int, name string, labels map[string]string) {
	b.Helper()
	uid := fmt.Sprintf("00000000-0000-4000-9000-%012d", i)
	a.createPod(b, benchPod(name, uid, "other-node", fmt.Sprintf("10.1.%d.%d", i/250, 1+i%250), labels))
}

func (a *policyAgent) createPod(b *testing.B, p *corev1.Pod) {
	b.Helper()
	if _, err := a.fake.CoreV1().Pods(p.Namespace).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
}

func benchPod(name, uid, node, ip string, labels map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID(uid), Labels: labels},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "i"}}},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip},
	}
}

var cnpResource = schema.GroupVersionResource{Group: "cilium.io", Version: "v2", Resource: "ciliumnetworkpolicies"}

func (a *policyAgent) addPolicy(b *testing.B, p *selectors.CiliumNetworkPolicy) {
	b.Helper()
	if a.cnps != nil {
		a.cnps.send(k8s.Upsert, p)
		return
	}
	if err := a.fake.Create(cnpResource, p, p.Namespace); err != nil {
		b.Fatal(err)
	}
}

func (a *policyAgent) deletePolicy(b *testing.B, p *selectors.CiliumNetworkPolicy) {
	b.Helper()
	if a.cnps != nil {
		a.cnps.send(k8s.Delete, p)
		return
	}
	if err := a.fake.Delete(cnpResource, p.Namespace, p.Name); err != nil {
		b.Fatal(err)
	}
}

// cnp is a policy of default with the given egress rules for pods app=subject.
func cnp(name, subject string, egress []selectors.EgressRule) *selectors.CiliumNetworkPolicy {
	return &selectors.CiliumNetworkPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: "cilium.io/v2", Kind: "CiliumNetworkPolicy"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: &selectors.Rule{
			EndpointSelector: &selectors.EndpointSelector{MatchLabels: map[string]string{"app": subject}},
			Egress:           egress,
		},
	}
}

// egressTo is a rule allowing TCP to pods app=<app> on ports.
func egressTo(apps []string, ports ...int) selectors.EgressRule {
	var r selectors.EgressRule
	for _, app := range apps {
		r.ToEndpoints = append(r.ToEndpoints, selectors.EndpointSelector{MatchLabels: map[string]string{"app": app}})
	}
	var pp []selectors.PortProtocol
	for _, p := range ports {
		pp = append(pp, selectors.PortProtocol{Port: selectors.PortValue(strconv.Itoa(p)), Protocol: "TCP"})
	}
	r.ToPorts = []selectors.PortRule{{Ports: pp}}
	return r
}

// bigPolicy is issue 29's policy of n rules (bigPolicyRules in
// bench_test.go and in cells/selectors), for pods app=web, and the number
// of entries it gives each of them.
func bigPolicy(n, peers int) (*selectors.CiliumNetworkPolicy, int) {
	var rules []selectors.EgressRule
	entries := map[[2]int]struct{}{}
	for r := range n {
		var apps []string
		ports := []int{1000 + r%17}
		if r%2 == 1 {
			ports = append(ports, 2000+r%13)
		}
		for k := range 1 + r%3 {
			peer := (r*7 + k*331) % peers
			apps = append(apps, fmt.Sprintf("peer-%d", peer))
			for _, p := range ports {
				entries[[2]int{peer, p}] = struct{}{}
			}
		}
		rules = append(rules, egressTo(apps, ports...))
	}
	return cnp("big", "web", rules), len(entries)
}

// waitEndpoints waits until every endpoint-policy row named in want has
// that many entries and, if inMap, is reconciled and the policy map holds
// as many entries as want in all. (A reconciled endpoint row alone is not
// enough: the entries reconciler may still be deleting the same keys of
// an earlier policy, which it writes back right after.) The map is looked
// at every 0.2 ms once the rows are there, which bounds what this adds
// to a time measured to the map.
// policySets returns how many policy sets the agent has, and their
// entries.
func (a *policyAgent) policySets() (sets, entries int) {
	for row := range a.epPolicy.All(a.db.ReadTxn()) {
		if row.Set {
			sets++
			entries += row.Entries
		}
	}
	return sets, entries
}

func (a *policyAgent) waitEndpoints(b *testing.B, timeout time.Duration, want map[string]int, inMap bool) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	total := 0
	for _, n := range want {
		total += n
	}
	for {
		rtxn := a.db.ReadTxn()
		_, watch := a.epPolicy.AllWatch(rtxn)
		_, entriesWatch := a.entries.AllWatch(rtxn)
		ok := true
		for name, n := range want {
			row, _, found := a.epPolicy.Get(rtxn, tables.EndpointPolicyNameIndex.Query(name))
			if !found || row.ID == 0 || row.Entries != n || inMap && row.Status.Kind != reconciler.StatusKindDone {
				ok = false
				break
			}
		}
		// The policy sets' entries are in the map too (their rows are
		// not endpoints: their names change from run to run).
		sets := 0
		for row := range a.epPolicy.All(rtxn) {
			if row.Set {
				sets += row.Entries
				if inMap && row.Status.Kind != reconciler.StatusKindDone {
					ok = false
				}
			}
		}
		// The entries reconciler's deletes change no row: once the rows
		// are there, the map's count is looked at every 0.2 ms.
		var poll <-chan time.Time
		if ok {
			if !inMap || a.mapEntries(b) == total+sets {
				return
			}
			poll = time.After(200 * time.Microsecond)
		}
		select {
		case <-poll:
		case <-watch:
		case <-entriesWatch:
		case <-ctx.Done():
			var got []string
			for row := range a.epPolicy.All(rtxn) {
				got = append(got, fmt.Sprintf("%s id=%d entries=%d %s", row.Name, row.ID, row.Entries, row.Status.Kind))
			}
			if len(got) > 5 {
				got = got[:5]
			}
			b.Fatalf("%d endpoints not at their entries (in map: %v, map entries %d of %d and %d of sets) within %s; have %s",
				len(want), inMap, a.mapEntries(b), total, sets, timeout, strings.Join(got, "; "))
		}
	}
}

// mapEntries is the policy map's entry count, as the agent exports it.
func (a *policyAgent) mapEntries(b *testing.B) int {
	b.Helper()
	families, err := a.registry.Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "apiary_policy_map_entries" {
			return int(f.GetMetric()[0].GetGauge().GetValue())
		}
	}
	b.Fatal("no apiary_policy_map_entries")
	return 0
}

// seconds is the value of one of the agent's counters of seconds, as a
// duration.
func (a *policyAgent) seconds(b *testing.B, name string) time.Duration {
	b.Helper()
	families, err := a.registry.Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name {
			return time.Duration(f.GetMetric()[0].GetCounter().GetValue() * float64(time.Second))
		}
	}
	b.Fatalf("no %s", name)
	return 0
}

// engineTimes are the time the agent spent computing entries and writing
// them into the tables so far.
func (a *policyAgent) engineTimes(b *testing.B) (compute, write time.Duration) {
	return a.seconds(b, "apiary_policy_compute_seconds_total"), a.seconds(b, "apiary_policy_table_write_seconds_total")
}

// cpuTime is the CPU time the process has used, user and system.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(fmt.Sprintf("getrusage: %v", err))
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// rss is the process's resident memory (VmRSS).
func rss(b *testing.B) uint64 {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.Lines(string(data)) {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			return kb << 10
		}
	}
	b.Fatal("no VmRSS")
	return 0
}

// heapInUse is the heap live after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

func ms(d time.Duration, n int) float64 { return float64(d.Microseconds()) / 1000 / float64(n) }

// BenchmarkAgentNewPolicy is issue 29's case (1) and (2) in the agent: a
// new policy of 3,000 rules (1–3 toEndpoints selectors and 1–2 ports
// each) selecting 1 or 100 local pods (ten per label set), over 1,000
// peer pods of other nodes, each of its own label set. Timed from the
// decoded policy object handed to the selectors cell (directCNPs; the
// decode a watch pays is BenchmarkDecodePolicy in cells/selectors) until
// every selected endpoint's entries are computed (to-entries-ms: in the
// policy-entries table) and until they are in the pinned policy map
// (to-map-ms). The policy goes again, untimed, after each iteration.
func BenchmarkAgentNewPolicy(b *testing.B) {
	const rules, peers = 3000, 1000
	for _, eps := range []int{1, 100} {
		b.Run(fmt.Sprintf("rules=%d,peers=%d,endpoints=%d", rules, peers, eps), func(b *testing.B) {
			bigBurst(b, 4*(peers+eps))
			a := newPolicyAgent(b, true, "--bpf-policy-map-max=1048576")
			a.start(b)
			p, perEndpoint := bigPolicy(rules, peers)
			want, none := map[string]int{}, map[string]int{}
			for i := range eps {
				name := fmt.Sprintf("web-%d", i)
				a.localPod(b, i, name, map[string]string{"app": "web", "replica-set": strconv.Itoa(i / 10)})
				want["default/"+name], none["default/"+name] = perEndpoint, 0
			}
			for i := range peers {
				a.peerPod(b, i, fmt.Sprintf("peer-%d", i), map[string]string{"app": fmt.Sprintf("peer-%d", i)})
			}
			a.waitEndpoints(b, time.Minute, none, true)
			var toEntries, toMap, cpu time.Duration
			b.ResetTimer()
			for range b.N {
				t0, c0 := time.Now(), cpuTime()
				a.addPolicy(b, p)
				a.waitEndpoints(b, 5*time.Minute, want, false)
				toEntries += time.Since(t0)
				a.waitEndpoints(b, 5*time.Minute, want, true)
				toMap += time.Since(t0)
				cpu += cpuTime() - c0
				b.StopTimer()
				if got := a.mapEntries(b); got != eps*perEndpoint {
					b.Fatalf("policy map holds %d entries, want %d", got, eps*perEndpoint)
				}
				a.deletePolicy(b, p)
				a.waitEndpoints(b, 5*time.Minute, none, true)
				b.StartTimer()
			}
			b.ReportMetric(ms(toEntries, b.N), "to-entries-ms")
			b.ReportMetric(ms(toMap, b.N), "to-map-ms")
			b.ReportMetric(ms(cpu, b.N), "cpu-ms")
			b.ReportMetric(float64(perEndpoint*eps), "entries")
		})
	}
}

// manyPolicies are n policies of default, policy j for pods
// app=svc-<s> (s = j mod subjects, m = j / subjects) with five egress
// rules, rule k to peer pod app=peer-<(5m+k+10s) mod peers> on TCP port
// 80+(m+k) mod 20, so that the policies of one subject name distinct
// peers; and the entries each subject's pods get.
func manyPolicies(n, subjects, peers int) ([]*selectors.CiliumNetworkPolicy, map[string]int) {
	var out []*selectors.CiliumNetworkPolicy
	entries := map[string]map[[2]int]struct{}{}
	for j := range n {
		subject := fmt.Sprintf("svc-%d", j%subjects)
		if entries[subject] == nil {
			entries[subject] = map[[2]int]struct{}{}
		}
		var rules []selectors.EgressRule
		for k := range 5 {
			s, m := j%subjects, j/subjects
			peer, port := (5*m+k+10*s)%peers, 80+(m+k)%20
			rules = append(rules, egressTo([]string{fmt.Sprintf("peer-%d", peer)}, port))
			entries[subject][[2]int{peer, port}] = struct{}{}
		}
		out = append(out, cnp(fmt.Sprintf("p-%d", j), subject, rules))
	}
	counts := map[string]int{}
	for s, e := range entries {
		counts[s] = len(e)
	}
	return out, counts
}

// BenchmarkAgentStart is issue 29's case (4): an agent starting with
// 10,000 policies of 5 rules each in place (policy j selects pods
// app=svc-<j mod 100>; 10 local pods, app=svc-0 to svc-9, so each is
// selected by 100 policies and has 500 entries), 1,000 peer pods of other
// nodes. Timed from
// the hive's start until every local endpoint's entries are in the pinned
// policy map. agent-heap-MB is the Go heap the started agent holds
// (after a collection, less what the fake clientset held before the
// start); rss-MB is the whole test process's resident memory then, fake
// clientset and its 10,000 stored policies included.
func BenchmarkAgentStart(b *testing.B) {
	const policies, subjects, locals, peers = 10000, 100, 10, 1000
	b.Run(fmt.Sprintf("policies=%d,rules=5,peers=%d,endpoints=%d", policies, peers, locals), func(b *testing.B) {
		var toMap, cpu time.Duration
		var heap, rssMax uint64
		for range b.N {
			b.StopTimer()
			a := newPolicyAgent(b, false)
			// The cells register the custom kinds with the fake clients as
			// the hive is populated: before the first policy is created.
			if err := a.hive.Populate(a.log); err != nil {
				b.Fatal(err)
			}
			pols, counts := manyPolicies(policies, subjects, peers)
			for _, p := range pols {
				a.addPolicy(b, p)
			}
			want := map[string]int{}
			for i := range locals {
				name := fmt.Sprintf("local-%d", i)
				p := a.localPod(b, i, name, map[string]string{"app": fmt.Sprintf("svc-%d", i)})
				want["default/"+p.Name] = counts[fmt.Sprintf("svc-%d", i)]
			}
			for i := range peers {
				a.peerPod(b, i, fmt.Sprintf("peer-%d", i), map[string]string{"app": fmt.Sprintf("peer-%d", i)})
			}
			pols = nil
			before := heapInUse()
			b.StartTimer()
			t0, c0 := time.Now(), cpuTime()
			a.start(b)
			a.waitEndpoints(b, 5*time.Minute, want, true)
			toMap += time.Since(t0)
			cpu += cpuTime() - c0
			b.StopTimer()
			heap += heapInUse() - before
			rssMax = max(rssMax, rss(b))
			total := 0
			for _, n := range want {
				total += n
			}
			if got := a.mapEntries(b); got != total {
				b.Fatalf("policy map holds %d entries, want %d", got, total)
			}
			a.hive.Stop(a.log, context.Background())
			b.StartTimer()
		}
		b.ReportMetric(ms(toMap, b.N), "to-map-ms")
		b.ReportMetric(ms(cpu, b.N), "cpu-ms")
		b.ReportMetric(float64(heap)/float64(b.N)/(1<<20), "agent-heap-MB")
		b.ReportMetric(float64(rssMax)/(1<<20), "rss-MB")
	})
}

// BenchmarkAgentLabelChange is issue 29's case (5): the labels of one
// local pod change so that 500 policies (one egress rule each, to one of
// 1,000 peer pods on one port) select it (select-ms), and back so that
// none does (unselect-ms): timed from the pod's update in the fake
// clientset until its entries are in the pinned policy map, or gone.
func BenchmarkAgentLabelChange(b *testing.B) {
	const policies, peers = 500, 1000
	b.Run(fmt.Sprintf("policies=%d,peers=%d", policies, peers), func(b *testing.B) {
		bigBurst(b, 4*(peers+policies))
		a := newPolicyAgent(b, false)
		a.start(b)
		var want int
		entries := map[[2]int]struct{}{}
		for j := range policies {
			peer, port := (7*j)%peers, 80+j%20
			a.addPolicy(b, cnp(fmt.Sprintf("p-%d", j), "web", []selectors.EgressRule{egressTo([]string{fmt.Sprintf("peer-%d", peer)}, port)}))
			entries[[2]int{peer, port}] = struct{}{}
		}
		want = len(entries)
		for i := range peers {
			a.peerPod(b, i, fmt.Sprintf("peer-%d", i), map[string]string{"app": fmt.Sprintf("peer-%d", i)})
		}
		pod := a.localPod(b, 0, "web", map[string]string{"app": "idle"})
		a.waitEndpoints(b, time.Minute, map[string]int{"default/web": 0}, true)
		relabel := func(app string, entries int) time.Duration {
			pod = pod.DeepCopy()
			pod.Labels = map[string]string{"app": app}
			t0 := time.Now()
			if _, err := a.fake.CoreV1().Pods("default").Update(context.Background(), pod, metav1.UpdateOptions{}); err != nil {
				b.Fatal(err)
			}
			a.waitEndpoints(b, time.Minute, map[string]int{"default/web": entries}, true)
			return time.Since(t0)
		}
		var sel, unsel, cpu time.Duration
		b.ResetTimer()
		for range b.N {
			c0 := cpuTime()
			sel += relabel("web", want)
			unsel += relabel("idle", 0)
			cpu += cpuTime() - c0
		}
		b.ReportMetric(ms(sel, b.N), "select-ms")
		b.ReportMetric(ms(unsel, b.N), "unselect-ms")
		b.ReportMetric(ms(cpu, b.N), "cpu-ms")
		b.ReportMetric(float64(want), "entries")
	})
}
