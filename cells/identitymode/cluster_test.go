package identitymode_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/apiary-net/apiary/apis/v1alpha1"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/identitymode"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/operator"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// runHive starts a hive with flags and stops it when the test ends (or
// when the returned function is called).
func runHive(t testing.TB, cells []cell.Cell, flags ...string) func() {
	t.Helper()
	h := hive.NewWithOptions(core.HiveOptions(), cells...)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	if err := fs.Parse(flags); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelWarn))
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	stopped := false
	stop := func() {
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

// agent is one node's agent in operator mode.
type agent struct {
	db        *statedb.DB
	endpoints statedb.Table[*tables.Endpoint]
	stop      func()
}

// startAgent starts node's agent; flags come after, and override, the
// defaults (operator mode).
func startAgent(t testing.TB, f *k8sfake.Clients, node, pinDir, stateDir string, flags ...string) *agent {
	a := &agent{}
	cells := []cell.Cell{
		infra.Cell, k8sfake.NewCell(f),
		identitymode.Cell, identity.Cell, ipcache.Cell, selectors.Cell, endpoints.Cell,
		cell.Invoke(func(db *statedb.DB, e statedb.Table[*tables.Endpoint]) { a.db, a.endpoints = db, e }),
	}
	a.stop = runHive(t, cells, append([]string{
		"--identity-management-mode=operator", "--node-name=" + node, "--node-ips=192.168.0.1",
		"--bpf-pin-dir=" + pinDir, "--state-dir=" + stateDir, "--api-addr=127.0.0.1:0"}, flags...)...)
	return a
}

// rows returns "name identity source error" of the agent's endpoints.
func (a *agent) rows() []string {
	var out []string
	for e := range a.endpoints.All(a.db.ReadTxn()) {
		out = append(out, fmt.Sprintf("%s %d %s %s", e.Name, e.Identity, e.IdentitySource, e.Error))
	}
	return out
}

// waitFor waits until cond holds, showing what show returns if it never
// does.
func waitFor(t *testing.T, what string, cond func() bool, show func() any) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, what, func() (bool, string) {
		if cond() {
			return true, ""
		}
		return false, fmt.Sprint(show())
	})
}

func listIdentities(t testing.TB, f *k8sfake.Clients) []v1alpha1.Identity {
	var l v1alpha1.IdentityList
	if err := f.ListCustom(v1alpha1.IdentityGVR, "", &l); err != nil {
		t.Fatal(err)
	}
	return l.Items
}

// waitOneIdentity waits until exactly one Identity exists and returns its
// name.
func waitOneIdentity(t *testing.T, f *k8sfake.Clients) string {
	t.Helper()
	var name string
	waitFor(t, "one Identity", func() bool {
		ids := listIdentities(t, f)
		if len(ids) == 1 {
			name = ids[0].Name
		}
		return len(ids) == 1
	}, func() any { return listIdentities(t, f) })
	return name
}

func identityCreates(f *k8sfake.Clients) int {
	n := 0
	for _, a := range f.Dynamic.Fake().Actions() {
		if a.GetVerb() == "create" && a.GetResource() == v1alpha1.IdentityGVR {
			n++
		}
	}
	return n
}

// TestOperatorAndAgents runs one operator and two agents in operator mode
// over one fake API server: pods get temporary identities at once, one
// Identity per label set cluster-wide replaces them on every node, a
// namespace relabel gets new Identities and the old one is collected, and
// restarted agents take the cluster numbers back without a detour.
func TestOperatorAndAgents(t *testing.T) {
	pinRoot := testenv.BPFPinDir(t)
	f := k8sfake.New()
	ctx := context.Background()
	if _, err := f.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{"env": "dev"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for i, node := range []string{"node-a", "node-b"} {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web-" + node, Labels: map[string]string{"app": "web", "pod-template-hash": node}},
			Spec:       corev1.PodSpec{NodeName: node},
			Status:     corev1.PodStatus{PodIP: fmt.Sprintf("10.0.%d.1", i+1)},
		}
		if _, err := f.CoreV1().Pods("shop").Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	dirs := map[string][2]string{}
	agents := map[string]*agent{}
	for _, node := range []string{"node-a", "node-b"} {
		dirs[node] = [2]string{pinRoot + "/" + node, t.TempDir()}
		agents[node] = startAgent(t, f, node, dirs[node][0], dirs[node][1])
	}

	// No operator yet: temporary identities at once, on both nodes.
	// (The number depends on whether the pod was first seen before its
	// namespace's labels, which is a race.)
	for node, a := range agents {
		waitFor(t, node+" temporary identity", func() bool {
			rows := a.rows()
			var (
				name, source string
				id           uint32
			)
			if len(rows) != 1 {
				return false
			}
			if _, err := fmt.Sscanf(rows[0], "%s %d %s", &name, &id, &source); err != nil {
				return false
			}
			return name == "shop/web-"+node && source == "temporary" && id >= identity.MinTemporary && id <= identity.MaxTemporary
		}, func() any { return a.rows() })
	}
	if n := identityCreates(f); n != 0 {
		t.Fatalf("agents created %d Identities", n)
	}

	// The operator creates one Identity; both nodes switch to it.
	runHive(t, []cell.Cell{statedb.Cell, health.Cell, job.Cell, metrics.Cell, k8s.SourcesCell, k8sfake.NewCell(f), operator.Cell},
		"--identity-gc-interval=100ms", "--identity-gc-grace-period=300ms", "--leader-election-retry-period=100ms",
		"--leader-election-renew-deadline=1s", "--leader-election-lease-duration=2s")
	first := waitOneIdentity(t, f)
	for node, a := range agents {
		want := fmt.Sprintf("shop/web-%s %s cluster ", node, first)
		waitFor(t, node+" cluster identity", func() bool { return slices.Equal(a.rows(), []string{want}) },
			func() any { return a.rows() })
	}

	// A namespace relabel: a new Identity, on both nodes; the old one goes.
	ns, err := f.CoreV1().Namespaces().Get(ctx, "shop", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ns.Labels = map[string]string{"env": "prod"}
	if _, err := f.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	var second string
	waitFor(t, "the old Identity collected, a new one", func() bool {
		ids := listIdentities(t, f)
		if len(ids) != 1 || ids[0].Name == first {
			return false
		}
		second = ids[0].Name
		return slices.Contains(ids[0].SecurityLabels, "k8s:io.cilium.k8s.namespace.labels.env=prod")
	}, func() any { return listIdentities(t, f) })
	for node, a := range agents {
		want := fmt.Sprintf("shop/web-%s %s cluster ", node, second)
		waitFor(t, node+" new cluster identity", func() bool { return slices.Equal(a.rows(), []string{want}) },
			func() any { return a.rows() })
	}
	if n := identityCreates(f); n != 2 {
		t.Fatalf("%d Identities created, want 2 (one per label set)", n)
	}

	// An agent restart keeps the cluster number.
	agents["node-a"].stop()
	a := startAgent(t, f, "node-a", dirs["node-a"][0], dirs["node-a"][1])
	want := fmt.Sprintf("shop/web-node-a %s cluster ", second)
	waitFor(t, "restarted agent's endpoint", func() bool { return len(a.rows()) == 1 }, func() any { return a.rows() })
	if got := a.rows(); !slices.Equal(got, []string{want}) {
		t.Fatalf("after restart: %v, want %s at once", got, want)
	}
	if n := identityCreates(f); n != 2 {
		t.Fatalf("%d Identities created after the restart, want 2", n)
	}
}

// TestIdentityLabelsShared sets --identity-labels on the operator and an
// agent alike: pods that differ only in a label it leaves out (and one the
// default filter leaves out) share one Identity, and the agent finds it
// (no endpoint stays temporary).
func TestIdentityLabelsShared(t *testing.T) {
	pinRoot := testenv.BPFPinDir(t)
	f := k8sfake.New()
	ctx := context.Background()
	const ignored = "--identity-labels=!rollout"
	for i, rollout := range []string{"r1", "r2"} {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "api-" + rollout,
				Labels: map[string]string{"app": "api", "rollout": rollout, "pod-template-hash": rollout}},
			Spec:   corev1.PodSpec{NodeName: "node-a"},
			Status: corev1.PodStatus{PodIP: fmt.Sprintf("10.0.3.%d", i+1)},
		}
		if _, err := f.CoreV1().Pods("shop").Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	a := startAgent(t, f, "node-a", pinRoot+"/node-a", t.TempDir(), ignored)
	runHive(t, []cell.Cell{statedb.Cell, health.Cell, job.Cell, metrics.Cell, k8s.SourcesCell, k8sfake.NewCell(f), operator.Cell},
		ignored, "--leader-election-retry-period=100ms", "--leader-election-renew-deadline=1s", "--leader-election-lease-duration=2s")

	id := waitOneIdentity(t, f)
	want := []string{
		fmt.Sprintf("shop/api-r1 %s cluster ", id),
		fmt.Sprintf("shop/api-r2 %s cluster ", id),
	}
	waitFor(t, "both endpoints on the cluster identity", func() bool { return slices.Equal(a.rows(), want) },
		func() any { return a.rows() })
}
