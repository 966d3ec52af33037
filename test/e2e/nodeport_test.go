package e2e

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Addresses of the nodeport tests: an outside client in a network
// namespace of its own behind one external device of the node, a backend
// pod on the node, and a "remote" backend (another node's pod, as far as
// this node knows) behind a second external device.
const (
	npNode4     = "10.241.0.1" // the node's address on the outside link
	npClient4   = "10.241.0.2"
	npPodGw4    = "10.241.1.1"
	npPodGw6    = "fd00:f3::1"
	npPod4      = "10.241.1.11"
	npPod6      = "fd00:f3::11"
	npRemoteGw4 = "10.241.2.1" // the node's address on the remote link
	npRemote4   = "10.241.2.2"
	uidNP       = "3c3c3c3c-0000-4000-8000-00000000003c"
	npNode6     = "fd00:f1::1"
	npClient6   = "fd00:f1::2"
	npRemoteGw6 = "fd00:f2::1"
	npRemote6   = "fd00:f2::2"
)

// Helpers of the nodeport tests.
const (
	// npServeEnv: listen on the address over TCP and UDP; greet every
	// TCP connection, answer every datagram, with "hello <peer address>".
	npServeEnv = "E2E_NP_SERVE"
	// npUDPEnv: send a datagram to the address and print the answer, or
	// "timeout".
	npUDPEnv = "E2E_NP_UDP"
)

func runNodePortHelper() (int, bool) {
	if addr := os.Getenv(npServeEnv); addr != "" {
		return reportErr(npServe(addr)), true
	}
	if addr := os.Getenv(npUDPEnv); addr != "" {
		fmt.Println(npUDP(addr))
		return 0, true
	}
	return 0, false
}

func npServe(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	uc, err := net.ListenPacket("udp", addr)
	if err != nil {
		return err
	}
	fmt.Println("listening")
	go func() {
		buf := make([]byte, 1500)
		for {
			_, from, err := uc.ReadFrom(buf)
			if err != nil {
				return
			}
			uc.WriteTo([]byte("hello "+from.(*net.UDPAddr).AddrPort().Addr().Unmap().String()), from)
		}
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		fmt.Fprintf(c, "hello %s\n", c.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap())
		c.Close()
	}
}

func npUDP(addr string) string {
	c, err := net.Dial("udp", addr)
	if err != nil {
		return "error: " + err.Error()
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		return "error: " + err.Error()
	}
	buf := make([]byte, 1500)
	n, err := c.Read(buf)
	if err != nil {
		if os.IsTimeout(err) {
			return "timeout"
		}
		if errors.Is(err, syscall.ECONNREFUSED) {
			// An ICMP port unreachable came back.
			return "ECONNREFUSED"
		}
		return "error: " + err.Error()
	}
	return string(buf[:n])
}

// npNetns is a network namespace behind a veth of the node: addr inside,
// gw on the node's side (a /24 between them).
type npNetns struct {
	netns, hostIf string
}

func makeNPNetns(t *testing.T, name, gw, addr, gw6, addr6 string) *npNetns {
	t.Helper()
	n := &npNetns{
		netns:  fmt.Sprintf("apiary-e2e-%s-%d", name, os.Getpid()),
		hostIf: fmt.Sprintf("e2e%s%d", name, os.Getpid()%100000),
	}
	ipCmd(t, "netns", "add", n.netns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", n.netns).Run() })
	ipCmd(t, "link", "add", n.hostIf, "type", "veth", "peer", "name", "eth0", "netns", n.netns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", n.hostIf).Run() })
	ipCmd(t, "addr", "add", gw+"/24", "dev", n.hostIf)
	ipCmd(t, "-6", "addr", "add", gw6+"/64", "dev", n.hostIf, "nodad")
	ipCmd(t, "link", "set", n.hostIf, "up")
	in := func(args ...string) { ipCmd(t, append([]string{"netns", "exec", n.netns}, args...)...) }
	in("ip", "link", "set", "lo", "up")
	in("ip", "addr", "add", addr+"/24", "dev", "eth0")
	in("ip", "-6", "addr", "add", addr6+"/64", "dev", "eth0", "nodad")
	in("ip", "link", "set", "eth0", "up")
	in("ip", "route", "add", "default", "via", gw)
	in("ip", "-6", "route", "add", "default", "via", gw6)
	return n
}

// command runs the test binary as a helper with env in the namespace.
func (n *npNetns) command(env ...string) *exec.Cmd {
	self, _ := os.Executable()
	cmd := exec.Command("ip", "netns", "exec", n.netns, self)
	cmd.Env = append(cleanEnv(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

func (n *npNetns) run(t *testing.T, env ...string) string {
	t.Helper()
	out, err := n.command(env...).CombinedOutput()
	if err != nil {
		t.Fatalf("helper %v in %s: %v: %s", env, n.netns, err, out)
	}
	return strings.TrimSpace(string(out))
}

// startServer starts npServe on addr from cmd and waits until it listens.
func startServer(t *testing.T, cmd *exec.Cmd, addr string) {
	t.Helper()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "listening" {
		t.Fatalf("server on %s: %q %v", addr, line, err)
	}
}

// startLines starts cmd and sends each line it prints.
func startLines(t *testing.T, cmd *exec.Cmd) <-chan string {
	t.Helper()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	out := make(chan string, 16)
	go func() {
		defer close(out)
		lines := bufio.NewScanner(stdout)
		for lines.Scan() {
			out <- lines.Text()
		}
	}()
	return out
}

// startConnected starts cmd (tcpEcho) and waits until it says it is
// connected.
func startConnected(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "connected" {
		t.Fatalf("client: %q %v", line, err)
	}
}

// npConfig: the backend pod, a NodePort service with it as its backend
// (TCP and UDP, nodePort 30081) and one with the remote backend (30082).
const npConfig = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: npb, namespace: default, uid: ` + uidNP + `, labels: {app: npb}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + npPod4 + `, podIPs: [{ip: ` + npPod4 + `}, {ip: "` + npPod6 + `"}]}
---
apiVersion: v1
kind: Service
metadata: {name: np-local, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.81
  clusterIPs: [10.96.0.81, "fd00:96::81"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  ports:
  - {name: tcp, port: 80, targetPort: 8080, nodePort: 30081, protocol: TCP}
  - {name: udp, port: 80, targetPort: 8080, nodePort: 30081, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-local-1, namespace: default, labels: {kubernetes.io/service-name: np-local}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}, {name: udp, port: 8080, protocol: UDP}]
endpoints: [{addresses: ["` + npPod4 + `"], nodeName: e2e-node, conditions: {ready: true}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-local-6, namespace: default, labels: {kubernetes.io/service-name: np-local}}
addressType: IPv6
ports: [{name: tcp, port: 8080, protocol: TCP}, {name: udp, port: 8080, protocol: UDP}]
endpoints: [{addresses: ["` + npPod6 + `"], nodeName: e2e-node, conditions: {ready: true}}]
---
apiVersion: v1
kind: Service
metadata: {name: np-remote, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.82
  clusterIPs: [10.96.0.82, "fd00:96::82"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  ports:
  - {name: tcp, port: 80, targetPort: 8080, nodePort: 30082, protocol: TCP}
  - {name: udp, port: 80, targetPort: 8080, nodePort: 30082, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-remote-1, namespace: default, labels: {kubernetes.io/service-name: np-remote}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}, {name: udp, port: 8080, protocol: UDP}]
endpoints: [{addresses: ["` + npRemote4 + `"], nodeName: e2e-other, conditions: {ready: true}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-remote-6, namespace: default, labels: {kubernetes.io/service-name: np-remote}}
addressType: IPv6
ports: [{name: tcp, port: 8080, protocol: TCP}, {name: udp, port: 8080, protocol: UDP}]
endpoints: [{addresses: ["` + npRemote6 + `"], nodeName: e2e-other, conditions: {ready: true}}]
`

// npDenyWorld: the backend pod takes traffic from the host only.
const npDenyWorld = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: npb, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: npb}}
  ingress:
  - fromEntities: [host]
`

type npSetup struct {
	a                 *agent
	client, remote    *npNetns
	pod               *ifPod
	configDir, cgRoot string
}

// setupNodePort starts the agent with the nodeport programs on two
// devices (and flags, e.g. another --devices that adds to them).
func setupNodePort(t *testing.T, extra, attach string, flags ...string) *npSetup {
	t.Helper()
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); err != nil || strings.TrimSpace(string(b)) != "1" {
		// The node forwards to its pods and other nodes.
		if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.WriteFile("/proc/sys/net/ipv4/ip_forward", b, 0o644) })
	}
	const fwd6 = "/proc/sys/net/ipv6/conf/all/forwarding"
	if b, err := os.ReadFile(fwd6); err != nil || strings.TrimSpace(string(b)) != "1" {
		if err := os.WriteFile(fwd6, []byte("1"), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.WriteFile(fwd6, b, 0o644) })
	}
	s := &npSetup{cgRoot: testenv.Cgroup(t), configDir: t.TempDir()}
	s.client = makeNPNetns(t, "npo", npNode4, npClient4, npNode6, npClient6)
	s.remote = makeNPNetns(t, "npr", npRemoteGw4, npRemote4, npRemoteGw6, npRemote6)
	s.pod = makeIfPodVia(t, s.cgRoot, uidNP, "npb", npPodGw4, npPodGw6, npPod4, npPod6)
	startServer(t, s.pod.command(t, true, []string{npServeEnv + "=:8080"}), npPod4)
	startServer(t, s.remote.command(npServeEnv+"=:8080"), npRemote4)
	writeFile(t, filepath.Join(s.configDir, "np.yaml"), npConfig+extra)
	s.a = startAgent(t, agentOptions{configDir: s.configDir, flags: append([]string{
		"--node-name=e2e-node", "--cgroup-root=" + s.cgRoot, "--node-ips=" + npNode4 + "," + npNode6, "--enable-ipv6",
		"--enable-nodeport", "--enable-health-check-node-port", "--devices=" + s.client.hostIf + "," + s.remote.hostIf, "--nodeport-attach=" + attach,
	}, flags...)})
	s.a.waitPodInterfaces(t, map[string]string{"default/npb": s.pod.hostIf})
	want := attach
	if want == "auto" {
		want = "tcx" // the kernels apiary is tested on have it
	}
	testenv.Eventually(t, waitTimeout, "the nodeport-devices table lists both devices attached with "+want, func() (bool, string) {
		var rows []struct{ Name, Attach, Error string }
		if err := s.a.dump("nodeport-devices", &rows); err != nil {
			return false, err.Error()
		}
		n := 0
		for _, r := range rows {
			if r.Attach == want && r.Error == "" {
				n++
			}
		}
		return n == 2, fmt.Sprintf("%+v", rows)
	})
	return s
}

// npLoadBalancers: two LoadBalancer services on the backend pod, one whose
// source ranges hold the client, one whose do not.
const npLoadBalancers = `---
apiVersion: v1
kind: Service
metadata: {name: np-lb-in, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.83
  loadBalancerSourceRanges: ["10.241.0.0/24"]
  ports: [{name: tcp, port: 80, targetPort: 8080, nodePort: 30083, protocol: TCP}]
status: {loadBalancer: {ingress: [{ip: ` + npLBIn + `}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-lb-in-1, namespace: default, labels: {kubernetes.io/service-name: np-lb-in}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["` + npPod4 + `"], nodeName: e2e-node, conditions: {ready: true}}]
---
apiVersion: v1
kind: Service
metadata: {name: np-lb-out, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.84
  loadBalancerSourceRanges: ["192.0.2.0/24"]
  ports: [{name: tcp, port: 80, targetPort: 8080, nodePort: 30084, protocol: TCP}]
status: {loadBalancer: {ingress: [{ip: ` + npLBOut + `}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-lb-out-1, namespace: default, labels: {kubernetes.io/service-name: np-lb-out}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["` + npPod4 + `"], nodeName: e2e-node, conditions: {ready: true}}]
`

// npEmpty: a dual-stack NodePort service without endpoints, TCP and UDP.
const npEmpty = `---
apiVersion: v1
kind: Service
metadata: {name: np-empty, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.85
  clusterIPs: [10.96.0.85, "fd00:96::85"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  ports:
  - {name: tcp, port: 80, targetPort: 8080, nodePort: 30085, protocol: TCP}
  - {name: udp, port: 80, targetPort: 8080, nodePort: 30085, protocol: UDP}
`

// npLong: a NodePort service for a long-lived connection to the pod.
const npLong = `---
apiVersion: v1
kind: Service
metadata: {name: np-long, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.86
  ports: [{name: tcp, port: 80, targetPort: 9090, nodePort: 30086, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-long-1, namespace: default, labels: {kubernetes.io/service-name: np-long}}
addressType: IPv4
ports: [{name: tcp, port: 9090, protocol: TCP}]
endpoints: [{addresses: ["` + npPod4 + `"], nodeName: e2e-node, conditions: {ready: true}}]
`

// npLocal: externalTrafficPolicy Local, a backend on this node and one on
// another.
const npLocal = `---
apiVersion: v1
kind: Service
metadata: {name: np-etp, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.87
  externalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, nodePort: 30087, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-etp-1, namespace: default, labels: {kubernetes.io/service-name: np-etp}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["` + npPod4 + `"], nodeName: e2e-node, conditions: {ready: true}}
- {addresses: ["` + npRemote4 + `"], nodeName: e2e-other, conditions: {ready: true}}
`

// npHealthChecks: two LoadBalancer services with externalTrafficPolicy
// Local and a healthCheckNodePort, one with an endpoint on this node, one
// with none.
const npHealthChecks = `---
apiVersion: v1
kind: Service
metadata: {name: np-hc-here, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.88
  externalTrafficPolicy: Local
  healthCheckNodePort: 32001
  ports: [{name: tcp, port: 80, targetPort: 8080, nodePort: 30088, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-hc-here-1, namespace: default, labels: {kubernetes.io/service-name: np-hc-here}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["` + npPod4 + `"], nodeName: e2e-node, conditions: {ready: true}}]
---
apiVersion: v1
kind: Service
metadata: {name: np-hc-away, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.89
  externalTrafficPolicy: Local
  healthCheckNodePort: 32002
  ports: [{name: tcp, port: 80, targetPort: 8080, nodePort: 30089, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-hc-away-1, namespace: default, labels: {kubernetes.io/service-name: np-hc-away}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["` + npRemote4 + `"], nodeName: e2e-other, conditions: {ready: true}}]
`

// LoadBalancer ingress IPs of npLoadBalancers, routed to the node by the
// client's default route.
const (
	npLBIn  = "10.241.9.1"
	npLBOut = "10.241.9.2"
)

// TestNodePortFromOutside: a client outside the node (its own network
// namespace, behind an external device) reaches a NodePort service at
// <node address>:<nodePort>, over TCP and UDP, through the shipped
// binary's programs, IPv4 and IPv6: a backend pod on the node sees the
// client's own address; a remote backend (behind another external device)
// sees the node's address there (SNAT), and its replies come back to the
// client.
// The flows are in `apiary bpf nodeport list`, the counts in `stats`.
//
// Once with tcx links (auto), once with tc filters.
func TestNodePortFromOutside(t *testing.T) {
	for _, attach := range []string{"auto", "tc"} {
		t.Run(attach, func(t *testing.T) { testNodePortFromOutside(t, attach) })
	}
}

func testNodePortFromOutside(t *testing.T, attach string) {
	s := setupNodePort(t, npLoadBalancers+npEmpty+npLong+npLocal+npHealthChecks, attach)
	for _, tc := range []struct {
		name, addr, seen string
	}{
		{"local backend", npNode4 + ":30081", npClient4},
		{"remote backend", npNode4 + ":30082", npRemoteGw4},
		{"IPv6 local backend", "[" + npNode6 + "]:30081", npClient6},
		{"IPv6 remote backend", "[" + npNode6 + "]:30082", npRemoteGw6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := tc.addr
			testenv.Eventually(t, waitTimeout, "TCP to "+addr, func() (bool, string) {
				got := s.client.run(t, connectEnv+"="+addr)
				return got == "ok: hello "+tc.seen, got
			})
			testenv.Eventually(t, waitTimeout, "UDP to "+addr, func() (bool, string) {
				got := s.client.run(t, npUDPEnv+"="+addr)
				return got == "hello "+tc.seen, got
			})
		})
	}
	t.Run("loadBalancerSourceRanges", func(t *testing.T) {
		testenv.Eventually(t, waitTimeout, "the LoadBalancer IP whose ranges hold the client", func() (bool, string) {
			got := s.client.run(t, connectEnv+"="+npLBIn+":80")
			return got == "ok: hello "+npClient4, got
		})
		// Its node port is not bound by the ranges (kube-proxy's rule).
		if got := s.client.run(t, connectEnv+"="+npNode4+":30084"); got != "ok: hello "+npClient4 {
			t.Errorf("node port of the ranged service: %q", got)
		}
		if got := s.client.run(t, connectEnv+"="+npLBOut+":80"); got != "timeout" {
			t.Errorf("the LoadBalancer IP whose ranges leave the client out: %q, want timeout", got)
		}
		if n := s.nodePortStat(t, "drop_source_range"); n == 0 {
			t.Errorf("drop_source_range not counted")
		}
		if n, err := s.a.labelledMetric(`apiary_nodeport_packets_total{event="drop_source_range"}`); err != nil || n == 0 {
			t.Errorf("apiary_nodeport_packets_total{event=\"drop_source_range\"}: %v %v", n, err)
		}
		if n, err := s.a.labelledMetric(`apiary_nodeport_nat_entries{family="4"}`); err != nil || n < 2 {
			t.Errorf("apiary_nodeport_nat_entries: %v %v, want at least 2", n, err)
		}
	})

	t.Run("externalTrafficPolicy Local", func(t *testing.T) {
		// Only the backend on this node, which sees the client's address.
		testenv.Eventually(t, waitTimeout, "the Local service answers", func() (bool, string) {
			got := s.client.run(t, connectEnv+"="+npNode4+":30087")
			return strings.HasPrefix(got, "ok"), got
		})
		for i := range 12 {
			if got := s.client.run(t, connectEnv+"="+npNode4+":30087"); got != "ok: hello "+npClient4 {
				t.Fatalf("connection %d: %q, want the local backend seeing the client", i, got)
			}
		}
	})

	t.Run("healthCheckNodePort", func(t *testing.T) {
		// As kube-proxy answers: 200 with this node's endpoints, 503
		// without.
		for _, tc := range []struct {
			port, want string
		}{
			{"32001", `200 "localEndpoints":1`},
			{"32002", `503 "localEndpoints":0`},
		} {
			testenv.Eventually(t, waitTimeout, "health check port "+tc.port, func() (bool, string) {
				code, body, err := httpGet("http://" + npNode4 + ":" + tc.port + "/healthz")
				got := fmt.Sprintf("%d %s", code, strings.TrimSpace(body))
				wantCode, wantBody, _ := strings.Cut(tc.want, " ")
				return err == nil && strconv.Itoa(code) == wantCode && strings.Contains(strings.Join(strings.Fields(body), ""), wantBody), fmt.Sprint(got, err)
			})
		}
	})

	t.Run("no endpoints", func(t *testing.T) {
		// Refused at once (a reset from the node), as kube-proxy's
		// reject does, not left to time out.
		// TCP gets a reset, UDP an ICMP (ICMPv6) port unreachable: both
		// are ECONNREFUSED to the client's connected socket.
		for _, addr := range []string{npNode4 + ":30085", "[" + npNode6 + "]:30085"} {
			testenv.Eventually(t, waitTimeout, "TCP to "+addr+" (no endpoints) refused", func() (bool, string) {
				got := s.client.run(t, connectEnv+"="+addr)
				return got == "ECONNREFUSED", got
			})
			testenv.Eventually(t, waitTimeout, "UDP to "+addr+" (no endpoints) refused", func() (bool, string) {
				got := s.client.run(t, npUDPEnv+"="+addr)
				return got == "ECONNREFUSED", got
			})
		}
		for _, name := range []string{"reset_sent", "unreachable_sent"} {
			if n := s.nodePortStat(t, name); n < 2 {
				t.Errorf("%s %d, want at least 2 (IPv4 and IPv6)", name, n)
			}
		}
	})

	// Not a subtest: the agent started again belongs to the test.
	func() {
		// A server in the pod pushes lines over one connection that the
		// outside client made through the node port; the client echoes
		// them. The connection outlives the agent's restart: the NAT
		// entries and the links are pinned.
		srv := s.pod.command(t, true, []string{tcpPushEnv + "=:9090"})
		in, err := srv.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		out := startLines(t, srv)
		if l := <-out; l != "listening" {
			t.Fatalf("server in the pod: %q", l)
		}
		cli := s.client.command(tcpEchoEnv+"="+npNode4+":30086", tcpEchoFromEnv+"="+npClient4+":0")
		startConnected(t, cli)
		push := func(line string) {
			t.Helper()
			fmt.Fprintln(in, line)
			select {
			case got := <-out:
				if got != line {
					t.Fatalf("the client echoed %q, want %q", got, line)
				}
			case <-time.After(waitTimeout):
				t.Fatalf("no echo of %q", line)
			}
		}
		push("before")
		s.a.restart(t)
		push("after the agent's restart")
	}()

	// The pinned programs and maps hold while the agent is down.
	s.a.stop(t)
	if got := s.client.run(t, connectEnv+"="+npNode4+":30082"); got != "ok: hello "+npRemoteGw4 {
		t.Errorf("agent down: %q", got)
	}
	s.a.start(t)

	out, err := s.a.bpf("nodeport", "list")
	if err != nil || !strings.Contains(out, npClient4) || !strings.Contains(out, npRemote4+":8080 via "+npRemoteGw4) ||
		!strings.Contains(out, "["+npRemote6+"]:8080 via ["+npRemoteGw6+"]") {
		t.Errorf("apiary bpf nodeport list: %v\n%s", err, out)
	}
	out, err = s.a.bpf("nodeport", "stats")
	if err != nil || !strings.Contains(out, "new_local") {
		t.Errorf("apiary bpf nodeport stats: %v\n%s", err, out)
	}

	// Turned off, nothing translates the node port any more.
	s.a.restart(t, "--enable-nodeport=false")
	testenv.Eventually(t, waitTimeout, "without the programs, the node port is refused", func() (bool, string) {
		got := s.client.run(t, connectEnv+"="+npNode4+":30081")
		return got == "ECONNREFUSED", got
	})
}

// nodePortStat reads one counter of `apiary bpf nodeport stats`.
func (s *npSetup) nodePortStat(t *testing.T, name string) uint64 {
	t.Helper()
	out, err := s.a.bpf("nodeport", "stats")
	if err != nil {
		t.Fatalf("apiary bpf nodeport stats: %v\n%s", err, out)
	}
	for line := range strings.Lines(out) {
		var k string
		var n uint64
		if _, err := fmt.Sscan(line, &k, &n); err == nil && k == name {
			return n
		}
	}
	t.Fatalf("apiary bpf nodeport stats has no %s:\n%s", name, out)
	return 0
}

// TestNodePortPolicy: a translated packet meets the backend pod's
// ingress policy at its interface, judged as the client outside the
// cluster (world): a policy that lets only the host in drops it, and the
// drop is the interface's, in apiary monitor; the remote backend, which no
// policy of this node guards, still answers.
func TestNodePortPolicy(t *testing.T) {
	s := setupNodePort(t, "---\n"+npDenyWorld, "auto")
	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+s.a.addr)
	testenv.Eventually(t, waitTimeout, "the remote backend answers", func() (bool, string) {
		got := s.client.run(t, connectEnv+"="+npNode4+":30082")
		return got == "ok: hello "+npRemoteGw4, got
	})
	if got := s.client.run(t, connectEnv+"="+npNode4+":30081"); got != "timeout" {
		t.Errorf("TCP to the denied backend: %q, want timeout", got)
	}
	if got := s.client.run(t, npUDPEnv+"="+npNode4+":30081"); got != "timeout" {
		t.Errorf("UDP to the denied backend: %q, want timeout", got)
	}
	testenv.Eventually(t, waitTimeout, "apiary monitor shows the pod's interface denying the client", func() (bool, string) {
		for line := range strings.Lines(mon.log.String()) {
			if strings.Contains(line, `"default/npb"`) && strings.Contains(line, `"denied"`) &&
				strings.Contains(line, npClient4) && strings.Contains(line, `"interface"`) {
				return true, line
			}
		}
		return false, mon.log.Tail(10)
	})
}
