package identitymode_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	k8stesting "k8s.io/client-go/testing"

	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/identitymode"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/operator"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// The scenario of BenchmarkClusterIdentities.
const (
	benchPods       = 10_000
	benchLabelSets  = 1_000
	benchNamespaces = 10 // × 100 apps = benchLabelSets
	benchNodes      = 4
	// benchDeadline bounds one iteration's wait for every endpoint.
	benchDeadline = 2 * time.Minute
)

// benchPod returns pod k of the scenario: label set k % benchLabelSets
// (namespace and app), replica k / benchLabelSets, spread round-robin over
// the nodes so that every label set has pods on every node and every node
// has benchPods/benchNodes pods, with a pod-template-hash that the label
// sets leave out.
func benchPod(k int) *corev1.Pod {
	set, replica := k%benchLabelSets, k/benchLabelSets
	appsPerNS := benchLabelSets / benchNamespaces
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: fmt.Sprintf("ns-%d", set/appsPerNS),
			Name:      fmt.Sprintf("app-%d-%d", set%appsPerNS, replica),
			Labels: map[string]string{
				"app":               fmt.Sprintf("app-%d", set%appsPerNS),
				"tier":              "backend",
				"pod-template-hash": fmt.Sprintf("h%d", replica),
			},
		},
		Spec: corev1.PodSpec{NodeName: fmt.Sprintf("node-%d", (set+replica)%benchNodes)},
		Status: corev1.PodStatus{
			Phase: corev1.PodRunning,
			PodIP: fmt.Sprintf("10.%d.%d.%d", 1+k>>16, k>>8&0xff, k&0xff),
		},
	}
}

// raiseWatchBuffer lets the fake clientset's watches hold a whole burst.
// They buffer watch.DefaultChanSize (100) events per watcher and panic when
// one is full; an API server would buffer more, or close the watch and
// make the informer relist. 10,000 creates at once overrun 100 whenever
// an informer is descheduled for a moment.
func raiseWatchBuffer(b *testing.B) {
	old := watch.DefaultChanSize
	watch.DefaultChanSize = 4 * benchPods
	b.Cleanup(func() { watch.DefaultChanSize = old })
}

// writeCounter counts the writes (create, update, patch, delete) that
// reach the fake clientset, by resource, once started.
type writeCounter struct {
	mu       sync.Mutex
	counting bool
	byRes    map[string]int
	// lastIdentity is when the last Identity create arrived.
	lastIdentity time.Time
}

func (w *writeCounter) react(a k8stesting.Action) (bool, runtime.Object, error) {
	switch a.GetVerb() {
	case "create", "update", "patch", "delete", "delete-collection":
	default:
		return false, nil, nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.counting {
		res := a.GetResource().Resource
		if a.GetSubresource() != "" {
			res += "/" + a.GetSubresource()
		}
		w.byRes[res]++
		if res == "identities" && a.GetVerb() == "create" {
			w.lastIdentity = time.Now()
		}
	}
	return false, nil, nil // on to the object tracker
}

func (w *writeCounter) start() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.counting, w.byRes = true, map[string]int{}
}

func (w *writeCounter) snapshot() (map[string]int, time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[string]int{}
	for k, v := range w.byRes {
		out[k] = v
	}
	return out, w.lastIdentity
}

// progress is what one agent's endpoints went through; latencies are from
// the pod's create.
type progress struct {
	allFinal      time.Time       // every endpoint has its final identity
	firstID       []time.Duration // per endpoint: until it had an identity
	finalID       []time.Duration // per endpoint: until it had its final identity
	peakTemporary int             // most temporary numbers in use at once
	everTemporary int             // endpoints seen with a temporary identity
}

// follow watches a's endpoints table until all want endpoints have an
// identity of source final, looking at every commit it wakes up for (so
// temporary numbers that come and go between two looks are missed). It
// reads only the rows written since it last looked (by revision), so that
// following costs the agents under test little; endpoints are not deleted
// in this scenario. created gives each pod's create time (ns since start),
// index maps endpoint names to pods.
func (a *agent) follow(ctx context.Context, want int, final string, start time.Time, created []atomic.Int64, index map[string]int) (progress, error) {
	var (
		p               progress
		rev             statedb.Revision
		withID, done    int
		seen            = map[string]*tables.Endpoint{}
		temps           = map[uint32]int{} // temporary number -> endpoints
		seenTemp        = map[string]struct{}{}
		gotID, gotFinal = map[string]bool{}, map[string]bool{}
	)
	count := func(e *tables.Endpoint, d int) {
		if e.Identity == 0 {
			return
		}
		withID += d
		switch e.IdentitySource {
		case final:
			done += d
		case identity.SourceTemporary:
			temps[e.Identity] += d
			if temps[e.Identity] == 0 {
				delete(temps, e.Identity)
			}
		}
	}
	for {
		txn := a.db.ReadTxn()
		_, watch := a.endpoints.AllWatch(txn)
		now := time.Now()
		for e := range a.endpoints.LowerBound(txn, statedb.ByRevision[*tables.Endpoint](rev+1)) {
			if old, ok := seen[e.Name]; ok {
				count(old, -1)
			}
			seen[e.Name] = e
			count(e, 1)
			since := now.Sub(start) - time.Duration(created[index[e.Name]].Load())
			if e.Identity != 0 && !gotID[e.Name] {
				gotID[e.Name] = true
				p.firstID = append(p.firstID, since)
			}
			if e.Identity != 0 && e.IdentitySource == final && !gotFinal[e.Name] {
				gotFinal[e.Name] = true
				p.finalID = append(p.finalID, since)
			}
			if e.IdentitySource == identity.SourceTemporary {
				seenTemp[e.Name] = struct{}{}
			}
		}
		rev = a.endpoints.Revision(txn)
		p.peakTemporary = max(p.peakTemporary, len(temps))
		if len(seen) == want && done == want {
			p.allFinal = now
			p.everTemporary = len(seenTemp)
			return p, nil
		}
		select {
		case <-watch:
		case <-ctx.Done():
			return p, fmt.Errorf("%d of %d endpoints, %d with an identity, %d %s: %w", len(seen), want, withID, done, final, ctx.Err())
		}
	}
}

// waitHealth waits until a scope of db's health table whose name starts
// with scope reports a message starting with msg.
func waitHealth(tb testing.TB, db *statedb.DB, scope, msg string) {
	tb.Helper()
	t, ok := db.GetTable(db.ReadTxn(), "health").(statedb.Table[*tables.HealthStatus])
	if !ok {
		tb.Fatal("no health table")
	}
	deadline := time.After(time.Minute)
	for {
		iter, watch := t.AllWatch(db.ReadTxn())
		var seen []string
		for s := range iter {
			if strings.HasPrefix(s.Scope, scope) {
				if strings.HasPrefix(s.Message, msg) {
					return
				}
				seen = append(seen, s.Scope+": "+s.Message)
			}
		}
		select {
		case <-watch:
		case <-deadline:
			tb.Fatalf("timed out waiting for %s health %q; have %v", scope, msg, seen)
		}
	}
}

// BenchmarkClusterIdentities: benchNodes agents over one fake API server,
// and 10,000 pods over 1,000 label sets (spread over every node) created
// at once, as fast as the fake clientset takes them. Timed (ns/op,
// ms-to-all) from the first create until every endpoint on every node has
// its final identity. Each iteration runs the whole scenario on fresh hives
// and a fresh clientset.
//
// mode=operator is the scenario of issue 8: one operator, agents in
// operator mode, final = cluster. It fails unless there are exactly 1,000
// Identities, one per label set, every endpoint has its label set's, and
// the operator created each once. mode=agent is the baseline without an
// operator: each agent numbers label sets itself (final = agent), so the
// difference is what the operator mode costs.
//
// Metrics: ms-cpu, the CPU time the process (operator, agents, fake
// clientset and the benchmark's own loops) used meanwhile, which varies
// less than the wall time on a shared machine; ms-create-pods, how long
// the fake clientset took to accept the creates; ms-identities-created,
// the operator's last Identity create; ms-p50/p99-any-id, from a pod's
// create until its endpoint had an identity (temporary or final: nodes
// never wait for the operator), and ms-p50/p99-final-id until it had its
// final one; identities (Identity objects at the end); identity-writes and
// api-writes (every write by the operator and the agents, Lease renewals
// included, the benchmark's own pod creates not); peak-temporary, the most
// temporary numbers one node had in use at once, and temporary-endpoints,
// endpoints seen with one (both sampled at the commits of the endpoints
// table, so lower bounds).
func BenchmarkClusterIdentities(b *testing.B) {
	raiseWatchBuffer(b)
	for _, mode := range []string{identitymode.ModeOperator, identitymode.ModeAgent} {
		b.Run("mode="+mode, func(b *testing.B) {
			pinRoot := testenv.BPFPinDir(b)
			var rs []scenarioResult
			b.ResetTimer()
			b.StopTimer()
			for i := range b.N {
				rs = append(rs, runClusterScenario(b, mode, fmt.Sprintf("%s/%d", pinRoot, i)))
			}
			report(b, rs)
		})
	}
}

// scenarioResult is one iteration's figures; times are since the first
// pod create.
type scenarioResult struct {
	create, idsCreated time.Duration
	cpu                time.Duration // the process's CPU time while timed
	firstID, finalID   []time.Duration
	identities         int
	writes             map[string]int
	peakTemp, everTemp int
}

// report reports the means over the iterations.
func report(b *testing.B, rs []scenarioResult) {
	n := float64(len(rs))
	mean := func(f func(r scenarioResult) float64) float64 {
		sum := 0.0
		for _, r := range rs {
			sum += f(r)
		}
		return sum / n
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	pct := func(ds []time.Duration, p int) float64 {
		s := slices.Sorted(slices.Values(ds))
		return ms(s[(len(s)-1)*p/100])
	}
	b.ReportMetric(ms(b.Elapsed())/n, "ms-to-all")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return ms(r.cpu) }), "ms-cpu")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return ms(r.create) }), "ms-create-pods")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return ms(r.idsCreated) }), "ms-identities-created")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return pct(r.firstID, 50) }), "ms-p50-any-id")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return pct(r.firstID, 99) }), "ms-p99-any-id")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return pct(r.finalID, 50) }), "ms-p50-final-id")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return pct(r.finalID, 99) }), "ms-p99-final-id")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return float64(r.identities) }), "identities")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return float64(r.writes["identities"]) }), "identity-writes")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return float64(r.writes["leases"]) }), "lease-writes")
	b.ReportMetric(mean(func(r scenarioResult) float64 {
		all := 0
		for _, w := range r.writes {
			all += w
		}
		return float64(all)
	}), "api-writes")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return float64(r.peakTemp) }), "peak-temporary")
	b.ReportMetric(mean(func(r scenarioResult) float64 { return float64(r.everTemp) }), "temporary-endpoints")
}

// runClusterScenario runs one iteration in mode, with the timer stopped
// except from the first pod create until every endpoint has its final
// identity.
func runClusterScenario(b *testing.B, mode, pinRoot string) scenarioResult {
	ctx := context.Background()
	f := k8sfake.New()
	counter := &writeCounter{}
	f.PrependReactor("*", "*", counter.react)
	for i := range benchNamespaces {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("ns-%d", i), Labels: map[string]string{"team": fmt.Sprintf("team-%d", i)}}}
		if _, err := f.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
	}

	var stops []func()
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	final := identity.SourceAgent
	if mode == identitymode.ModeOperator {
		final = identity.SourceCluster
		var opDB *statedb.DB
		// Default flags: Lease renewals every 2 s, GC every 10 min.
		stops = append(stops, runHive(b, []cell.Cell{
			statedb.Cell, health.Cell, job.Cell, metrics.Cell, k8s.SourcesCell, k8sfake.NewCell(f), operator.Cell,
			cell.Invoke(func(db *statedb.DB) { opDB = db }),
		}))
		// Leading, synced and idle before the clock starts.
		waitHealth(b, opDB, "operator", "Leading: 0 Identities, 0 label sets in use")
	}
	agents := make([]*agent, benchNodes)
	for n := range benchNodes {
		agents[n] = startAgent(b, f, fmt.Sprintf("node-%d", n), fmt.Sprintf("%s-node-%d", pinRoot, n), b.TempDir(),
			"--identity-management-mode="+mode)
		stops = append(stops, agents[n].stop)
	}
	for _, a := range agents {
		// The pods' job has run a round; in operator mode the Identities
		// are listed.
		waitHealth(b, a.db, "endpoints", "0 pods, 0 on this node")
		if mode == identitymode.ModeOperator {
			waitHealth(b, a.db, "identity-mode", "0 Identities")
		}
	}

	pods := make([]*corev1.Pod, benchPods)
	index := map[string]int{}
	for k := range pods {
		pods[k] = benchPod(k)
		index[pods[k].Namespace+"/"+pods[k].Name] = k
	}
	created := make([]atomic.Int64, benchPods)
	followCtx, cancel := context.WithTimeout(ctx, benchDeadline)
	defer cancel()
	results := make([]progress, len(agents))
	errs := make([]error, len(agents))
	var wg sync.WaitGroup
	counter.start()
	cpu0 := cpuTime(b)
	b.StartTimer()
	start := time.Now()
	for n, a := range agents {
		wg.Go(func() {
			results[n], errs[n] = a.follow(followCtx, benchPods/benchNodes, final, start, created, index)
		})
	}
	for k, p := range pods {
		created[k].Store(int64(time.Since(start)))
		if _, err := f.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	r := scenarioResult{create: time.Since(start)}
	wg.Wait()
	b.StopTimer()
	r.cpu = cpuTime(b) - cpu0
	for n, err := range errs {
		if err != nil {
			b.Fatalf("node-%d: %v", n, err)
		}
	}

	var lastIdentity time.Time
	r.writes, lastIdentity = counter.snapshot()
	r.writes["pods"] -= benchPods // the input, not a component's write
	if r.writes["pods"] == 0 {
		delete(r.writes, "pods")
	}
	if !lastIdentity.IsZero() {
		r.idsCreated = lastIdentity.Sub(start)
	}
	for _, p := range results {
		r.firstID = append(r.firstID, p.firstID...)
		r.finalID = append(r.finalID, p.finalID...)
		r.peakTemp = max(r.peakTemp, p.peakTemporary)
		r.everTemp += p.everTemporary
	}
	ids := listIdentities(b, f)
	r.identities = len(ids)
	if mode != identitymode.ModeOperator {
		return r
	}
	// Exactly one Identity per label set, created once, and every endpoint
	// on every node has the number of its label set's Identity.
	byLabels := map[string]string{}
	for _, id := range ids {
		key := tables.NewLabels(id.SecurityLabels...).Key()
		if other, dup := byLabels[key]; dup {
			b.Fatalf("Identities %s and %s share the label set %s", other, id.Name, key)
		}
		byLabels[key] = id.Name
	}
	if len(ids) != benchLabelSets {
		b.Fatalf("%d Identities, want %d", len(ids), benchLabelSets)
	}
	for n, a := range agents {
		for e := range a.endpoints.All(a.db.ReadTxn()) {
			if want := byLabels[e.Labels.Key()]; fmt.Sprint(e.Identity) != want {
				b.Fatalf("node-%d: endpoint %s has identity %d, its label set's Identity is %q", n, e.Name, e.Identity, want)
			}
		}
	}
	if n := r.writes["identities"]; n != benchLabelSets {
		b.Fatalf("%d Identity writes, want %d: %v", n, benchLabelSets, r.writes)
	}
	return r
}

// cpuTime returns the CPU time (user and system) the process has used.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkFakeCreatePods times what BenchmarkClusterIdentities' create
// loop costs in the fake clientset alone: 10,000 pod creates through the
// same reactor chain, with no watcher and with one watch per hive of
// BenchmarkClusterIdentities (the operator and benchNodes agents), each
// drained by a goroutine as an informer would.
func BenchmarkFakeCreatePods(b *testing.B) {
	raiseWatchBuffer(b)
	pods := make([]*corev1.Pod, benchPods)
	for k := range pods {
		pods[k] = benchPod(k)
	}
	for _, watchers := range []int{0, 1 + benchNodes} {
		b.Run(fmt.Sprintf("watchers=%d", watchers), func(b *testing.B) {
			for range b.N {
				b.StopTimer()
				ctx, cancel := context.WithCancel(context.Background())
				f := k8sfake.New()
				f.PrependReactor("*", "*", (&writeCounter{}).react)
				var wg sync.WaitGroup
				for range watchers {
					w, err := f.CoreV1().Pods("").Watch(ctx, metav1.ListOptions{})
					if err != nil {
						b.Fatal(err)
					}
					wg.Go(func() {
						for range benchPods {
							<-w.ResultChan()
						}
						w.Stop()
					})
				}
				b.StartTimer()
				for _, p := range pods {
					if _, err := f.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
						b.Fatal(err)
					}
				}
				wg.Wait()
				b.StopTimer()
				cancel()
			}
			b.ReportMetric(float64(b.Elapsed())/float64(time.Millisecond)/float64(b.N), "ms-create-pods")
		})
	}
}
