package integration

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	k8serrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/apiary-net/apiary/apis/v1alpha1"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// wait is the deadline of each step: generous, as CI machines are slow;
// steps normally take well under a second.
const wait = 30 * time.Second

// apiaryProc is a running `apiary agent` or `apiary operator`.
type apiaryProc struct {
	*proc
	addr string // its --api-addr, as it logged it
}

func startApiary(t *testing.T, ps *procs, name, bin string, args ...string) *apiaryProc {
	t.Helper()
	args = append(args, "--api-addr=127.0.0.1:0", "--log-format=json")
	p := ps.start(t, name, bin, args...)
	return &apiaryProc{proc: p, addr: p.waitLog(t, "API listening", "address")}
}

// endpoints returns the process's endpoints table, by name, as
// `apiary db show endpoints -o json` would.
func (a *apiaryProc) endpoints() (map[string]tables.Endpoint, error) {
	var dump map[string][]tables.Endpoint
	if err := httpGetJSON("http://"+a.addr+"/statedb/dump/"+tables.EndpointsTableName, &dump); err != nil {
		return nil, err
	}
	out := map[string]tables.Endpoint{}
	for _, e := range dump[tables.EndpointsTableName] {
		out[e.Name] = e
	}
	return out, nil
}

// health returns the messages of the process's health table.
func (a *apiaryProc) health() ([]string, error) {
	var dump map[string][]tables.HealthStatus
	if err := httpGetJSON("http://"+a.addr+"/statedb/dump/"+tables.HealthTableName, &dump); err != nil {
		return nil, err
	}
	var out []string
	for _, h := range dump[tables.HealthTableName] {
		out = append(out, fmt.Sprintf("%s: %s %s %s", h.Scope, h.Level, h.Message, h.Error))
	}
	return out, nil
}

func showEndpoints(eps map[string]tables.Endpoint) string {
	var b strings.Builder
	for _, name := range slices.Sorted(maps.Keys(eps)) {
		e := eps[name]
		fmt.Fprintf(&b, "  %s identity=%d source=%s labels=%v error=%q\n", e.Name, e.Identity, e.IdentitySource, e.Labels, e.Error)
	}
	return b.String()
}

// identities lists the cluster's Identities: number → labels.
func identities(t *testing.T, c identityClient) map[uint32]tables.Labels {
	t.Helper()
	l, err := c.List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatalf("list Identities: %v", err)
	}
	out := map[uint32]tables.Labels{}
	for _, id := range l.Items {
		n, err := id.Number()
		if err != nil {
			t.Fatal(err)
		}
		out[n] = tables.NewLabels(id.SecurityLabels...)
	}
	return out
}

func showIdentities(ids map[uint32]tables.Labels) string {
	var b strings.Builder
	for _, n := range slices.Sorted(maps.Keys(ids)) {
		fmt.Fprintf(&b, "  %d %v\n", n, ids[n])
	}
	return b.String()
}

// identityClient is the operator's Identity client with a List.
type identityClient struct {
	*v1alpha1.Client
	res dynamic.ResourceInterface
}

func newIdentityClient(t *testing.T, cfg *rest.Config) identityClient {
	t.Helper()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	c, err := v1alpha1.NewClient(&k8s.Clientset{Interface: cs, Dynamic: dyn, RESTConfig: cfg})
	if err != nil {
		t.Fatal(err)
	}
	return identityClient{Client: c, res: dyn.Resource(v1alpha1.IdentityGVR)}
}

// List lists every Identity.
func (c identityClient) List(ctx context.Context, opts metav1.ListOptions) (*v1alpha1.IdentityList, error) {
	ul, err := c.res.List(ctx, opts)
	if err != nil {
		return nil, err
	}
	out := &v1alpha1.IdentityList{}
	return out, k8s.FromUnstructured(ul.UnstructuredContent(), out)
}

// podSpec is a pod of the test: its node, labels and IP.
type podSpec struct {
	ns, name, node, ip string
	labels             map[string]string
}

// createPod creates the pod and, as the kubelet would, reports it running
// with its IP through the status subresource.
func createPod(t *testing.T, cs kubernetes.Interface, p podSpec) {
	t.Helper()
	ctx := context.Background()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: p.ns, Name: p.name, Labels: p.labels},
		Spec: corev1.PodSpec{
			NodeName:   p.node,
			Containers: []corev1.Container{{Name: "app", Image: "registry.k8s.io/pause:3.10"}},
		},
	}
	created, err := cs.CoreV1().Pods(p.ns).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", p.ns, p.name, err)
	}
	created.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: p.ip, PodIPs: []corev1.PodIP{{IP: p.ip}}}
	if _, err := cs.CoreV1().Pods(p.ns).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("set the IP of pod %s/%s: %v", p.ns, p.name, err)
	}
}

// waitMetric waits until the process's metric has the value want. (The
// counters move just after the API calls return, so a moment after what the
// test observes in the cluster.)
func waitMetric(t *testing.T, a *apiaryProc, name string, want float64) {
	t.Helper()
	testenv.Eventually(t, wait, fmt.Sprintf("%s %s = %v", a.name, name, want), func() (bool, string) {
		n, err := metric(a.addr, name)
		if err != nil {
			return false, err.Error()
		}
		return n == want, fmt.Sprint(n)
	})
}

// waitHealthy waits until the process's /healthz answers 200.
func waitHealthy(t *testing.T, a *apiaryProc) {
	t.Helper()
	testenv.Eventually(t, wait, a.name+" /healthz 200", func() (bool, string) {
		resp, err := http.Get("http://" + a.addr + "/healthz?verbose=1")
		if err != nil {
			return false, err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode == http.StatusOK, resp.Status + " " + string(body)
	})
}

func isTemporary(n uint32) bool { return n >= identity.MinTemporary && n <= identity.MaxTemporary }

// checkIdentitySchema checks that the API server enforces the Identity
// CRD's schema: a name that is a number, a non-empty label set, and labels
// that never change once created — and that the operator, which never
// updates an Identity, is not allowed to.
func checkIdentitySchema(t *testing.T, admin, operator *rest.Config) {
	t.Helper()
	ctx := context.Background()
	resource := func(cfg *rest.Config) dynamic.ResourceInterface {
		d, err := dynamic.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return d.Resource(v1alpha1.IdentityGVR)
	}
	ids := resource(admin)
	obj := func(name string, labels ...any) *unstructured.Unstructured {
		u := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": v1alpha1.GroupVersion.String(), "kind": v1alpha1.IdentityKindName,
			"metadata": map[string]any{"name": name},
		}}
		if labels != nil {
			u.Object["securityLabels"] = labels
		}
		return u
	}
	for _, tc := range []struct {
		what string
		obj  *unstructured.Unstructured
		want string
	}{
		{"a name that is not a number", obj("web", "k8s:app=web"), "metadata.name"},
		{"a name with a leading zero", obj("0300", "k8s:app=web"), "metadata.name"},
		{"no label set", obj("4001"), "securityLabels: Required value"},
		{"an empty label", obj("4002", ""), "securityLabels[0]"},
	} {
		_, err := ids.Create(ctx, tc.obj, metav1.CreateOptions{})
		if !k8serrors.IsInvalid(err) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("create an Identity with %s: want Invalid naming %q, got %v", tc.what, tc.want, err)
			ids.Delete(ctx, tc.obj.GetName(), metav1.DeleteOptions{})
		}
	}

	created, err := ids.Create(ctx, obj("4000", "k8s:app=web"), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create a valid Identity: %v", err)
	}
	defer func() {
		if err := ids.Delete(ctx, "4000", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}()
	changed := created.DeepCopy()
	changed.Object["securityLabels"] = []any{"k8s:app=db"}
	if _, err := ids.Update(ctx, changed, metav1.UpdateOptions{}); !k8serrors.IsInvalid(err) ||
		!strings.Contains(err.Error(), "securityLabels are immutable") {
		t.Errorf("change an Identity's labels: want Invalid, securityLabels are immutable; got %v", err)
	}
	if _, err := resource(operator).Update(ctx, created, metav1.UpdateOptions{}); !k8serrors.IsForbidden(err) {
		t.Errorf("update an Identity as the operator: want Forbidden, got %v", err)
	}
}

// TestOperatorAndAgentsOnRealAPIServer runs `apiary operator` and two
// `apiary agent --identity-management-mode=operator` processes against a
// real kube-apiserver and etcd, each with a kubeconfig of its own
// ServiceAccount from deploy/'s RBAC, and checks what a user would see in
// their tables and in the cluster: temporary identities while there is no
// operator, one Identity per label set cluster-wide, endpoints switching to
// it, a namespace relabel with GC of the old Identities, and an operator
// restart without duplicates or renumbering.
func TestOperatorAndAgentsOnRealAPIServer(t *testing.T) {
	apiserverBin, etcdBin := requireTestbin(t)
	pinRoot := testenv.BPFPinDir(t) // the agents pin BPF maps: root and bpffs
	ctx := context.Background()
	ps := newProcs(t)
	c, bin := startInstalledCluster(t, ps, apiserverBin, etcdBin)
	admin := c.adminClient(t)

	agentKubeconfig, agentCfg := c.kubeconfig(t, "apiary-agent")
	operatorKubeconfig, operatorCfg := c.kubeconfig(t, "apiary-operator")
	adminIDs := newIdentityClient(t, c.admin)

	// RBAC: an agent can read Identities but not write them.
	agentIDs := newIdentityClient(t, agentCfg)
	if _, err := agentIDs.List(ctx, metav1.ListOptions{}); err != nil {
		t.Fatalf("the agent's ServiceAccount cannot list Identities: %v", err)
	}
	_, err := agentIDs.Create(ctx, &v1alpha1.Identity{ObjectMeta: metav1.ObjectMeta{Name: "4000"}, SecurityLabels: []string{"k8s:app=rogue"}})
	if !k8serrors.IsForbidden(err) {
		t.Fatalf("creating an Identity as the agent: want Forbidden, got %v", err)
	}

	checkIdentitySchema(t, c.admin, operatorCfg)

	// Two agents, no operator yet.
	agents := map[string]*apiaryProc{}
	agentArgs := map[string][]string{}
	for _, node := range []string{"node-a", "node-b"} {
		agentArgs[node] = []string{"agent",
			"--kubeconfig=" + agentKubeconfig, "--node-name=" + node, "--identity-management-mode=operator",
			"--bpf-pin-dir=" + filepath.Join(pinRoot, node), "--state-dir=" + t.TempDir()}
		agents[node] = startApiary(t, ps, "agent "+node, bin, agentArgs[node]...)
	}

	// Pods: app=web on both nodes (one label set seen by two nodes; the
	// pod-template-hash differs and is not part of it), app=db on node-b.
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{"env": "dev"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods := []podSpec{
		{"shop", "web-a", "node-a", "10.0.1.1", map[string]string{"app": "web", "pod-template-hash": "aaa"}},
		{"shop", "web-b", "node-b", "10.0.2.1", map[string]string{"app": "web", "pod-template-hash": "bbb"}},
		{"shop", "db-b", "node-b", "10.0.2.2", map[string]string{"app": "db"}},
	}
	for _, p := range pods {
		createPod(t, admin, p)
	}
	onNode := func(node string) []string {
		var names []string
		for _, p := range pods {
			if p.node == node {
				names = append(names, p.ns+"/"+p.name)
			}
		}
		return names
	}

	// waitEndpoints waits until every pod of every node has an endpoint for
	// which ok holds.
	waitEndpoints := func(what string, ok func(node string, e tables.Endpoint) bool) map[string]map[string]tables.Endpoint {
		t.Helper()
		all := map[string]map[string]tables.Endpoint{}
		for node, a := range agents {
			testenv.Eventually(t, wait, node+": "+what, func() (bool, string) {
				eps, err := a.endpoints()
				if err != nil {
					return false, err.Error()
				}
				all[node] = eps
				for _, name := range onNode(node) {
					e, found := eps[name]
					if !found || !ok(node, e) {
						return false, showEndpoints(eps)
					}
				}
				return true, ""
			})
		}
		return all
	}

	// Without the operator: temporary identities at once, with the full
	// label set (namespace labels included), and no Identity anywhere.
	// (The pod IPs, set through the status subresource, reach the agents.)
	podIP := map[string]string{}
	for _, p := range pods {
		podIP[p.ns+"/"+p.name] = p.ip
	}
	start := time.Now()
	waitEndpoints("temporary identities", func(_ string, e tables.Endpoint) bool {
		return e.IdentitySource == "temporary" && isTemporary(e.Identity) && e.Error == "" &&
			e.Labels.Has("k8s:io.cilium.k8s.namespace.labels.env=dev") &&
			slices.ContainsFunc(e.IPs, func(a netip.Addr) bool { return a.String() == podIP[e.Name] })
	})
	t.Logf("temporary identities on both nodes %s after the pods were created", time.Since(start).Round(time.Millisecond))
	if ids := identities(t, adminIDs); len(ids) != 0 {
		t.Fatalf("Identities exist before the operator runs:\n%s", showIdentities(ids))
	}
	for _, a := range agents {
		waitHealthy(t, a)
		// No Cilium policy CRDs in deploy/: the policy kinds count as
		// empty, so these tables initialize (and get pruned).
		waitInitialized(t, a, tables.PrefixesTableName, tables.IPCacheTableName)
	}

	// The operator: one Identity per label set, though two nodes run web.
	operatorArgs := []string{"operator", "--kubeconfig=" + operatorKubeconfig,
		"--identity-gc-interval=500ms", "--identity-gc-grace-period=1s",
		"--leader-election-lease-duration=4s", "--leader-election-renew-deadline=3s", "--leader-election-retry-period=500ms"}
	start = time.Now()
	operator := startApiary(t, ps, "operator", bin, operatorArgs...)

	// checkCluster waits until every endpoint has a cluster identity whose
	// Identity holds exactly its labels, one Identity per label set, and no
	// other Identity; it returns the Identities.
	checkCluster := func(what string, wantLabel string) map[uint32]tables.Labels {
		t.Helper()
		var ids map[uint32]tables.Labels
		testenv.Eventually(t, wait, what+": one Identity per label set", func() (bool, string) {
			ids = identities(t, adminIDs)
			seen := map[string]uint32{}
			for n, l := range ids {
				if other, dup := seen[l.Key()]; dup {
					t.Fatalf("duplicate Identities %d and %d for %v", other, n, l)
				}
				seen[l.Key()] = n
				if !l.Has(wantLabel) {
					return false, showIdentities(ids)
				}
			}
			return len(ids) == 2, showIdentities(ids)
		})
		waitEndpoints(what+": cluster identities", func(_ string, e tables.Endpoint) bool {
			return e.IdentitySource == "cluster" && e.Error == "" && ids[e.Identity].Equal(e.Labels)
		})
		return ids
	}
	devIDs := checkCluster("operator started", "k8s:io.cilium.k8s.namespace.labels.env=dev")
	t.Logf("operator started: Identities %v on both nodes %s later", slices.Sorted(maps.Keys(devIDs)), time.Since(start).Round(time.Millisecond))
	for n, l := range devIDs {
		if n < identity.MinCluster || n > identity.MaxCluster || l.Has("k8s:pod-template-hash=aaa") || l.Has("k8s:pod-template-hash=bbb") {
			t.Errorf("Identity %d %v: number out of range or per-pod label kept", n, l)
		}
	}
	waitMetric(t, operator, "apiary_operator_identities_created_total", 2) // one per label set

	// A namespace relabel: new label sets, so new Identities, which both
	// nodes switch to; the old Identities are collected.
	ns, err := admin.CoreV1().Namespaces().Get(ctx, "shop", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ns.Labels["env"] = "prod"
	start = time.Now()
	if _, err := admin.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	prodIDs := checkCluster("namespace relabelled", "k8s:io.cilium.k8s.namespace.labels.env=prod")
	for n := range prodIDs {
		if _, ok := devIDs[n]; ok {
			t.Errorf("Identity %d was reused for a new label set", n)
		}
	}
	waitMetric(t, operator, "apiary_operator_identities_deleted_total", 2) // the old ones
	t.Logf("namespace relabelled: Identities %v on both nodes and the old ones collected %s later",
		slices.Sorted(maps.Keys(prodIDs)), time.Since(start).Round(time.Millisecond))
	before := waitEndpoints("endpoints", func(string, tables.Endpoint) bool { return true })

	// An operator restart: the new process takes the Lease (the old one
	// releases it on SIGTERM), lists everything and finds nothing to do —
	// no create, no delete, no other number on any node.
	operator.stop(t)
	operator = startApiary(t, ps, "operator (restarted)", bin, operatorArgs...)
	testenv.Eventually(t, wait, "the restarted operator to lead with 2 Identities", func() (bool, string) {
		h, err := operator.health()
		if err != nil {
			return false, err.Error()
		}
		for _, line := range h {
			if strings.Contains(line, "Leading: 2 Identities, 2 label sets in use") {
				return true, ""
			}
		}
		return false, strings.Join(h, "\n")
	})
	for _, m := range []string{"apiary_operator_identities_created_total", "apiary_operator_identities_deleted_total"} {
		if n, err := metric(operator.addr, m); err != nil || n != 0 {
			t.Errorf("restarted operator: %s = %v (%v), want 0", m, n, err)
		}
	}
	if ids := identities(t, adminIDs); !maps.EqualFunc(ids, prodIDs, tables.Labels.Equal) {
		t.Errorf("Identities changed across the operator restart:\n%s\nwant\n%s", showIdentities(ids), showIdentities(prodIDs))
	}
	sameEndpoints := func(what string) {
		t.Helper()
		after := waitEndpoints("endpoints", func(string, tables.Endpoint) bool { return true })
		for node := range before {
			for name, e := range before[node] {
				if a := after[node][name]; a.Identity != e.Identity || a.IdentitySource != e.IdentitySource {
					t.Errorf("%s %s: identity %d (%s) became %d (%s) across %s",
						node, name, e.Identity, e.IdentitySource, a.Identity, a.IdentitySource, what)
				}
			}
		}
	}
	sameEndpoints("the operator restart")

	// An agent restart (same pin and state directories): the endpoints come
	// back with their cluster numbers.
	agents["node-b"].stop(t)
	agents["node-b"] = startApiary(t, ps, "agent node-b (restarted)", bin, agentArgs["node-b"]...)
	waitEndpoints("cluster identities after the agent restart", func(_ string, e tables.Endpoint) bool {
		return e.IdentitySource == "cluster"
	})
	sameEndpoints("the agent restart")

	// The restarted operator still serves new label sets, numbering after
	// the highest in use.
	api := podSpec{"shop", "api-a", "node-a", "10.0.1.2", map[string]string{"app": "api"}}
	pods = append(pods, api)
	createPod(t, admin, api)
	var apiID uint32
	waitEndpoints("the new pod's cluster identity", func(node string, e tables.Endpoint) bool {
		if e.Name == "shop/api-a" {
			apiID = e.Identity
		}
		return e.IdentitySource == "cluster" && e.Error == ""
	})
	if hi := slices.Max(slices.Collect(maps.Keys(prodIDs))); apiID <= hi {
		t.Errorf("new Identity %d is not numbered after the highest in use, %d", apiID, hi)
	}
	if ids := identities(t, adminIDs); len(ids) != 3 {
		t.Errorf("want 3 Identities, have\n%s", showIdentities(ids))
	}
}
