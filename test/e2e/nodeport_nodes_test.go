package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Addresses of TestNodePortAcrossNodes: this node (the agent's) and
// another node on one node network, as two nodes of a cluster are; the
// other node routes its pod CIDR and this node routes it through the
// other node's address, as a host-gateway CNI does.
const (
	nnNode4      = "10.243.0.1" // this node, on the node network
	nnOther4     = "10.243.0.2" // the other node
	nnPod4       = "10.243.1.11"
	nnPodGw4     = "10.243.1.1"
	nnOtherCIDR  = "10.243.2.0/24" // the other node's pods
	nnOtherPodGw = "10.243.2.1"
	nnOtherPod4  = "10.243.2.11"
	uidNN        = "3d3d3d3d-0000-4000-8000-00000000003d"
)

// nnConfig: a NodePort service (TCP and UDP) with a backend on each node,
// as Kubernetes' "Granular Checks: Services" make it, and one with
// externalTrafficPolicy Local whose only backend here is terminating.
const nnConfig = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: nnb, namespace: default, uid: ` + uidNN + `, labels: {app: nnb}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + nnPod4 + `, podIPs: [{ip: ` + nnPod4 + `}]}
---
apiVersion: v1
kind: Service
metadata: {name: nn-both, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.91
  ports:
  - {name: tcp, port: 80, targetPort: 8080, nodePort: 30091, protocol: TCP}
  - {name: udp, port: 80, targetPort: 8080, nodePort: 30091, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: nn-both-1, namespace: default, labels: {kubernetes.io/service-name: nn-both}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}, {name: udp, port: 8080, protocol: UDP}]
endpoints:
- {addresses: ["` + nnPod4 + `"], nodeName: e2e-node, conditions: {ready: true}}
- {addresses: ["` + nnOtherPod4 + `"], nodeName: e2e-other, conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: nn-local, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.92
  externalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, nodePort: 30092, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: nn-local-1, namespace: default, labels: {kubernetes.io/service-name: nn-local}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["` + nnPod4 + `"], nodeName: e2e-node, conditions: {ready: false, serving: true, terminating: true}}
- {addresses: ["` + nnOtherPod4 + `"], nodeName: e2e-other, conditions: {ready: true}}
`

// TestNodePortAcrossNodes: the traffic of Kubernetes' multi-node Services
// specs, at one node. Another node's host and a pod on it (network
// namespaces on the node network, the pod routed through its node) reach
// this node's NodePort over UDP and TCP, and get answers from both
// backends: the one on this node (which sees the client's address) and
// the one on the other node (SNAT: it sees this node's address), the
// UDP replies translated back. With externalTrafficPolicy Local and only
// a terminating backend here, that backend still serves (the fallback),
// and sees the client.
func TestNodePortAcrossNodes(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	testenv.RequireProgram(t, "sysctl")
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); err != nil || strings.TrimSpace(string(b)) != "1" {
		if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.WriteFile("/proc/sys/net/ipv4/ip_forward", b, 0o644) })
	}
	cgRoot := testenv.Cgroup(t)
	configDir := t.TempDir()

	// The other node: its host on the node network, forwarding to a pod
	// of its own behind a veth, with its default route to this node.
	other := makeNPNetns(t, "nno", nnNode4, nnOther4, "fd00:f5::1", "fd00:f5::2")
	ipCmd(t, "netns", "exec", other.netns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	ipCmd(t, "route", "add", nnOtherCIDR, "via", nnOther4, "dev", other.hostIf)
	t.Cleanup(func() { exec.Command("ip", "route", "del", nnOtherCIDR).Run() })
	otherPod := &npNetns{netns: fmt.Sprintf("apiary-e2e-nnp-%d", os.Getpid()), hostIf: "nnpod0"}
	ipCmd(t, "netns", "add", otherPod.netns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", otherPod.netns).Run() })
	inOther := func(args ...string) { ipCmd(t, append([]string{"netns", "exec", other.netns}, args...)...) }
	inPod := func(args ...string) { ipCmd(t, append([]string{"netns", "exec", otherPod.netns}, args...)...) }
	inOther("ip", "link", "add", otherPod.hostIf, "type", "veth", "peer", "name", "eth0", "netns", otherPod.netns)
	inOther("ip", "addr", "add", nnOtherPodGw+"/24", "dev", otherPod.hostIf)
	inOther("ip", "link", "set", otherPod.hostIf, "up")
	inPod("ip", "link", "set", "lo", "up")
	inPod("ip", "addr", "add", nnOtherPod4+"/24", "dev", "eth0")
	inPod("ip", "link", "set", "eth0", "up")
	inPod("ip", "route", "add", "default", "via", nnOtherPodGw)

	// This node's pod.
	pod := makeIfPodVia(t, cgRoot, uidNN, "nnb", nnPodGw4, "fd00:f6::1", nnPod4, "fd00:f6::11")
	startServer(t, pod.command(t, true, []string{npServeEnv + "=:8080"}), nnPod4)
	startServer(t, otherPod.command(npServeEnv+"=:8080"), nnOtherPod4)

	writeFile(t, filepath.Join(configDir, "nn.yaml"), nnConfig)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + cgRoot, "--node-ips=" + nnNode4,
		"--enable-nodeport", "--devices=" + other.hostIf,
	}})
	a.waitPodInterfaces(t, map[string]string{"default/nnb": pod.hostIf})
	testenv.Eventually(t, waitTimeout, "the nodeport-devices table lists the node network's device", func() (bool, string) {
		var rows []struct{ Name, Attach, Error string }
		if err := a.dump("nodeport-devices", &rows); err != nil {
			return false, err.Error()
		}
		return len(rows) == 1 && rows[0].Attach != "" && rows[0].Error == "", fmt.Sprintf("%+v", rows)
	})

	// Both backends answer, each seeing whom it should: the local one
	// the client, the other node's one this node (SNAT).
	both := func(client *npNetns, clientAddr, env string, want ...string) {
		t.Helper()
		for i := range want {
			want[i] = strings.ReplaceAll(want[i], "CLIENT", clientAddr)
		}
		seen := map[string]int{}
		testenv.Eventually(t, waitTimeout, env+" from "+clientAddr+" reaches both backends", func() (bool, string) {
			got := strings.TrimPrefix(client.run(t, env+"="+nnNode4+":30091"), "ok: ")
			seen[got]++
			for _, w := range want {
				if seen[w] == 0 {
					return false, fmt.Sprint(seen)
				}
			}
			return true, ""
		})
		for got := range seen {
			if !slices.Contains(want, got) {
				t.Errorf("%s from %s: an answer %q (of %v), want only %v", env, clientAddr, got, seen, want)
			}
		}
	}
	t.Run("UDP from the other node's host", func(t *testing.T) {
		both(other, nnOther4, npUDPEnv, "hello CLIENT", "hello "+nnNode4)
	})
	t.Run("TCP from the other node's host", func(t *testing.T) {
		both(other, nnOther4, connectEnv, "hello CLIENT", "hello "+nnNode4)
	})
	t.Run("UDP from the other node's pod", func(t *testing.T) {
		both(otherPod, nnOtherPod4, npUDPEnv, "hello CLIENT", "hello "+nnNode4)
	})
	t.Run("TCP from the other node's pod", func(t *testing.T) {
		both(otherPod, nnOtherPod4, connectEnv, "hello CLIENT", "hello "+nnNode4)
	})
	t.Run("without the programs the other node gets no backend", func(t *testing.T) {
		// What the multi-node cluster saw with enable-nodeport off
		// (deploy/'s default then): a NodePort reached from another node
		// is not translated, only this node's own processes and pods
		// (the socket LB) get a backend; the datagram meets the node's
		// closed port.
		a.restart(t, "--enable-nodeport=false")
		testenv.Eventually(t, waitTimeout, "UDP from the other node's host refused", func() (bool, string) {
			got := other.run(t, npUDPEnv+"="+nnNode4+":30091")
			return got == "ECONNREFUSED", got
		})
		a.restart(t)
	})
	t.Run("externalTrafficPolicy Local falls back to the terminating local backend", func(t *testing.T) {
		for _, c := range []struct {
			client *npNetns
			addr   string
		}{{other, nnOther4}, {otherPod, nnOtherPod4}} {
			testenv.Eventually(t, waitTimeout, "the Local service from "+c.addr, func() (bool, string) {
				got := c.client.run(t, connectEnv+"="+nnNode4+":30092")
				return got == "ok: hello "+c.addr, got
			})
		}
	})
}
