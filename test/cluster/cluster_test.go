//go:build cluster

package cluster

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/apiary-net/apiary/internal/testenv"
)

const ns = "apiary-test"

// agentAPI is the agent's HTTP API on the node (deploy/'s --api-addr).
const agentAPI = "http://127.0.0.1:9234"

// TestCluster brings the node up, installs apiary from deploy/ and checks
// what a user of the cluster would notice, in order: each step builds on
// the state the one before left.
func TestCluster(t *testing.T) {
	start := time.Now()
	n := startNode(t)
	t.Logf("cluster up in %s", time.Since(start).Round(time.Millisecond))
	n.pinDir = "/sys/fs/bpf/apiary-cluster-" + strings.ToLower(rand.Text()[:8])
	start = time.Now()
	n.install(agentDirs{pinDir: n.pinDir, stateDir: filepath.Join(n.dir, "agent-state")})
	n.waitAgentReady()
	n.waitAgentHealthy()
	t.Logf("apiary installed and healthy in %s", time.Since(start).Round(time.Millisecond))
	n.waitCNIChained()

	w := n.startWorkloads()
	steps := []struct {
		name string
		run  func(t *testing.T, n *node, w *workloads)
	}{
		{"ServicesFromPods", testServices},
		{"KubeProxyHealth", testKubeProxyHealth},
		{"EgressPolicy", testEgressPolicy},
		{"IngressPolicyKeepsProbes", testIngressPolicy},
		{"FirstConnection", testFirstConnection},
		{"Monitor", testMonitor},
		{"Hubble", testHubble},
		{"DNSThroughClusterService", testDNS},
		{"RemoteNodeFromNodeObject", testRemoteNode},
		{"AgentRestart", testAgentRestart},
		{"OperatorMode", testOperatorMode},
		{"Uninstall", testUninstall},
	}
	for _, s := range steps {
		start := time.Now()
		ok := t.Run(s.name, func(t *testing.T) { s.run(t, n, w) })
		t.Logf("%s: %s", s.name, time.Since(start).Round(time.Millisecond))
		if !ok {
			return
		}
	}
}

// testKubeProxyHealth: the agent answers kube-proxy's health endpoint on
// :10256 (deploy/'s config map), and the healthCheckNodePort the API
// server gives a LoadBalancer Service with externalTrafficPolicy Local,
// with the count of the Service's two server pods on this node.
func testKubeProxyHealth(t *testing.T, n *node, w *workloads) {
	ctx := context.Background()
	testenv.Eventually(t, waitTimeout, "kube-proxy's /healthz on :10256", func() (bool, string) {
		code, body, err := httpGet("http://127.0.0.1:10256/healthz")
		if err != nil {
			return false, err.Error()
		}
		return code == http.StatusOK && strings.Contains(body, `"lastUpdated"`), fmt.Sprintf("%d %s", code, body)
	})
	svc, err := n.cs.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "edge", Namespace: ns},
		Spec: corev1.ServiceSpec{
			Type:                  corev1.ServiceTypeLoadBalancer,
			ExternalTrafficPolicy: corev1.ServiceExternalTrafficPolicyLocal,
			Selector:              map[string]string{"app": "server"},
			Ports:                 []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer n.cs.CoreV1().Services(ns).Delete(ctx, "edge", metav1.DeleteOptions{})
	if svc.Spec.HealthCheckNodePort == 0 {
		t.Fatal("the API server gave no healthCheckNodePort")
	}
	url := fmt.Sprintf("http://%s:%d/", nodeIP, svc.Spec.HealthCheckNodePort)
	testenv.Eventually(t, waitTimeout, "the health check node port "+url, func() (bool, string) {
		code, body, err := httpGet(url)
		if err != nil {
			return false, err.Error()
		}
		var got struct {
			LocalEndpoints int `json:"localEndpoints"`
		}
		json.Unmarshal([]byte(body), &got)
		return code == http.StatusOK && got.LocalEndpoints == 2, fmt.Sprintf("%d %s", code, body)
	})
}

// waitAgentHealthy waits until the agent answers /healthz with 200.
func (n *node) waitAgentHealthy() {
	testenv.Eventually(n.t, waitTimeout, "the agent's /healthz", func() (bool, string) {
		code, body, err := httpGet(agentAPI + "/healthz")
		if err != nil {
			return false, err.Error()
		}
		return code == http.StatusOK, body
	})
}

func httpGet(url string) (int, string, error) {
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), err
}

// workloads are the test's pods: two servers behind a Service, a client,
// and another pod.
type workloads struct {
	clusterIP string
	nodePort  int32
	client    *corev1.Pod
	other     *corev1.Pod
}

// testPod is a pod of the test image with labels, ready when its HTTP
// server answers the kubelet's probe.
func testPod(name string, labels map[string]string, env ...corev1.EnvVar) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels},
		Spec:       podSpec(env...),
	}
}

func podSpec(env ...corev1.EnvVar) corev1.PodSpec {
	return corev1.PodSpec{
		DNSPolicy:                     corev1.DNSDefault,
		EnableServiceLinks:            ptr.To(false),
		TerminationGracePeriodSeconds: ptr.To[int64](1),
		Containers: []corev1.Container{{
			Name: "main", Image: testpodImage, ImagePullPolicy: corev1.PullNever,
			Env:   env,
			Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}},
			ReadinessProbe: &corev1.Probe{
				ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromInt32(8080)}},
				PeriodSeconds: 1,
			},
		}},
	}
}

func (n *node) startWorkloads() *workloads {
	t := n.t
	ctx := context.Background()
	if _, err := n.cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitTimeout, "ServiceAccount "+ns+"/default", func() (bool, string) {
		_, err := n.cs.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, fmt.Sprint(err)
	})
	server := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "server", Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](2),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "server"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "server"}},
				Spec:       podSpec(),
			},
		},
	}
	if _, err := n.cs.AppsV1().Deployments(ns).Create(ctx, server, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	svc, err := n.cs.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "server", Namespace: ns},
		Spec: corev1.ServiceSpec{
			Type:     corev1.ServiceTypeNodePort,
			Selector: map[string]string{"app": "server"},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	w := &workloads{clusterIP: svc.Spec.ClusterIP, nodePort: svc.Spec.Ports[0].NodePort}
	w.client = n.runPod(testPod("client", map[string]string{"app": "client"}))
	w.other = n.runPod(testPod("other", map[string]string{"app": "other"}))
	n.waitServers(2)
	return w
}

// runPod creates pod and waits until it is Ready; it returns the pod as
// it is then (with its IP).
func (n *node) runPod(pod *corev1.Pod) *corev1.Pod {
	n.t.Helper()
	ctx := context.Background()
	if _, err := n.cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		n.t.Fatal(err)
	}
	var got *corev1.Pod
	testenv.Eventually(n.t, waitTimeout, "pod "+pod.Name+" Ready", func() (bool, string) {
		p, err := n.cs.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		got = p
		return podReady(p) && p.Status.PodIP != "", fmt.Sprintf("%s %+v", p.Status.Phase, p.Status.Conditions)
	})
	return got
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// servers returns the server pods.
func (n *node) servers() []corev1.Pod {
	pods, err := n.cs.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{LabelSelector: "app=server"})
	if err != nil {
		n.t.Fatal(err)
	}
	return pods.Items
}

// waitServers waits until want server pods are Ready and the Service's
// EndpointSlice lists them all as ready.
func (n *node) waitServers(want int) {
	testenv.Eventually(n.t, waitTimeout, fmt.Sprintf("%d ready server endpoints", want), func() (bool, string) {
		ready := 0
		for _, p := range n.servers() {
			if podReady(&p) && p.DeletionTimestamp == nil {
				ready++
			}
		}
		slices, err := n.cs.DiscoveryV1().EndpointSlices(ns).List(context.Background(), metav1.ListOptions{LabelSelector: "kubernetes.io/service-name=server"})
		if err != nil {
			return false, err.Error()
		}
		inSlice := 0
		for _, s := range slices.Items {
			for _, e := range s.Endpoints {
				if e.Conditions.Ready != nil && *e.Conditions.Ready {
					inSlice++
				}
			}
		}
		return ready == want && inSlice == want, fmt.Sprintf("%d ready pods, %d ready endpoints", ready, inSlice)
	})
}

// connect has pod make a connection to addr (an HTTP request, from its
// own cgroup and network namespace) and returns the outcome: "ok: <the
// answer>", "EPERM", "timeout" or an error.
func connect(t *testing.T, pod *corev1.Pod, addr string) string {
	t.Helper()
	code, body, err := httpGet(fmt.Sprintf("http://%s:8080/connect?addr=%s", pod.Status.PodIP, addr))
	if err != nil {
		return "ask the pod: " + err.Error()
	}
	if code != http.StatusOK {
		return fmt.Sprintf("ask the pod: %d %s", code, body)
	}
	return body
}

// wantConnect waits until pod's connections to addr come out as want
// (the agent applies what the API server says within moments).
func wantConnect(t *testing.T, pod *corev1.Pod, addr, want string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, fmt.Sprintf("%s to %s: %s", pod.Name, addr, want), func() (bool, string) {
		got := connect(t, pod, addr)
		return strings.HasPrefix(got, want), got
	})
}

// testServices: a pod reaches both backends of a Service through its
// ClusterIP and through the node's NodePort; no kube-proxy runs, so it is
// the agent's socket LB that does it.
func testServices(t *testing.T, n *node, w *workloads) {
	for _, addr := range []string{
		fmt.Sprintf("%s:80", w.clusterIP),
		fmt.Sprintf("%s:%d", nodeIP, w.nodePort),
	} {
		seen := map[string]bool{}
		testenv.Eventually(t, waitTimeout, "both servers through "+addr, func() (bool, string) {
			got := connect(t, w.client, addr)
			if from, ok := strings.CutPrefix(got, "ok: hello from "); ok {
				seen[from] = true
			}
			return len(seen) == 2, fmt.Sprintf("last %q, seen %v", got, seen)
		})
	}
}

// lookup asks pod to resolve name with its own resolver (see testpod).
func lookup(t *testing.T, pod *corev1.Pod, name string) string {
	t.Helper()
	code, body, err := httpGet(fmt.Sprintf("http://%s:8080/lookup?name=%s", pod.Status.PodIP, name))
	if err != nil {
		return "ask the pod: " + err.Error()
	}
	if code != http.StatusOK {
		return fmt.Sprintf("ask the pod: %d %s", code, body)
	}
	return body
}

// testDNS: a pod whose resolv.conf names the cluster DNS Service (what
// dnsPolicy ClusterFirst writes; set here through dnsConfig, as the test's
// kubelet has no clusterDNS) resolves through it, to a DNS server pod,
// unchanged. Once a policy with a DNS rule selects it, its queries go to
// the agent's DNS proxy (on the node's address, as deploy/ sets it)
// without the pod knowing: a name the rule allows still resolves, another
// is refused.
func testDNS(t *testing.T, n *node, w *workloads) {
	ctx := context.Background()
	n.runPod(testPod("dns", map[string]string{"app": "dns"}, corev1.EnvVar{Name: "DNS_SERVER", Value: "1"}))
	svc, err := n.cs.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "cluster-dns", Namespace: ns},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "dns"},
			Ports: []corev1.ServicePort{
				{Name: "dns", Port: 53, TargetPort: intstr.FromInt32(53), Protocol: corev1.ProtocolUDP},
				{Name: "dns-tcp", Port: 53, TargetPort: intstr.FromInt32(53), Protocol: corev1.ProtocolTCP},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod := testPod("dnsclient", map[string]string{"app": "dnsclient"})
	pod.Spec.DNSPolicy = corev1.DNSNone
	pod.Spec.DNSConfig = &corev1.PodDNSConfig{Nameservers: []string{svc.Spec.ClusterIP}, Searches: []string{}}
	client := n.runPod(pod)
	wantLookup := func(name, want string) {
		t.Helper()
		testenv.Eventually(t, waitTimeout, fmt.Sprintf("%s resolves %s: %s", client.Name, name, want), func() (bool, string) {
			got := lookup(t, client, name)
			return strings.HasPrefix(got, want), got
		})
	}
	wantLookup("www.allowed.test", "ok: 192.0.2.10")
	wantLookup("www.denied.test", "ok: 192.0.2.20")

	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: dnsclient, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: dnsclient}}
  egress:
  - toEndpoints: [{matchLabels: {app: dns}}]
    toPorts:
    - ports: [{port: "53", protocol: ANY}]
      rules: {dns: [{matchPattern: "*.allowed.test"}]}
`)
	// Refused by the proxy (Go says "server misbehaving" for REFUSED),
	// as from the Service's address: not EPERM, which would mean the
	// pod's DNS could not be intercepted.
	wantLookup("www.denied.test", "error: lookup www.denied.test on "+svc.Spec.ClusterIP+":53: server misbehaving")
	wantLookup("www.allowed.test", "ok: 192.0.2.10")
}

// createPolicy creates a CiliumNetworkPolicy from YAML through the CRD in
// deploy/cilium-crds.
func (n *node) createPolicy(t *testing.T, doc string) {
	t.Helper()
	u := n.readManifestString(doc)
	n.create(u)
}

// testEgressPolicy: a CNP limits the client's egress to the servers: the
// client reaches a server pod and the Service, and gets EPERM connecting
// to the other pod, which the other pod itself still reaches.
func testEgressPolicy(t *testing.T, n *node, w *workloads) {
	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: client-egress, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toEndpoints: [{matchLabels: {app: server}}]
`)
	other := w.other.Status.PodIP + ":8080"
	wantConnect(t, w.client, other, "EPERM")
	server := n.servers()[0].Status.PodIP + ":8080"
	if got := connect(t, w.client, server); !strings.HasPrefix(got, "ok: hello from server-") {
		t.Errorf("client to a server pod: %s", got)
	}
	if got := connect(t, w.client, w.clusterIP+":80"); !strings.HasPrefix(got, "ok: hello from server-") {
		t.Errorf("client to the Service: %s", got)
	}
	if got := connect(t, w.other, server); !strings.HasPrefix(got, "ok: hello from server-") {
		t.Errorf("other (no policy) to a server pod: %s", got)
	}
}

// testIngressPolicy: a CNP lets only the client into the servers. The
// other pod is kept out, and the kubelet's readiness probes, from the
// node, still pass: a server pod replaced under the policy becomes Ready
// and the Service keeps both backends.
func testIngressPolicy(t *testing.T, n *node, w *workloads) {
	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: server-ingress, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: server}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
`)
	server := n.servers()[0]
	addr := server.Status.PodIP + ":8080"
	testenv.Eventually(t, waitTimeout, "other kept out of a server", func() (bool, string) {
		got := connect(t, w.other, addr)
		return !strings.HasPrefix(got, "ok"), got
	})
	if got := connect(t, w.client, addr); !strings.HasPrefix(got, "ok: hello from server-") {
		t.Errorf("client to a server pod under the ingress policy: %s", got)
	}
	if err := n.cs.CoreV1().Pods(ns).Delete(context.Background(), server.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitTimeout, "the replaced server gone", func() (bool, string) {
		for _, p := range n.servers() {
			if p.Name == server.Name {
				return false, "still there"
			}
		}
		return true, ""
	})
	n.waitServers(2)
	for _, p := range n.servers() {
		if p.Name != server.Name {
			wantConnect(t, w.client, p.Status.PodIP+":8080", "ok: hello from "+p.Name)
		}
	}
}

// testFirstConnection: a new pod selected by the egress policy is
// enforced from its first connection, made as soon as its program runs.
func testFirstConnection(t *testing.T, n *node, w *workloads) {
	other := w.other.Status.PodIP + ":8080"
	p := n.runPod(testPod("client-2", map[string]string{"app": "client"}, corev1.EnvVar{Name: "FIRST_CONNECT", Value: other}))
	code, body, err := httpGet(fmt.Sprintf("http://%s:8080/first", p.Status.PodIP))
	if err != nil || code != http.StatusOK {
		t.Fatalf("ask client-2: %d %v", code, err)
	}
	if body != "EPERM" {
		t.Errorf("client-2's first connection to %s: %s, want EPERM", other, body)
	}
	if got := connect(t, p, other); got != "EPERM" {
		t.Errorf("client-2's next connection to %s: %s, want EPERM", other, got)
	}
}

// testMonitor: `apiary monitor` on the node shows the client's denied
// connection as it happens.
func testMonitor(t *testing.T, n *node, w *workloads) {
	cmd := exec.Command(n.apiaryBin, "monitor", "--server", agentAPI, "--verdict", "denied", "--endpoint", ns+"/client", "-o", "json")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()
	lines := make(chan string, 100)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	other := w.other.Status.PodIP
	deadline := time.After(waitTimeout)
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	var seen []string
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("apiary monitor ended; it printed:\n%s", strings.Join(seen, "\n"))
			}
			seen = append(seen, l)
			if strings.Contains(l, other) && strings.Contains(l, "denied") {
				t.Logf("apiary monitor: %s", l)
				return
			}
		case <-tick.C:
			connect(t, w.client, other+":8080")
		case <-deadline:
			t.Fatalf("no denied verdict for %s in apiary monitor; it printed:\n%s", other, strings.Join(seen, "\n"))
		}
	}
}

// metric returns the value of a metric of the agent.
func metric(t *testing.T, name string) (float64, bool) {
	_, body, err := httpGet(agentAPI + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(l, name+" "); ok {
			var f float64
			fmt.Sscan(v, &f)
			return f, true
		}
	}
	return 0, false
}

// testAgentRestart: a rollout of the agent's DaemonSet (a new pod
// replacing the old one) keeps enforcing throughout, the new agent is not
// denied by the pinned programs as an unclassified pod, and, finding
// everything in place, writes nothing to the policy maps but its own pod's
// entries and the policy sets.
func testAgentRestart(t *testing.T, n *node, w *workloads) {
	ctx := context.Background()
	before := n.waitAgentReady()
	patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"apiary.test/restartedAt":%q}}}}}`, time.Now().Format(time.RFC3339Nano))
	if _, err := n.cs.AppsV1().DaemonSets("kube-system").Patch(ctx, "apiary-agent", types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	other := w.other.Status.PodIP + ":8080"
	checks := 0
	testenv.Eventually(t, 2*waitTimeout, "a new agent pod Ready", func() (bool, string) {
		if got := connect(t, w.client, other); got != "EPERM" {
			t.Fatalf("during the rollout, client to other: %s, want EPERM", got)
		}
		checks++
		pods, err := n.cs.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=apiary-agent"})
		if err != nil {
			return false, err.Error()
		}
		for _, p := range pods.Items {
			if p.Name != before && podReady(&p) {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%d agent pods", len(pods.Items))
	})
	n.waitAgentHealthy()
	t.Logf("client to other was EPERM in each of %d checks during the rollout", checks)
	wantConnect(t, w.client, other, "EPERM")
	// The workloads' entries are left as they were: the only writes are
	// the agent's own pod's, which the rollout replaced: its new container
	// (written at start) and its new pod (a host-network endpoint) in
	// policy_endpoints, and the old pod's and old container's entries
	// deleted; the policy sets, which a restart makes anew under new
	// numbers (docs/policy.md, Shared policy sets): their entries and each
	// endpoint's reference to them, the old ones left to the prune; and
	// the interface mark of each endpoint whose pod interface is enforced,
	// cleared when the map is opened and set again once this run has
	// reconciled the interface (so that a ClusterNetworkPolicy Deny is
	// never let through for an interface no longer there to drop it).
	sets, ifaces := restartRewrites(t)
	for _, c := range []struct {
		metric string
		want   float64
	}{{"apiary_policy_map_updates_total", float64(2 + sets + 2*ifaces)}, {"apiary_policy_map_deletes_total", 2}} {
		if v, ok := metric(t, c.metric); !ok || v != c.want {
			t.Errorf("%s after the restart = %v (present %v), want %v (the agent pod's own 2 entries, %d of policy sets and references to them, %d endpoints' interface marks cleared and set)",
				c.metric, v, ok, c.want, sets, ifaces)
		}
	}
}

// restartRewrites returns how many rows of the agent's policy-entries
// table are a policy set's entries or an endpoint's reference to its set,
// and how many endpoint-policy rows mark the pod's interface enforced.
func restartRewrites(t *testing.T) (sets, ifaces int) {
	t.Helper()
	dump := func(table string, rows any) {
		code, body, err := httpGet(agentAPI + "/statedb/dump/" + table)
		if err != nil || code != http.StatusOK {
			t.Fatalf("GET /statedb/dump/%s: %d %v %s", table, code, err, body)
		}
		if err := json.Unmarshal([]byte(body), rows); err != nil {
			t.Fatalf("GET /statedb/dump/%s: %v", table, err)
		}
	}
	var entries map[string][]struct {
		Endpoint string `json:"endpoint"`
		Identity uint32 `json:"identity"`
	}
	dump("policy-entries", &entries)
	for _, e := range entries["policy-entries"] {
		if strings.HasPrefix(e.Endpoint, "policy-set:") || e.Identity == 0xffffffff {
			sets++
		}
	}
	var eps map[string][]struct {
		PodIface bool `json:"podIface"`
	}
	dump("endpoint-policy", &eps)
	for _, e := range eps["endpoint-policy"] {
		if e.PodIface {
			ifaces++
		}
	}
	return sets, ifaces
}

// testUninstall: deleting the DaemonSet leaves enforcement in place (by
// design), a pod created then is denied (unclassified); `apiary cleanup`
// on the node then detaches everything: nothing
// is attached to the cgroup root or to the pods' interfaces, the pins are
// gone and the client reaches the other pod.
func testUninstall(t *testing.T, n *node, w *workloads) {
	ctx := context.Background()
	if err := n.cs.AppsV1().DaemonSets("kube-system").Delete(ctx, "apiary-agent", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitTimeout, "the agent's pod gone", func() (bool, string) {
		pods, err := n.cs.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=apiary-agent"})
		return err == nil && len(pods.Items) == 0, fmt.Sprint(err, pods)
	})
	other := w.other.Status.PodIP + ":8080"
	if got := connect(t, w.client, other); got != "EPERM" {
		t.Errorf("with the agent gone, client to other: %s, want EPERM (enforcement holds)", got)
	}
	// A pod created while no agent runs is no endpoint: the pinned
	// programs deny it both ways (fail closed), from its first connection.
	covered := len(podInterfacePrograms(t))
	late := testPod("late", map[string]string{"app": "late"}, corev1.EnvVar{Name: "FIRST_CONNECT", Value: other})
	if _, err := n.cs.CoreV1().Pods(ns).Create(ctx, late, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitTimeout, "pod late's first connection made", func() (bool, string) {
		log := n.podLog(ns, "late", "main")
		return strings.Contains(log, "first connection to"), log
	})
	if log := n.podLog(ns, "late", "main"); !strings.Contains(log, "first connection to "+other+": EPERM") {
		t.Errorf("pod late, created with the agent gone: %s; want its first connection denied", log)
	}
	if on := podInterfacePrograms(t); len(on) == 0 {
		t.Errorf("with the agent gone, no program on the pods' interfaces; want the agent's, kept")
	} else if len(on) != covered+1 {
		// apiary-cni, chained after the bridge plugin, put the agent's
		// pinned programs on late's veth as it was made.
		t.Errorf("with the agent gone, %d pod interfaces have programs after pod late was made, want %d (late's by apiary-cni): %v", len(on), covered+1, on)
	}
	out, err := exec.Command(n.apiaryBin, "cleanup", "--bpf-pin-dir", n.pinDir).CombinedOutput()
	if err != nil {
		t.Fatalf("apiary cleanup: %v\n%s", err, out)
	}
	t.Logf("apiary cleanup:\n%s", out)
	root, err := testenv.Cgroup2Mount()
	if err != nil {
		t.Fatal(err)
	}
	if left := testenv.CgroupPrograms(t, root); len(left) != 0 {
		t.Errorf("programs still attached to %s: %v", root, left)
	}
	if left := podInterfacePrograms(t); len(left) != 0 {
		t.Errorf("programs still on the pods' interfaces: %v", left)
	}
	if _, err := os.Stat(n.pinDir); !os.IsNotExist(err) {
		t.Errorf("%s after cleanup: %v, want it gone", n.pinDir, err)
	}
	// The chain outlived the agent (it covered pod late); without the
	// pins it would fail every new pod's ADD: the uninstall takes it out.
	if got, err := n.cniPlugins(); err != nil || fmt.Sprint(got) != fmt.Sprint([]string{"bridge", "apiary-cni@" + n.pinDir}) {
		t.Errorf("with the agent gone, the node's CNI plugins: %v %v; want apiary-cni still chained", got, err)
	}
	out, err = exec.Command(n.apiaryBin, "cni", "uninstall", "--cni-conf-dir", n.cniConfDir()).CombinedOutput()
	if err != nil {
		t.Fatalf("apiary cni uninstall: %v\n%s", err, out)
	}
	t.Logf("apiary cni uninstall:\n%s", out)
	if got, err := n.cniPlugins(); err != nil || fmt.Sprint(got) != fmt.Sprint([]string{"bridge"}) {
		t.Errorf("after apiary cni uninstall, the node's CNI plugins: %v %v; want the bridge alone", got, err)
	}
	wantConnect(t, w.client, other, "ok: hello from other")
	p, err := n.cs.CoreV1().Pods(ns).Get(ctx, "late", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	wantConnect(t, p, other, "ok: hello from other")
}

// podInterfacePrograms returns, per interface on the pods' bridge (the
// host sides of their veths), the tcx and tc programs attached to it.
func podInterfacePrograms(t *testing.T) map[string]int {
	t.Helper()
	br, err := netlink.LinkByName(bridgeName)
	if err != nil {
		t.Fatal(err)
	}
	links, err := netlink.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for _, l := range links {
		if l.Attrs().MasterIndex != br.Attrs().Index {
			continue
		}
		name := l.Attrs().Name
		for _, hook := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: hook})
			if err != nil {
				t.Fatalf("query %s of %s: %v", hook, name, err)
			}
			got[name] += len(res.Programs)
		}
		for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			filters, _ := netlink.FilterList(l, parent)
			got[name] += len(filters)
		}
		if got[name] == 0 {
			delete(got, name)
		}
	}
	return got
}

// endpointRow is what the test reads of an endpoints row.
type endpointRow struct {
	Name           string
	Identity       uint32
	IdentitySource string
}

// endpoints returns the agent's endpoints table by name.
func endpoints(t *testing.T) map[string]endpointRow {
	t.Helper()
	code, body, err := httpGet(agentAPI + "/statedb/dump/endpoints")
	if err != nil || code != http.StatusOK {
		t.Fatalf("GET /statedb/dump/endpoints: %d %v %s", code, err, body)
	}
	var all map[string][]endpointRow
	if err := json.Unmarshal([]byte(body), &all); err != nil {
		t.Fatalf("GET /statedb/dump/endpoints: %v: %s", err, body)
	}
	out := map[string]endpointRow{}
	for _, r := range all["endpoints"] {
		out[r.Name] = r
	}
	return out
}

// testOperatorMode: with identity-management-mode switched to operator
// in the config map and the agents restarted (docs/kubernetes.md,
// "Migrating"), the pods' identities are the operator's Identities, made
// by the operator's Deployment from deploy/, and policy holds.
func testOperatorMode(t *testing.T, n *node, w *workloads) {
	ctx := context.Background()
	testenv.Eventually(t, waitTimeout, "an operator replica Ready", func() (bool, string) {
		pods, err := n.cs.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=apiary-operator"})
		if err != nil {
			return false, err.Error()
		}
		for _, p := range pods.Items {
			if podReady(&p) {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%d operator pods, none Ready", len(pods.Items))
	})
	patch := `{"data":{"identity-management-mode":"operator"}}`
	if _, err := n.cs.CoreV1().ConfigMaps("kube-system").Patch(ctx, "apiary-config", types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	before := n.waitAgentReady()
	patch = fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"apiary.test/mode":%q}}}}}`, "operator")
	if _, err := n.cs.AppsV1().DaemonSets("kube-system").Patch(ctx, "apiary-agent", types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 2*waitTimeout, "a new agent pod Ready", func() (bool, string) {
		pods, err := n.cs.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=apiary-agent"})
		if err != nil {
			return false, err.Error()
		}
		for _, p := range pods.Items {
			if p.Name != before && podReady(&p) {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%d agent pods", len(pods.Items))
	})
	n.waitAgentHealthy()
	testenv.Eventually(t, waitTimeout, "the test pods' identities from the operator's Identities", func() (bool, string) {
		eps := endpoints(t)
		for _, name := range []string{ns + "/client", ns + "/other"} {
			if e := eps[name]; e.IdentitySource != "cluster" || e.Identity == 0 {
				return false, fmt.Sprintf("%s: %+v", name, e)
			}
		}
		return true, ""
	})
	wantConnect(t, w.client, w.other.Status.PodIP+":8080", "EPERM")
	wantConnect(t, w.client, w.clusterIP+":80", "ok: hello from server-")
}
