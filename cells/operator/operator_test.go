package operator_test

import (
	"context"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	k8serrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	"github.com/apiary-net/apiary/apis/v1alpha1"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/operator"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// fastFlags make GC and leader election quick enough for tests.
var fastFlags = []string{
	"--identity-gc-interval=100ms",
	"--identity-gc-grace-period=300ms",
	"--leader-election-lease-duration=2s",
	"--leader-election-renew-deadline=1s",
	"--leader-election-retry-period=100ms",
}

// operatorHive is one running operator replica and what the tests observe
// of it: its metrics (GC runs, what it knows) and its health.
type operatorHive struct {
	stop   func()
	reg    *prometheus.Registry
	db     *statedb.DB
	health statedb.Table[*tables.HealthStatus]
}

// startOperator runs an operator hive over f until the test ends or stop
// is called.
func startOperator(t *testing.T, f *k8sfake.Clients, flags ...string) *operatorHive {
	t.Helper()
	o := &operatorHive{}
	h := hive.NewWithOptions(core.HiveOptions(),
		statedb.Cell, health.Cell, job.Cell, metrics.Cell, k8s.SourcesCell,
		k8sfake.NewCell(f), operator.Cell,
		cell.Invoke(func(reg *prometheus.Registry, db *statedb.DB, h statedb.Table[*tables.HealthStatus]) {
			o.reg, o.db, o.health = reg, db, h
		}))
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	if err := fs.Parse(append(slices.Clone(fastFlags), flags...)); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelWarn))
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	stopped := false
	o.stop = func() {
		if !stopped {
			stopped = true
			if err := h.Stop(log, context.Background()); err != nil {
				t.Error(err)
			}
		}
	}
	t.Cleanup(o.stop)
	return o
}

// metric returns the value of the replica's counter or gauge name (0 when
// it has none).
func (o *operatorHive) metric(t *testing.T, name string) float64 {
	t.Helper()
	mfs, err := o.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name || len(mf.GetMetric()) == 0 {
			continue
		}
		m := mf.GetMetric()[0]
		if c := m.GetCounter(); c != nil {
			return c.GetValue()
		}
		return m.GetGauge().GetValue()
	}
	return 0
}

// waitMetric waits until the replica's metric name satisfies ok.
func (o *operatorHive) waitMetric(t *testing.T, name, want string, ok func(float64) bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for v := o.metric(t, name); !ok(v); v = o.metric(t, name) {
		if time.Now().After(deadline) {
			t.Fatalf("%s = %v, want %s", name, v, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitKnown waits until the leader's own view has caught up: as many
// Identities and label sets in use as given. Both gauges are set after the
// controller has reconciled what it received (created what was missing).
func (o *operatorHive) waitKnown(t *testing.T, identities, labelSets int) {
	t.Helper()
	o.waitMetric(t, "apiary_operator_identities", fmt.Sprint(identities), func(v float64) bool { return v == float64(identities) })
	o.waitMetric(t, "apiary_operator_label_sets_in_use", fmt.Sprint(labelSets), func(v float64) bool { return v == float64(labelSets) })
}

// gcRuns waits until the leader has run n more identity GCs than it had
// when called. The controller reconciles every label set after each, so
// once two have run, whatever the leader would write about the state it
// had when gcRuns was called has been written: what did not happen by then
// is not going to.
func (o *operatorHive) gcRuns(t *testing.T, n int) {
	t.Helper()
	const name = "apiary_operator_identity_gc_runs_total"
	want := o.metric(t, name) + float64(n)
	o.waitMetric(t, name, fmt.Sprintf(">= %v", want), func(v float64) bool { return v >= want })
}

// waitHealth waits until a scope of the operator module reports a message
// matching re.
func (o *operatorHive) waitHealth(t *testing.T, re string) {
	t.Helper()
	pattern := regexp.MustCompile(re)
	deadline := time.After(20 * time.Second)
	for {
		rows, watch := o.health.AllWatch(o.db.ReadTxn())
		var seen []string
		for s := range rows {
			if strings.HasPrefix(s.Scope, "operator") {
				if pattern.MatchString(s.Message) {
					return
				}
				seen = append(seen, s.Scope+": "+s.Message)
			}
		}
		select {
		case <-watch:
		case <-deadline:
			t.Fatalf("no operator health message matches %q; have %q", re, seen)
		}
	}
}

func pod(ns, name, node string, labels map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
		Spec:       corev1.PodSpec{NodeName: node},
	}
}

func namespace(name string, labels map[string]string) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

// identities returns the Identities as "labels -> names" lines, sorted.
func identities(t *testing.T, f *k8sfake.Clients) []string {
	t.Helper()
	var l v1alpha1.IdentityList
	if err := f.ListCustom(v1alpha1.IdentityGVR, "", &l); err != nil {
		t.Fatal(err)
	}
	byLabels := map[string][]string{}
	for _, i := range l.Items {
		k := strings.Join(i.SecurityLabels, ",")
		byLabels[k] = append(byLabels[k], i.Name)
	}
	var out []string
	for k, names := range byLabels {
		slices.Sort(names)
		out = append(out, fmt.Sprintf("%s -> %d", k, len(names)))
	}
	slices.Sort(out)
	return out
}

// waitIdentities waits until identities(f) equals want.
func waitIdentities(t *testing.T, f *k8sfake.Clients, want ...string) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, "identities:\n  "+strings.Join(want, "\n  "), func() (bool, string) {
		got := identities(t, f)
		return slices.Equal(got, want), strings.Join(got, "\n")
	})
}

// newClients returns fake clients that serve Identities.
func newClients() *k8sfake.Clients {
	kinds := k8s.NewKinds()
	if err := k8s.RegisterKind(kinds, v1alpha1.IdentityKind); err != nil {
		panic(err)
	}
	return k8sfake.New(kinds)
}

// creates counts the Identity create calls made on f.
func creates(f *k8sfake.Clients) int {
	n := 0
	for _, a := range f.Dynamic.Fake().Actions() {
		if a.GetVerb() == "create" && a.GetResource() == v1alpha1.IdentityGVR {
			n++
		}
	}
	return n
}

func mustCreate[T any](t *testing.T, create func(context.Context, T, metav1.CreateOptions) (T, error), obj T) {
	t.Helper()
	if _, err := create(context.Background(), obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

const (
	webDefault = "k8s:app=web,k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=default,k8s:io.kubernetes.pod.namespace=default"
	dbDefault  = "k8s:app=db,k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=default,k8s:io.kubernetes.pod.namespace=default"
)

// One Identity per label set however many pods (on however many nodes)
// share it; per-pod labels are ignored; host-network pods get none.
func TestOneIdentityPerLabelSet(t *testing.T) {
	f := newClients()
	pods := f.CoreV1().Pods("default")
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("default", nil))
	for i := range 20 {
		mustCreate(t, pods.Create, pod("default", fmt.Sprintf("web-%d", i), fmt.Sprintf("node-%d", i),
			map[string]string{"app": "web", "pod-template-hash": fmt.Sprint(i)}))
	}
	mustCreate(t, pods.Create, pod("default", "db-0", "node-0", map[string]string{"app": "db", "statefulset.kubernetes.io/pod-name": "db-0"}))
	hostPod := pod("default", "host", "node-0", map[string]string{"app": "host"})
	hostPod.Spec.HostNetwork = true
	mustCreate(t, pods.Create, hostPod)

	o := startOperator(t, f)
	waitIdentities(t, f, dbDefault+" -> 1", webDefault+" -> 1")
	// Settled: no second Identity of either set comes later.
	o.waitKnown(t, 2, 2)
	o.gcRuns(t, 2)
	if n := creates(f); n != 2 {
		t.Fatalf("%d creates, want 2", n)
	}

	// A pod added later with a known label set reuses its Identity.
	mustCreate(t, pods.Create, pod("default", "web-new", "node-9", map[string]string{"app": "web"}))
	mustCreate(t, pods.Create, pod("default", "cache-0", "node-9", map[string]string{"app": "cache"}))
	waitIdentities(t, f, "k8s:app=cache,k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=default,k8s:io.kubernetes.pod.namespace=default -> 1", dbDefault+" -> 1", webDefault+" -> 1")
	o.waitKnown(t, 3, 3)
	o.gcRuns(t, 2)
	if n := creates(f); n != 3 {
		t.Fatalf("%d creates, want 3", n)
	}
}

// A namespace label change gives its pods new Identities; the old ones are
// collected once unused for the grace period.
func TestNamespaceRelabelAndGC(t *testing.T) {
	f := newClients()
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("prod", map[string]string{"team": "a"}))
	mustCreate(t, f.CoreV1().Pods("prod").Create, pod("prod", "web-1", "n1", map[string]string{"app": "web"}))
	mustCreate(t, f.CoreV1().Pods("prod").Create, pod("prod", "web-2", "n2", map[string]string{"app": "web"}))
	o := startOperator(t, f)
	oldSet := "k8s:app=web,k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=prod,k8s:io.cilium.k8s.namespace.labels.team=a,k8s:io.kubernetes.pod.namespace=prod"
	newSet := "k8s:app=web,k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=prod,k8s:io.cilium.k8s.namespace.labels.team=b,k8s:io.kubernetes.pod.namespace=prod"
	waitIdentities(t, f, oldSet+" -> 1")

	if _, err := f.CoreV1().Namespaces().Update(context.Background(), namespace("prod", map[string]string{"team": "b"}), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The new one comes at once, the old one is collected later (the
	// test's grace period is 300ms), never both for the new set.
	waitIdentities(t, f, newSet+" -> 1")
	o.waitKnown(t, 1, 1)
	o.gcRuns(t, 2)
	if n := creates(f); n != 2 {
		t.Fatalf("%d creates, want 2", n)
	}

	// Deleting the pods collects the last one too.
	for _, n := range []string{"web-1", "web-2"} {
		if err := f.CoreV1().Pods("prod").Delete(context.Background(), n, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	waitIdentities(t, f)
}

// An Identity is kept for the grace period after its last pod goes, so a
// pod re-created at once finds it again.
func TestGCGracePeriod(t *testing.T) {
	f := newClients()
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("default", nil))
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "web-1", "n1", map[string]string{"app": "web"}))
	o := startOperator(t, f, "--identity-gc-grace-period=1h")
	waitIdentities(t, f, webDefault+" -> 1")
	if err := f.CoreV1().Pods("default").Delete(context.Background(), "web-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// The leader has seen the pod go (no label set in use), then collected
	// twice: the Identity is unused, but within its grace period.
	o.waitKnown(t, 1, 0)
	o.gcRuns(t, 2)
	if got, want := identities(t, f), []string{webDefault + " -> 1"}; !slices.Equal(got, want) {
		t.Fatalf("identities after two collections within the grace period: %q, want %q", got, want)
	}
	if n := o.metric(t, "apiary_operator_identities_deleted_total"); n != 0 {
		t.Fatalf("%v deletes within the grace period, want none", n)
	}
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "web-2", "n1", map[string]string{"app": "web"}))
	// The label set is in use again and reconciled, with the one Identity.
	o.waitKnown(t, 1, 1)
	o.gcRuns(t, 2)
	if n := creates(f); n != 1 {
		t.Fatalf("%d creates, want 1", n)
	}
}

// Existing Identities are reused, duplicates made by others are tolerated
// (kept while their label set is used) and never added to.
func TestReuseAndDuplicates(t *testing.T) {
	f := newClients()
	c, err := v1alpha1.NewClient(f.K8s())
	if err != nil {
		t.Fatal(err)
	}
	web := strings.Split(webDefault, ",")
	for _, n := range []uint32{1000, 1001} {
		if _, err := c.Create(context.Background(), v1alpha1.NewIdentity(n, web)); err != nil {
			t.Fatal(err)
		}
	}
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("default", nil))
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "web-1", "n1", map[string]string{"app": "web"}))
	before := creates(f)
	o := startOperator(t, f)
	// Synced, then two collections, each followed by a reconcile of every
	// label set: neither added a third Identity nor deleted a duplicate.
	o.waitKnown(t, 2, 1)
	o.gcRuns(t, 2)
	if got, want := identities(t, f), []string{webDefault + " -> 2"}; !slices.Equal(got, want) {
		t.Fatalf("identities: %q, want %q", got, want)
	}
	if n := creates(f) - before; n != 0 {
		t.Fatalf("%d creates, want none", n)
	}
}

// A restarted operator creates nothing for label sets that have
// Identities, and deletes nothing in use.
func TestRestartNoChurn(t *testing.T) {
	f := newClients()
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("default", nil))
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "web-1", "n1", map[string]string{"app": "web"}))
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "db-1", "n1", map[string]string{"app": "db"}))
	first := startOperator(t, f)
	waitIdentities(t, f, dbDefault+" -> 1", webDefault+" -> 1")
	first.stop()
	before := len(f.Dynamic.Fake().Actions())
	o := startOperator(t, f)
	// Synced, then two collections and reconciles of every label set.
	o.waitKnown(t, 2, 2)
	o.gcRuns(t, 2)
	if got, want := identities(t, f), []string{dbDefault + " -> 1", webDefault + " -> 1"}; !slices.Equal(got, want) {
		t.Fatalf("identities after the restart: %q, want %q", got, want)
	}
	for _, a := range f.Dynamic.Fake().Actions()[before:] {
		if a.GetResource() == v1alpha1.IdentityGVR && (a.GetVerb() == "create" || a.GetVerb() == "delete") {
			t.Errorf("restarted operator wrote: %s %v", a.GetVerb(), a)
		}
	}
}

// Two replicas: one leads and writes; when it stops, the other takes over.
func TestLeaderElection(t *testing.T) {
	f := newClients()
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("default", nil))
	for i := range 10 {
		mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", fmt.Sprintf("web-%d", i), "n", map[string]string{"app": "web"}))
	}
	// a starts alone and leads; b then waits on the Lease.
	a := startOperator(t, f, "--leader-election-identity=a")
	waitIdentities(t, f, webDefault+" -> 1")
	a.waitKnown(t, 1, 1)
	b := startOperator(t, f, "--leader-election-identity=b")
	// b has read the Lease and found a leading: it stands by.
	b.waitHealth(t, "^Standby: a leads$")
	if v := b.metric(t, "apiary_operator_leader"); v != 0 {
		t.Fatalf("b: apiary_operator_leader = %v while a leads", v)
	}
	if n := creates(f); n != 1 {
		t.Fatalf("%d creates by two replicas, want 1", n)
	}
	holder := func() string {
		lease, err := f.CoordinationV1().Leases("kube-system").Get(context.Background(), "apiary-operator", metav1.GetOptions{})
		if err != nil || lease.Spec.HolderIdentity == nil {
			return fmt.Sprint(err)
		}
		return *lease.Spec.HolderIdentity
	}
	if h := holder(); h != "a" {
		t.Fatalf("lease holder = %s, want a", h)
	}
	a.stop() // releases the Lease: b takes over within a retry period
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "db-0", "n", map[string]string{"app": "db"}))
	waitIdentities(t, f, dbDefault+" -> 1", webDefault+" -> 1")
	if h := holder(); h != "b" {
		t.Fatalf("after a stopped, lease holder = %s, want b", h)
	}
}

// A number taken by an Identity the watch has not delivered yet (a previous
// leader's, of the same label set) makes the operator wait for the watch
// rather than create a second Identity under the next number.
func TestTakenNumberNoDuplicate(t *testing.T) {
	f := newClients()
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("default", nil))
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "web-1", "n1", map[string]string{"app": "web"}))
	var raced atomic.Bool
	f.Dynamic.Fake().PrependReactor("create", v1alpha1.IdentityResource, func(a k8stesting.Action) (bool, runtime.Object, error) {
		if raced.Swap(true) {
			return false, nil, nil
		}
		// Someone created the same label set's Identity under this number
		// just before us.
		obj := a.(k8stesting.CreateAction).GetObject().(*unstructured.Unstructured)
		if err := f.Create(v1alpha1.IdentityGVR, obj.DeepCopy(), ""); err != nil {
			t.Error(err)
		}
		return true, nil, k8serrors.NewAlreadyExists(v1alpha1.IdentityGVR.GroupResource(), obj.GetName())
	})
	o := startOperator(t, f)
	waitIdentities(t, f, webDefault+" -> 1")
	// The leader has the taken number's Identity from the watch, for the
	// label set, and has reconciled every label set twice since: a second
	// Identity would have been created by then. (The retry after a taken
	// number is the same reconcile, which runs after every collection.)
	o.waitKnown(t, 1, 1)
	o.gcRuns(t, 2)
	if got, want := identities(t, f), []string{webDefault + " -> 1"}; !slices.Equal(got, want) {
		t.Fatalf("identities: %q, want %q", got, want)
	}
	if !raced.Load() {
		t.Fatal("the reactor never ran")
	}
}
