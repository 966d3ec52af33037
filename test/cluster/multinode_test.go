//go:build cluster

package cluster

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/apiary-net/apiary/internal/testenv"
)

// mnPods are the multi-node test's pods: a server, a client and another
// pod on every node.
type mnPods struct {
	server, client, other []*corev1.Pod
	clusterIP             string
	// netns is the network namespace of each node by name: the test asks
	// a pod from its own node, as the kubelet's probes reach it (the
	// control plane's host is the world to the nodes' agents).
	netns map[string]string
	// workers are the nodes, in order.
	workers []*workerNode
}

// ask asks pod for path (see testpod) from the pod's node.
func (p *mnPods) ask(t *testing.T, pod *corev1.Pod, path string) string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "exec", p.netns[pod.Spec.NodeName],
		"curl", "-sS", "-m", "8", fmt.Sprintf("http://%s:8080%s", pod.Status.PodIP, path)).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("ask the pod: %v: %s", err, out)
	}
	return string(out)
}

// connect has pod connect to addr, asked from its node (see connect).
func (p *mnPods) connect(t *testing.T, pod *corev1.Pod, addr string) string {
	t.Helper()
	return p.ask(t, pod, "/connect?addr="+addr)
}

// wantConnect waits until pod's connections to addr come out as want.
func (p *mnPods) wantConnect(t *testing.T, pod *corev1.Pod, addr, want string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, fmt.Sprintf("%s to %s: %s", pod.Name, addr, want), func() (bool, string) {
		got := p.connect(t, pod, addr)
		return strings.HasPrefix(got, want), got
	})
}

// TestMultiNode brings up APIARY_NODES nodes (2 by default) in namespaces
// of this machine, installs apiary from deploy/ unchanged, and checks
// with pods on every node that connections between nodes are judged by
// the remote pod's identity on both sides.
func TestMultiNode(t *testing.T) {
	count := nodeCount(t)
	start := time.Now()
	n, workers := startMultiNode(t, count)
	t.Logf("%d nodes up in %s", count, time.Since(start).Round(time.Millisecond))
	start = time.Now()
	pinDir := "/sys/fs/bpf/apiary"
	n.install(agentDirs{pinDir: pinDir, stateDir: workers[0].stateDir})
	n.waitAgentsReady(count)
	t.Logf("apiary Ready on %d nodes in %s", count, time.Since(start).Round(time.Millisecond))
	for _, w := range workers {
		w.waitChained(pinDir)
	}
	p := n.startMultiNodePods(workers)
	steps := []struct {
		name string
		run  func(t *testing.T, n *node, p *mnPods)
	}{
		{"PodToPodAcrossNodes", testAcrossNodes},
		{"ServiceWithABackendPerNode", testServiceAcrossNodes},
		{"ServiceFromEachNodesHost", testServiceFromHosts},
		{"NodePortFromOtherNodes", testNodePortFromOtherNodes},
		{"IngressCNPByRemoteIdentity", testIngressAcrossNodes},
		{"EgressNetworkPolicyAcrossNodes", testEgressNetpolAcrossNodes},
		{"HubbleNamesPodsOfOtherNodes", testHubbleAcrossNodes},
		{"IngressNetworkPolicyNamedPort", testIngressNetpolAcrossNodes},
		{"EgressCNPAcrossNodes", testEgressCNPAcrossNodes},
		{"RemoteNodeEntity", testRemoteNodeEntity},
		{"EntitiesFromEachSide", testEntitiesAcrossNodes},
		{"DNSAcrossNodes", testDNSAcrossNodes},
	}
	for _, s := range steps {
		start := time.Now()
		ok := t.Run(s.name, func(t *testing.T) { s.run(t, n, p) })
		t.Logf("%s: %s", s.name, time.Since(start).Round(time.Millisecond))
		if !ok {
			return
		}
	}
}

// waitAgentsReady waits until the agent DaemonSet has a Ready pod on
// each of count nodes.
func (n *node) waitAgentsReady(count int) {
	testenv.Eventually(n.t, 3*waitTimeout, fmt.Sprintf("the apiary-agent DaemonSet ready on %d nodes", count), func() (bool, string) {
		ds, err := n.cs.AppsV1().DaemonSets("kube-system").Get(context.Background(), "apiary-agent", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		st := ds.Status
		c := int32(count)
		return st.ObservedGeneration == ds.Generation && st.DesiredNumberScheduled == c && st.NumberReady == c && st.UpdatedNumberScheduled == c,
			fmt.Sprintf("%+v", st)
	})
}

func (n *node) startMultiNodePods(workers []*workerNode) *mnPods {
	t := n.t
	ctx := context.Background()
	if _, err := n.cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitTimeout, "ServiceAccount "+ns+"/default", func() (bool, string) {
		_, err := n.cs.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, fmt.Sprint(err)
	})
	svc, err := n.cs.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "server", Namespace: ns},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "server"},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p := &mnPods{clusterIP: svc.Spec.ClusterIP, netns: map[string]string{}, workers: workers}
	for _, w := range workers {
		p.netns[w.name] = w.netns
	}
	for i, w := range workers {
		on := func(name, app string) *corev1.Pod {
			pod := testPod(fmt.Sprintf("%s-%d", name, i+1), map[string]string{"app": app})
			pod.Spec.NodeName = w.name
			return pod
		}
		p.server = append(p.server, n.runPod(on("server", "server")))
		p.client = append(p.client, n.runPod(on("client", "client")))
		p.other = append(p.other, n.runPod(on("other", "other")))
	}
	for _, pods := range [][]*corev1.Pod{p.server, p.client, p.other} {
		for _, pod := range pods {
			t.Logf("pod %s on %s: %s", pod.Name, pod.Spec.NodeName, pod.Status.PodIP)
		}
	}
	return p
}

// across calls fn for every ordered pair of different nodes (i, j).
func across(n int, fn func(i, j int)) {
	for i := range n {
		for j := range n {
			if i != j {
				fn(i, j)
			}
		}
	}
}

// testAcrossNodes: without policy, every client reaches the server of
// every other node (the node network, the routes between pod CIDRs).
func testAcrossNodes(t *testing.T, n *node, p *mnPods) {
	across(len(p.server), func(i, j int) {
		p.wantConnect(t, p.client[i], p.server[j].Status.PodIP+":8080", "ok: hello from "+p.server[j].Name)
	})
}

// testServiceAcrossNodes: a client on each node reaches the backends on
// every node through the ClusterIP (the socket LB picks a remote pod).
func testServiceAcrossNodes(t *testing.T, n *node, p *mnPods) {
	for _, c := range p.client {
		seen := map[string]bool{}
		testenv.Eventually(t, waitTimeout, c.Name+" to every server through "+p.clusterIP, func() (bool, string) {
			got := p.connect(t, c, p.clusterIP+":80")
			if from, ok := strings.CutPrefix(got, "ok: hello from "); ok {
				seen[from] = true
			}
			return len(seen) == len(p.server), fmt.Sprintf("last %q, seen %v", got, seen)
		})
	}
}

// testIngressAcrossNodes: a CNP lets only clients into the servers; the
// receiving node judges the sender, a pod of another node, by the
// identity its address has there: clients get in, the other pods do not.
func testIngressAcrossNodes(t *testing.T, n *node, p *mnPods) {
	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: server-ingress, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: server}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`)
	across(len(p.server), func(i, j int) {
		addr := p.server[j].Status.PodIP + ":8080"
		testenv.Eventually(t, waitTimeout, fmt.Sprintf("%s kept out of %s", p.other[i].Name, p.server[j].Name), func() (bool, string) {
			got := p.connect(t, p.other[i], addr)
			return !strings.HasPrefix(got, "ok"), got
		})
		if got := p.connect(t, p.client[i], addr); !strings.HasPrefix(got, "ok: hello from "+p.server[j].Name) {
			t.Errorf("%s to %s under the ingress policy: %s", p.client[i].Name, p.server[j].Name, got)
		}
	})
}

// testEgressNetpolAcrossNodes: a NetworkPolicy limits the other pods'
// egress to the clients: the sender's node denies a server of another
// node (EPERM) and lets a client of another node in.
func testEgressNetpolAcrossNodes(t *testing.T, n *node, p *mnPods) {
	n.createPolicy(t, `apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: other-egress, namespace: `+ns+`}
spec:
  podSelector: {matchLabels: {app: other}}
  policyTypes: [Egress]
  egress:
  - to: [{podSelector: {matchLabels: {app: client}}}]
    ports: [{port: http, protocol: TCP}]
`)
	across(len(p.server), func(i, j int) {
		p.wantConnect(t, p.other[i], p.server[j].Status.PodIP+":8080", "EPERM")
		p.wantConnect(t, p.other[i], p.client[j].Status.PodIP+":8080", "ok: hello from "+p.client[j].Name)
	})
}

// testHubbleAcrossNodes: the real hubble CLI names the pod of another
// node at the far end of a flow, from the address's owner in the agent's
// ipcache, so that `--to-pod`/`--from-pod` find cross-node traffic on both
// sides: the sender's node shows the other pod's denied connection to a
// server of another node (the egress NetworkPolicy), the server's node the
// denied connections it received from it (the ingress CNP of the step
// before).
func testHubbleAcrossNodes(t *testing.T, n *node, p *mnPods) {
	across(len(p.server), func(i, j int) {
		from, to := ns+"/"+p.other[i].Name, ns+"/"+p.server[j].Name
		testenv.Eventually(t, waitTimeout, fmt.Sprintf("%s shows %s denied to %s", p.workers[i].name, from, to), func() (bool, string) {
			p.connect(t, p.other[i], p.server[j].Status.PodIP+":8080")
			flows := p.workers[i].observeHubble(t, "--last", "2000", "--from-pod", from, "--to-pod", to, "--verdict", "DROPPED")
			for _, f := range flows {
				if f.Flow.Destination.PodName == p.server[j].Name && f.Flow.Destination.Namespace == ns && f.Flow.TrafficDirection == "EGRESS" {
					return true, ""
				}
			}
			return false, fmt.Sprintf("%d flows: %+v", len(flows), flows)
		})
		flows := p.workers[j].observeHubble(t, "--last", "4000", "--from-pod", from, "--to-pod", to, "--verdict", "DROPPED")
		var ingress bool
		for _, f := range flows {
			ingress = ingress || (f.Flow.Source.PodName == p.other[i].Name && f.Flow.TrafficDirection == "INGRESS")
		}
		if !ingress {
			t.Errorf("%s shows no ingress drop from %s to %s: %+v", p.workers[j].name, from, to, flows)
		}
	})
}

// testRemoteNodeEntity: each node's agent knows the other nodes from their
// Node objects: a client whose CNP allows everything but remote-node gets
// EPERM connecting to another node's kubelet (its InternalIP), and
// reaches a server pod of that node.
func testRemoteNodeEntity(t *testing.T, n *node, p *mnPods) {
	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: client-not-remote-node, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress: [{toEntities: [all]}]
  egressDeny: [{toEntities: [remote-node]}]
`)
	across(len(p.client), func(i, j int) {
		p.wantConnect(t, p.client[i], nodeIPOf(j+1)+":10250", "EPERM")
		p.wantConnect(t, p.client[i], p.server[j].Status.PodIP+":8080", "ok: hello from "+p.server[j].Name)
	})
}
