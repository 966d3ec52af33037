package operator_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	k8serrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/apiary-net/apiary/apis/v1alpha1"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/operator"
)

// fastFlags make GC and leader election quick enough for tests.
var fastFlags = []string{
	"--identity-gc-interval=100ms",
	"--identity-gc-grace-period=300ms",
	"--leader-election-lease-duration=2s",
	"--leader-election-renew-deadline=1s",
	"--leader-election-retry-period=100ms",
}

// startOperator runs an operator hive over f until the test ends or stop
// is called.
func startOperator(t *testing.T, f *fake.Clientset, flags ...string) (stop func()) {
	t.Helper()
	h := hive.NewWithOptions(core.HiveOptions(),
		statedb.Cell, health.Cell, job.Cell, metrics.Cell, k8s.SourcesCell,
		k8sfake.NewCell(f), operator.Cell)
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
	stop = func() {
		if !stopped {
			stopped = true
			if err := h.Stop(log, context.Background()); err != nil {
				t.Error(err)
			}
		}
	}
	t.Cleanup(stop)
	return stop
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
func identities(t *testing.T, f *fake.Clientset) []string {
	t.Helper()
	c, err := v1alpha1.NewClient(&k8s.Clientset{Interface: f})
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.List(context.Background(), metav1.ListOptions{})
	if err != nil {
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

// eventually waits until identities(f) equals want.
func eventually(t *testing.T, f *fake.Clientset, want ...string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		got := identities(t, f)
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("identities:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// creates counts the Identity create calls made on f.
func creates(f *fake.Clientset) int {
	n := 0
	for _, a := range f.Actions() {
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
	webDefault = "k8s:app=web,k8s:io.kubernetes.pod.namespace=default"
	dbDefault  = "k8s:app=db,k8s:io.kubernetes.pod.namespace=default"
)

// One Identity per label set however many pods (on however many nodes)
// share it; per-pod labels are ignored; host-network pods get none.
func TestOneIdentityPerLabelSet(t *testing.T) {
	f := fake.NewSimpleClientset()
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

	startOperator(t, f)
	eventually(t, f, dbDefault+" -> 1", webDefault+" -> 1")
	if n := creates(f); n != 2 {
		t.Fatalf("%d creates, want 2", n)
	}

	// A pod added later with a known label set reuses its Identity.
	mustCreate(t, pods.Create, pod("default", "web-new", "node-9", map[string]string{"app": "web"}))
	mustCreate(t, pods.Create, pod("default", "cache-0", "node-9", map[string]string{"app": "cache"}))
	eventually(t, f, "k8s:app=cache,k8s:io.kubernetes.pod.namespace=default -> 1", dbDefault+" -> 1", webDefault+" -> 1")
	if n := creates(f); n != 3 {
		t.Fatalf("%d creates, want 3", n)
	}
}

// A namespace label change gives its pods new Identities; the old ones are
// collected once unused for the grace period.
func TestNamespaceRelabelAndGC(t *testing.T) {
	f := fake.NewSimpleClientset()
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("prod", map[string]string{"team": "a"}))
	mustCreate(t, f.CoreV1().Pods("prod").Create, pod("prod", "web-1", "n1", map[string]string{"app": "web"}))
	mustCreate(t, f.CoreV1().Pods("prod").Create, pod("prod", "web-2", "n2", map[string]string{"app": "web"}))
	startOperator(t, f)
	oldSet := "k8s:app=web,k8s:io.cilium.k8s.namespace.labels.team=a,k8s:io.kubernetes.pod.namespace=prod"
	newSet := "k8s:app=web,k8s:io.cilium.k8s.namespace.labels.team=b,k8s:io.kubernetes.pod.namespace=prod"
	eventually(t, f, oldSet+" -> 1")

	if _, err := f.CoreV1().Namespaces().Update(context.Background(), namespace("prod", map[string]string{"team": "b"}), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The new one comes at once, the old one is collected later (the
	// test's grace period is 300ms), never both for the new set.
	eventually(t, f, newSet+" -> 1")
	if n := creates(f); n != 2 {
		t.Fatalf("%d creates, want 2", n)
	}

	// Deleting the pods collects the last one too.
	for _, n := range []string{"web-1", "web-2"} {
		if err := f.CoreV1().Pods("prod").Delete(context.Background(), n, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, f)
}

// An Identity is kept for the grace period after its last pod goes, so a
// pod re-created at once finds it again.
func TestGCGracePeriod(t *testing.T) {
	f := fake.NewSimpleClientset()
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("default", nil))
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "web-1", "n1", map[string]string{"app": "web"}))
	startOperator(t, f, "--identity-gc-grace-period=1h")
	eventually(t, f, webDefault+" -> 1")
	if err := f.CoreV1().Pods("default").Delete(context.Background(), "web-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // several GC intervals
	eventually(t, f, webDefault+" -> 1")
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "web-2", "n1", map[string]string{"app": "web"}))
	time.Sleep(200 * time.Millisecond)
	if n := creates(f); n != 1 {
		t.Fatalf("%d creates, want 1", n)
	}
}

// Existing Identities are reused, duplicates made by others are tolerated
// (kept while their label set is used) and never added to.
func TestReuseAndDuplicates(t *testing.T) {
	f := fake.NewSimpleClientset()
	c, err := v1alpha1.NewClient(&k8s.Clientset{Interface: f})
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
	startOperator(t, f)
	time.Sleep(500 * time.Millisecond) // several GC intervals
	eventually(t, f, webDefault+" -> 2")
	if n := creates(f) - before; n != 0 {
		t.Fatalf("%d creates, want none", n)
	}
}

// A restarted operator creates nothing for label sets that have
// Identities, and deletes nothing in use.
func TestRestartNoChurn(t *testing.T) {
	f := fake.NewSimpleClientset()
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("default", nil))
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "web-1", "n1", map[string]string{"app": "web"}))
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "db-1", "n1", map[string]string{"app": "db"}))
	stop := startOperator(t, f)
	eventually(t, f, dbDefault+" -> 1", webDefault+" -> 1")
	stop()
	before := len(f.Actions())
	startOperator(t, f)
	time.Sleep(700 * time.Millisecond)
	eventually(t, f, dbDefault+" -> 1", webDefault+" -> 1")
	for _, a := range f.Actions()[before:] {
		if a.GetResource() == v1alpha1.IdentityGVR && (a.GetVerb() == "create" || a.GetVerb() == "delete") {
			t.Errorf("restarted operator wrote: %s %v", a.GetVerb(), a)
		}
	}
}

// Two replicas: one leads and writes; when it stops, the other takes over.
func TestLeaderElection(t *testing.T) {
	f := fake.NewSimpleClientset()
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("default", nil))
	for i := range 10 {
		mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", fmt.Sprintf("web-%d", i), "n", map[string]string{"app": "web"}))
	}
	// a starts alone and leads; b then waits on the Lease.
	stopA := startOperator(t, f, "--leader-election-identity=a")
	eventually(t, f, webDefault+" -> 1")
	startOperator(t, f, "--leader-election-identity=b")
	time.Sleep(300 * time.Millisecond)
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
	stopA() // releases the Lease: b takes over within a retry period
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "db-0", "n", map[string]string{"app": "db"}))
	eventually(t, f, dbDefault+" -> 1", webDefault+" -> 1")
	if h := holder(); h != "b" {
		t.Fatalf("after a stopped, lease holder = %s, want b", h)
	}
}

// A number taken by an Identity the watch has not delivered yet (a previous
// leader's, of the same label set) makes the operator wait for the watch
// rather than create a second Identity under the next number.
func TestTakenNumberNoDuplicate(t *testing.T) {
	f := fake.NewSimpleClientset()
	mustCreate(t, f.CoreV1().Namespaces().Create, namespace("default", nil))
	mustCreate(t, f.CoreV1().Pods("default").Create, pod("default", "web-1", "n1", map[string]string{"app": "web"}))
	raced := false
	f.PrependReactor("create", v1alpha1.IdentityResource, func(a k8stesting.Action) (bool, runtime.Object, error) {
		if raced {
			return false, nil, nil
		}
		raced = true
		// Someone created the same label set's Identity under this number
		// just before us.
		obj := a.(k8stesting.CreateAction).GetObject().(*v1alpha1.Identity)
		if err := f.Tracker().Create(v1alpha1.IdentityGVR, obj.DeepCopy(), ""); err != nil {
			t.Error(err)
		}
		return true, nil, k8serrors.NewAlreadyExists(v1alpha1.IdentityGVR.GroupResource(), obj.Name)
	})
	startOperator(t, f)
	eventually(t, f, webDefault+" -> 1")
	time.Sleep(1500 * time.Millisecond) // past the retry
	eventually(t, f, webDefault+" -> 1")
	if !raced {
		t.Fatal("the reactor never ran")
	}
}
