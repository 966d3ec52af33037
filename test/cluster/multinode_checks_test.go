//go:build cluster

package cluster

import (
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/apiary-net/apiary/internal/testenv"
)

// hostCurl asks url from the node's host: a process in the node's cgroup
// subtrees and namespaces, as the node's own programs are, so that the
// node's agent's socket load balancer serves its connections. It answers
// "ok: <body>" or the error.
func (w *workerNode) hostCurl(url string, timeout int) string {
	var enter string
	for _, h := range cgroupHierarchies {
		enter += fmt.Sprintf("echo $$ > /sys/fs/cgroup/%s/%s/cgroup.procs\n", h.dir, w.cgroup)
	}
	pid := strconv.Itoa(w.holder.cmd.Process.Pid)
	script := enter + "exec nsenter -t " + pid + " -n -m -u -C -- curl -sS -m " + strconv.Itoa(timeout) + " '" + url + "'"
	return curlResult(exec.Command("/bin/sh", "-c", script).CombinedOutput())
}

// worldCurl asks url from this machine's own network namespace, the
// control plane's host, which every node's agent takes for the world.
func worldCurl(url string, timeout int) string {
	return curlResult(exec.Command("curl", "-sS", "-m", strconv.Itoa(timeout), url).CombinedOutput())
}

func curlResult(out []byte, err error) string {
	if err != nil {
		return fmt.Sprintf("curl: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return "ok: " + string(out)
}

// wantEventually waits until ask's answer starts with want.
func wantEventually(t *testing.T, what, want string, ask func() string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, what+": "+want, func() (bool, string) {
		got := ask()
		return strings.HasPrefix(got, want), got
	})
}

// deletePolicies deletes the CiliumNetworkPolicies and NetworkPolicies of
// the test's namespace by name.
func (n *node) deletePolicies(t *testing.T, cnps, netpols []string) {
	t.Helper()
	ctx := context.Background()
	res := n.dynamic(t).Resource(schema.GroupVersionResource{Group: "cilium.io", Version: "v2", Resource: "ciliumnetworkpolicies"}).Namespace(ns)
	for _, name := range cnps {
		if err := res.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatalf("delete CiliumNetworkPolicy %s: %v", name, err)
		}
	}
	for _, name := range netpols {
		if err := n.cs.NetworkingV1().NetworkPolicies(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatalf("delete NetworkPolicy %s: %v", name, err)
		}
	}
}

// testServiceFromHosts: the host of each node (its own cgroup root, where
// its agent attached the socket load balancer) reaches the backends on
// every node through the ClusterIP.
func testServiceFromHosts(t *testing.T, n *node, p *mnPods) {
	for _, w := range p.workers {
		seen := map[string]bool{}
		testenv.Eventually(t, waitTimeout, "the host of "+w.name+" to every server through "+p.clusterIP, func() (bool, string) {
			got := w.hostCurl("http://"+p.clusterIP+":80/", 5)
			if from, ok := strings.CutPrefix(got, "ok: hello from "); ok {
				seen[from] = true
			}
			return len(seen) == len(p.server), fmt.Sprintf("last %q, seen %v", got, seen)
		})
	}
}

// testIngressNetpolAcrossNodes: a NetworkPolicy lets only clients into the
// other pods, on their named port: the receiving node resolves "http" on
// its own pod and judges the sender, a pod of another node, by its
// address: a client gets in, a server (no egress policy of its own) does
// not.
func testIngressNetpolAcrossNodes(t *testing.T, n *node, p *mnPods) {
	n.createPolicy(t, `apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: other-ingress, namespace: `+ns+`}
spec:
  podSelector: {matchLabels: {app: other}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: client}}}]
    ports: [{port: http, protocol: TCP}]
`)
	across(len(p.server), func(i, j int) {
		addr := p.other[j].Status.PodIP + ":8080"
		p.wantConnect(t, p.server[i], addr, "timeout")
		p.wantConnect(t, p.client[i], addr, "ok: hello from "+p.other[j].Name)
	})
}

// testEgressCNPAcrossNodes: a CNP limits the servers' egress to the
// clients: the sender's node lets a server reach a client of another
// node and denies it another node's other pod (EPERM, before any packet).
func testEgressCNPAcrossNodes(t *testing.T, n *node, p *mnPods) {
	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: server-egress, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: server}}
  egress:
  - toEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`)
	across(len(p.server), func(i, j int) {
		p.wantConnect(t, p.server[i], p.other[j].Status.PodIP+":8080", "EPERM")
		p.wantConnect(t, p.server[i], p.client[j].Status.PodIP+":8080", "ok: hello from "+p.client[j].Name)
	})
}

// testEntitiesAcrossNodes: the entities as each node sees the others.
// Egress: a client allowed only host and remote-node reaches its own
// node's kubelet (host) and another node's (remote-node), and not a pod
// of another node. Ingress: a server admitting only remote-node lets the
// host of another node in and not that node's pods, nor the world (this
// machine's own namespace); admitting cluster, it lets in both, still not
// the world; admitting world too, the world.
func testEntitiesAcrossNodes(t *testing.T, n *node, p *mnPods) {
	n.deletePolicies(t, []string{"server-ingress", "server-egress", "client-not-remote-node"}, []string{"other-egress", "other-ingress"})
	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: client-host-and-nodes, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress: [{toEntities: [host, remote-node]}]
`)
	across(len(p.client), func(i, j int) {
		// The kubelet's port answers HTTP with a 400 (it speaks TLS): "ok".
		p.wantConnect(t, p.client[i], p.server[j].Status.PodIP+":8080", "EPERM")
		p.wantConnect(t, p.client[i], nodeIPOf(i+1)+":10250", "ok")
		p.wantConnect(t, p.client[i], nodeIPOf(j+1)+":10250", "ok")
	})

	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: server-from-remote-node, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: server}}
  ingress: [{fromEntities: [remote-node]}]
`)
	across(len(p.server), func(i, j int) {
		url := "http://" + p.server[i].Status.PodIP + ":8080/"
		p.wantConnect(t, p.other[j], p.server[i].Status.PodIP+":8080", "timeout")
		wantEventually(t, "the host of "+p.workers[j].name+" to "+p.server[i].Name, "ok: hello from "+p.server[i].Name,
			func() string { return p.workers[j].hostCurl(url, 5) })
		if got := worldCurl(url, 3); strings.HasPrefix(got, "ok") {
			t.Errorf("the world to %s admitting remote-node: %s", p.server[i].Name, got)
		}
	})

	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: server-from-cluster, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: server}}
  ingress: [{fromEntities: [cluster]}]
`)
	n.deletePolicies(t, []string{"server-from-remote-node"}, nil)
	across(len(p.server), func(i, j int) {
		url := "http://" + p.server[i].Status.PodIP + ":8080/"
		p.wantConnect(t, p.other[j], p.server[i].Status.PodIP+":8080", "ok: hello from "+p.server[i].Name)
		wantEventually(t, "the host of "+p.workers[j].name+" to "+p.server[i].Name, "ok: hello from "+p.server[i].Name,
			func() string { return p.workers[j].hostCurl(url, 5) })
		if got := worldCurl(url, 3); strings.HasPrefix(got, "ok") {
			t.Errorf("the world to %s admitting cluster: %s", p.server[i].Name, got)
		}
	})

	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: server-from-world, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: server}}
  ingress: [{fromEntities: [world]}]
`)
	for _, s := range p.server {
		url := "http://" + s.Status.PodIP + ":8080/"
		wantEventually(t, "the world to "+s.Name, "ok: hello from "+s.Name, func() string { return worldCurl(url, 3) })
	}
	n.deletePolicies(t, []string{"client-host-and-nodes", "server-from-cluster", "server-from-world"}, nil)
}

// testDNSAcrossNodes: a client on the first node whose resolver is the
// cluster DNS Service, served by a DNS pod on the last node. Once a CNP
// with a DNS rule and toFQDNs selects it, the first node's agent
// intercepts its queries and forwards them across to that pod: an allowed
// name resolves, another is refused, and the address the allowed name
// resolved to is allowed (the connection is not EPERM; nothing answers
// there) while another is not.
func testDNSAcrossNodes(t *testing.T, n *node, p *mnPods) {
	ctx := context.Background()
	first, last := p.workers[0], p.workers[len(p.workers)-1]
	dnsPod := testPod("dns", map[string]string{"app": "dns"}, corev1.EnvVar{Name: "DNS_SERVER", Value: "1"})
	dnsPod.Spec.NodeName = last.name
	n.runPod(dnsPod)
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
	pod.Spec.NodeName = first.name
	pod.Spec.DNSPolicy = corev1.DNSNone
	pod.Spec.DNSConfig = &corev1.PodDNSConfig{Nameservers: []string{svc.Spec.ClusterIP}, Searches: []string{}}
	client := n.runPod(pod)
	wantLookup := func(name, want string) {
		t.Helper()
		wantEventually(t, fmt.Sprintf("%s on %s resolves %s", client.Name, first.name, name), want,
			func() string { return p.ask(t, client, "/lookup?name="+name) })
	}
	wantLookup("www.allowed.test", "ok: 192.0.2.10")

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
  - toFQDNs: [{matchPattern: "*.allowed.test"}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`)
	wantLookup("www.denied.test", "error: lookup www.denied.test on "+svc.Spec.ClusterIP+":53: server misbehaving")
	wantLookup("www.allowed.test", "ok: 192.0.2.10")
	testenv.Eventually(t, waitTimeout, client.Name+" to the allowed name's address: not EPERM", func() (bool, string) {
		got := p.connect(t, client, "192.0.2.10:8080")
		return !strings.HasPrefix(got, "EPERM") && !strings.HasPrefix(got, "ask the pod"), got
	})
	p.wantConnect(t, client, "192.0.2.20:8080", "EPERM")
}

// testNodePortFromOtherNodes: a NodePort Service with a backend per node
// is reached at every node's address from every other node's host and
// client pod (traffic from off the node: the north-south programs on the
// receiving node's eth0, enable-nodeport in the config map), and every
// backend answers, the receiving node's own (client address kept) and
// the others' (SNAT to the receiving node's address).
func testNodePortFromOtherNodes(t *testing.T, n *node, p *mnPods) {
	ctx := context.Background()
	svc, err := n.cs.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "server-nodeport", Namespace: ns},
		Spec: corev1.ServiceSpec{
			Type:     corev1.ServiceTypeNodePort,
			Selector: map[string]string{"app": "server"},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.cs.CoreV1().Services(ns).Delete(context.Background(), svc.Name, metav1.DeleteOptions{}) })
	port := strconv.Itoa(int(svc.Spec.Ports[0].NodePort))
	across(len(p.workers), func(i, j int) {
		from, to := p.workers[i], p.workers[j]
		addr := to.ip + ":" + port
		for _, c := range []struct {
			name string
			ask  func() string
		}{
			{"the host of " + from.name, func() string { return from.hostCurl("http://"+addr+"/", 5) }},
			{p.client[i].Name + " on " + from.name, func() string { return p.connect(t, p.client[i], addr) }},
		} {
			seen := map[string]bool{}
			testenv.Eventually(t, waitTimeout, c.name+" to every server through "+to.name+"'s node port "+addr, func() (bool, string) {
				got := c.ask()
				if name, ok := strings.CutPrefix(got, "ok: hello from "); ok && name != "" {
					seen[strings.Fields(name)[0]] = true
				}
				return len(seen) == len(p.server), fmt.Sprintf("last %q, seen %v", got, seen)
			})
		}
	})
}
