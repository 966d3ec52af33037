package e2e

// Policy enforcement end to end: pods of --config-dir on this node, their
// kubelet cgroups under --cgroup-root, processes in those cgroups that
// connect and listen on loopback addresses, and policies that allow and
// deny them, as the shipped binary enforces them.

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// Environment variables that make the test binary a helper process (see
// TestMain): connect to an address (optionally from a source address) and
// print the outcome, or listen and greet whoever connects.
const (
	connectEnv = "E2E_CONNECT"
	bindEnv    = "E2E_BIND"
	serveEnv   = "E2E_SERVE"
)

// runHelper runs the helper the environment asks for, if any, and reports
// whether it did.
func runHelper() (int, bool) {
	if addr := os.Getenv(serveEnv); addr != "" {
		return serve(addr), true
	}
	if code, ok := runEscapeHelper(); ok {
		return code, true
	}
	if code, ok := runIfaceHelper(); ok {
		return code, true
	}
	if code, ok := runCNDropHelper(); ok {
		return code, true
	}
	if code, ok := runNodePortHelper(); ok {
		return code, true
	}
	if code, ok := runDNSBypassHelper(); ok {
		return code, true
	}
	if q := os.Getenv(dnsQueryEnv); q != "" {
		fmt.Println(dnsQueryOutcome(q))
		return 0, true
	}
	if q := os.Getenv(dnsLoadEnv); q != "" {
		return dnsLoad(q), true
	}
	if q := os.Getenv(dnsFloodEnv); q != "" {
		return dnsFlood(q), true
	}
	if addr := os.Getenv(connectEnv); addr != "" {
		fmt.Println(connectOutcome(addr, os.Getenv(bindEnv)))
		return 0, true
	}
	return 0, false
}

// connectOutcome connects to addr over TCP (IPv6 when addr is "[IP]:port")
// and returns "ok: <greeting>" (or "ok" when the server says nothing),
// "EPERM" when connect() is refused by a cgroup program, "ECONNREFUSED",
// "timeout" when nothing answers, or the error.
func connectOutcome(addr, bind string) string {
	d := net.Dialer{Timeout: 2 * time.Second}
	if bind != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(bind)}
	}
	network := "tcp4"
	if strings.HasPrefix(addr, "[") {
		network = "tcp6"
	}
	var conn net.Conn
	var err error
	if strings.HasPrefix(addr, "[::ffff:") {
		conn, err = dialMapped(addr)
	} else {
		conn, err = d.Dial(network, addr)
	}
	switch {
	case errors.Is(err, syscall.EPERM):
		return "EPERM"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "ECONNREFUSED"
	case err != nil && os.IsTimeout(err):
		return "timeout"
	case err != nil:
		return "error: " + err.Error()
	}
	defer conn.Close()
	conn.SetReadDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		if os.IsTimeout(err) {
			return "ok, no greeting (timeout)"
		}
		return "ok"
	}
	return "ok: " + strings.TrimSpace(line)
}

// dialMapped connects an AF_INET6 socket to addr, an IPv4-mapped IPv6
// address and port, as a dual-stack client does (Go would use AF_INET).
func dialMapped(addr string) (net.Conn, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, err
	}
	fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	tv := unix.NsecToTimeval((2 * time.Second).Nanoseconds())
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	if err := unix.Connect(fd, &unix.SockaddrInet6{Addr: ap.Addr().As16(), Port: int(ap.Port())}); err != nil {
		unix.Close(fd)
		if errors.Is(err, unix.EINPROGRESS) {
			return nil, os.ErrDeadlineExceeded
		}
		return nil, err
	}
	f := os.NewFile(uintptr(fd), addr)
	defer f.Close()
	return net.FileConn(f)
}

// serve listens on addr and greets every connection with "hello from
// ADDR".
func serve(addr string) int {
	ln, err := net.Listen("tcp4", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("listening")
	for {
		conn, err := ln.Accept()
		if err != nil {
			return 1
		}
		fmt.Fprintf(conn, "hello from %s\n", addr)
		conn.Close()
	}
}

// listen starts greeting servers on addrs in the test process itself
// (outside every pod cgroup).
func listen(t *testing.T, addrs ...string) {
	t.Helper()
	for _, addr := range addrs {
		network := "tcp4"
		if strings.HasPrefix(addr, "[") {
			network = "tcp6"
		}
		ln, err := net.Listen(network, addr)
		if err != nil {
			t.Fatalf("listen %s: %v", addr, err)
		}
		t.Cleanup(func() { ln.Close() })
		go func() {
			for {
				conn, err := ln.Accept()
				if err != nil {
					return
				}
				fmt.Fprintf(conn, "hello from %s\n", addr)
				conn.Close()
			}
		}()
	}
}

// helperIn returns the command that runs this test binary as a helper
// (see runHelper) with env, started inside the cgroup dir (clone3 with
// CLONE_INTO_CGROUP); the caller runs it before the test ends.
func helperIn(t testing.TB, dir string, env ...string) *exec.Cmd {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	// Only needed until the process starts; the test outlives it.
	t.Cleanup(func() { f.Close() })
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(cleanEnv(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd()), Pdeathsig: syscall.SIGKILL}
	return cmd
}

// connectFrom connects to addr from a process in the cgroup dir (from
// source address bind, if set) and returns the outcome (see
// connectOutcome).
func connectFrom(t *testing.T, dir, addr, bind string) string {
	t.Helper()
	out, err := helperIn(t, dir, connectEnv+"="+addr, bindEnv+"="+bind).Output()
	if err != nil {
		t.Fatalf("connect helper in %s: %v: %s", dir, err, out)
	}
	return strings.TrimSpace(string(out))
}

// serveIn starts a greeting server on addr in a process in the cgroup dir.
func serveIn(t *testing.T, dir, addr string) {
	t.Helper()
	cmd := helperIn(t, dir, serveEnv+"="+addr)
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
		t.Fatalf("server on %s in %s: %q %v", addr, dir, line, err)
	}
}

// Pods of the policy test, on node e2e-node. Each has a UID (its kubelet
// cgroup's name), an IP on loopback and labels.
const (
	uidA = "0a0a0a0a-0000-4000-8000-00000000000a"
	uidB = "0b0b0b0b-0000-4000-8000-00000000000b"
	uidC = "0c0c0c0c-0000-4000-8000-00000000000c"
	ipA  = "127.0.1.21"
	ipB  = "127.0.1.22"
	ipC  = "127.0.1.23"
)

const policyPods = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: client-a, namespace: default, uid: ` + uidA + `, labels: {app: client}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipA + `, podIPs: [{ip: ` + ipA + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: server-b, namespace: default, uid: ` + uidB + `, labels: {app: server}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox, ports: [{name: web, containerPort: 9090}]}]}
status: {phase: Running, podIP: ` + ipB + `, podIPs: [{ip: ` + ipB + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client-c, namespace: default, uid: ` + uidC + `, labels: {app: other}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipC + `, podIPs: [{ip: ` + ipC + `}]}
`

// egressA lets client-a reach 127.0.1.11:8080 and 127.0.1.12:8100-8103.
const egressA = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: egress-a, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toCIDR: [127.0.1.11/32]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
  - toCIDRSet: [{cidr: 127.0.1.12/32}]
    toPorts: [{ports: [{port: "8100", endPort: 8103, protocol: TCP}]}]
  - toFQDNs: [{matchName: allowed.e2e.test}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`

// denyA denies client-a 127.0.1.11:8080, which egressA allows.
const denyA = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: deny-a, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egressDeny:
  - toCIDR: [127.0.1.11/32]
    toPorts: [{ports: [{port: "8080"}]}]
`

// ingressB lets app=client pods reach server-b's named port web.
const ingressB = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: ingress-b, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: server}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: web, protocol: TCP}]}]
`

// invalidPolicy has a range that ends before it starts.
const invalidPolicy = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: broken, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: other}}
  egress:
  - toCIDR: [127.0.1.11/32]
    toPorts: [{ports: [{port: "8080", endPort: 80, protocol: TCP}]}]
`

type endpointPolicyRow struct {
	Name    string `json:"name"`
	ID      uint32 `json:"id"`
	Cgroup  string `json:"cgroup"`
	Ingress string `json:"ingress"`
	Egress  string `json:"egress"`
	Entries int    `json:"entries"`
	Status  struct {
		Kind  string `json:"kind"`
		Error string `json:"error"`
	} `json:"status"`
}

// waitEndpointPolicy waits until the policy programs are attached and
// each named endpoint's row reads "ingress egress" as wanted, with its map
// entry written.
func (a *agent) waitEndpointPolicy(t testing.TB, want map[string]string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, "the policy programs attached", func() (bool, string) {
		var health []struct{ Scope, Message string }
		if err := a.dump("health", &health); err != nil {
			return false, err.Error()
		}
		for _, h := range health {
			if h.Scope == "policy.job-attach" {
				return strings.HasPrefix(h.Message, "Enforcing policy"), h.Message
			}
		}
		return false, "no policy.job-attach scope"
	})
	testenv.Eventually(t, waitTimeout, fmt.Sprintf("endpoint-policy %v", want), func() (bool, string) {
		var rows []endpointPolicyRow
		if err := a.dump("endpoint-policy", &rows); err != nil {
			return false, err.Error()
		}
		got := map[string]string{}
		ok := true
		for _, r := range rows {
			if _, asked := want[r.Name]; !asked {
				continue
			}
			got[r.Name] = r.Ingress + " " + r.Egress
			ok = ok && r.Status.Kind == "Done" && r.ID != 0 && r.Cgroup != ""
		}
		return ok && fmt.Sprint(got) == fmt.Sprint(want), fmt.Sprintf("%+v", rows)
	})
}

// mkCgroups makes the kubelet cgroups of the three pods under root, in
// both drivers' layouts, and a container cgroup inside each; it returns
// the container cgroups.
func mkCgroups(t testing.TB, root string) (a, b, c string) {
	t.Helper()
	dirs := []string{
		filepath.Join(root, "kubepods", "pod"+uidA, "ctr"),
		filepath.Join(root, "kubepods", "burstable", "pod"+uidB, "ctr"),
		filepath.Join(root, "kubepods.slice", "kubepods-besteffort.slice",
			"kubepods-besteffort-pod"+strings.ReplaceAll(uidC, "-", "_")+".slice", "ctr"),
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Removed deepest first once the processes in them are gone (the
	// root is testenv's, removed after).
	t.Cleanup(func() {
		for _, d := range dirs {
			for p := d; p != root; p = filepath.Dir(p) {
				removeCgroup(p)
			}
		}
	})
	return dirs[0], dirs[1], dirs[2]
}

// removeCgroup removes a cgroup directory, waiting up to 2 s for the
// processes that were in it to be gone.
func removeCgroup(dir string) {
	deadline := time.Now().Add(2 * time.Second)
	for {
		err := os.Remove(dir)
		if err == nil || errors.Is(err, os.ErrNotExist) || time.Now().After(deadline) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPolicy: the shipped binary enforces CiliumNetworkPolicies on the
// processes of pods' cgroups: egress by connect() (EPERM), port ranges,
// deny over allow, default allow when the policy goes, ingress by the
// peer's identity with a named port, toFQDNs after a DNS answer, an
// invalid policy beside valid ones (failing closed on the pod it selects),
// and enforcement that holds while the agent is stopped and across a
// restart that writes nothing.
func TestPolicy(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	digBin := testenv.RequireProgram(t, "dig")
	root := testenv.Cgroup(t)
	cgA, cgB, cgC := mkCgroups(t, root)
	upstream := startDNSMasq(t,
		"--address=/allowed.e2e.test/127.0.1.31", "--address=/other.e2e.test/127.0.1.32", "--local-ttl=300")
	listen(t, "127.0.1.11:8080", "127.0.1.11:8081", "127.0.1.12:8102", "127.0.1.12:8104",
		"127.0.1.13:8080", "127.0.1.31:8080", "127.0.1.32:8080")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(t, filepath.Join(configDir, "egress-a.yaml"), egressA)
	proxy := net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t)))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root,
		"--dns-proxy-addr=" + proxy, "--dns-upstream=" + upstream,
		"--tofqdns-proxy-response-max-delay=15s",
	}})
	a.waitEndpointPolicy(t, map[string]string{
		"default/client-a": "off default-deny", "default/server-b": "off off", "default/client-c": "off off",
	})
	// The programs cache each cgroup's endpoint until this counter moves:
	// the agent moved it when it started and with each endpoint it wrote
	// (every verdict below is taken with the cache on).
	if gen := endpointsGen(t, a.pinDir); gen < 4 {
		t.Errorf("policy_endpoints_gen is %d after three endpoints were written, want at least 4", gen)
	}

	check := func(t *testing.T, dir, bind string, want map[string]string) {
		t.Helper()
		for _, addr := range slices.Sorted(maps.Keys(want)) {
			got := connectFrom(t, dir, addr, bind)
			if w := want[addr]; got != w && !(w == "ok" && strings.HasPrefix(got, "ok:")) {
				t.Errorf("from %s to %s: %s, want %s", filepath.Base(filepath.Dir(dir)), addr, got, w)
			}
		}
	}

	t.Run("egress", func(t *testing.T) {
		check(t, cgA, "", map[string]string{
			"127.0.1.11:8080": "ok",
			"127.0.1.11:8081": "EPERM", // another port
			"127.0.1.13:8080": "EPERM", // another address
			"127.0.1.12:8102": "ok",    // inside 8100-8103
			"127.0.1.12:8104": "EPERM", // outside it
		})
		// A process outside every pod's cgroup, and a pod no policy
		// selects, are untouched.
		check(t, root, "", map[string]string{"127.0.1.13:8080": "ok"})
		check(t, cgC, "", map[string]string{"127.0.1.13:8080": "ok"})
	})

	t.Run("toFQDNs", func(t *testing.T) {
		if got := dig(t, digBin, proxy, "allowed.e2e.test", false); !slices.Equal(got, []string{"127.0.1.31"}) {
			t.Fatalf("dig allowed.e2e.test: %v", got)
		}
		if got := dig(t, digBin, proxy, "other.e2e.test", false); !slices.Equal(got, []string{"127.0.1.32"}) {
			t.Fatalf("dig other.e2e.test: %v", got)
		}
		// No waiting: the answer was held until the policy allowed it.
		check(t, cgA, "", map[string]string{"127.0.1.31:8080": "ok", "127.0.1.32:8080": "EPERM"})
	})

	t.Run("deny wins, and removing the policies restores default allow", func(t *testing.T) {
		writeFile(t, filepath.Join(configDir, "deny-a.yaml"), denyA)
		testenv.Eventually(t, waitTimeout, "the deny in force", func() (bool, string) {
			got := connectFrom(t, cgA, "127.0.1.11:8080", "")
			return got == "EPERM", got
		})
		check(t, cgA, "", map[string]string{"127.0.1.12:8102": "ok"})
		os.Remove(filepath.Join(configDir, "deny-a.yaml"))
		os.Remove(filepath.Join(configDir, "egress-a.yaml"))
		a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off off"})
		check(t, cgA, "", map[string]string{"127.0.1.11:8080": "ok", "127.0.1.13:8080": "ok"})
	})

	// server-b's server lives for the rest of the test.
	serveIn(t, cgB, ipB+":9090")
	t.Run("ingress by identity on a named port", func(t *testing.T) {
		writeFile(t, filepath.Join(configDir, "ingress-b.yaml"), ingressB)
		writeFile(t, filepath.Join(configDir, "broken.yaml"), invalidPolicy)
		// The invalid policy fails closed: client-c, which it selects, is
		// denied egress (so it does not even reach server-b's ingress).
		a.waitEndpointPolicy(t, map[string]string{"default/server-b": "default-deny off", "default/client-c": "off default-deny"})
		check(t, cgA, ipA, map[string]string{ipB + ":9090": "ok: hello from " + ipB + ":9090"})
		check(t, cgC, ipC, map[string]string{ipB + ":9090": "EPERM"})

		var policies []struct{ Name, Status, Error string }
		if err := a.dump("policies", &policies); err != nil {
			t.Fatal(err)
		}
		found := false
		for _, p := range policies {
			if p.Name == "cnp/default/broken" {
				found = true
				if p.Status != "Error" || !strings.Contains(p.Error, "endPort") {
					t.Errorf("the invalid policy's row: %+v", p)
				}
			}
		}
		if !found {
			t.Errorf("the policies table has no row of the invalid policy: %+v", policies)
		}
		// The agent is unhealthy while a policy is invalid; the next
		// steps start it again and wait for /healthz.
		os.Remove(filepath.Join(configDir, "broken.yaml"))
		a.waitHealthy(t)
		a.waitEndpointPolicy(t, map[string]string{"default/client-c": "off off"})
		check(t, cgC, ipC, map[string]string{ipB + ":9090": "timeout"})
	})

	t.Run("enforcement holds while stopped and across a restart", func(t *testing.T) {
		writeFile(t, filepath.Join(configDir, "egress-a.yaml"), egressA)
		a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny", "default/server-b": "default-deny off"})
		want := map[string]string{"127.0.1.11:8080": "ok", "127.0.1.13:8080": "EPERM"}
		check(t, cgA, "", want)
		a.stop(t)
		check(t, cgA, "", want)
		check(t, cgC, ipC, map[string]string{ipB + ":9090": "timeout"})
		a.start(t)
		a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny", "default/server-b": "default-deny off"})
		a.waitLog(t, "Policy computed")
		check(t, cgA, "", want)
		check(t, cgC, ipC, map[string]string{ipB + ":9090": "timeout"})
		for _, m := range []string{"apiary_policy_map_updates_total", "apiary_policy_map_deletes_total"} {
			if v, err := a.metric(m); err != nil || v != 0 {
				t.Errorf("%s after an unchanged restart: %v %v, want 0", m, v, err)
			}
		}
		out, err := a.bpf("policy", "list")
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out, "egress identity=") || !strings.Contains(out, "TCP/8100-8103 allow") {
			t.Errorf("apiary bpf policy list:\n%s", out)
		}
	})
}

// TestPolicyAfterSocketLB: policy decides on the backend a Service
// connection goes to, not on the Service's address, however the socket LB
// and policy programs came to be attached; and audit mode lets through
// what policy would deny, counting it.
func TestPolicyAfterSocketLB(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	cgA, _, _ := mkCgroups(t, root)
	listen(t, "127.0.1.41:8080", "127.0.1.42:8080")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(t, filepath.Join(configDir, "svc.yaml"), `apiVersion: v1
kind: Service
metadata: {name: api, namespace: default}
spec:
  clusterIP: 10.96.0.20
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: api-1, namespace: default, labels: {kubernetes.io/service-name: api}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["127.0.1.41"], conditions: {ready: true}}]
`)
	writeFile(t, filepath.Join(configDir, "egress-a.yaml"), `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: to-backend, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toCIDR: [127.0.1.41/32]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`)
	// First without the socket LB: its programs come after policy's when
	// it is switched on, and the agent must put policy back last.
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{"--node-name=e2e-node", "--cgroup-root=" + root}})
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny"})
	if got := connectFrom(t, cgA, "127.0.1.41:8080", ""); got != "ok: hello from 127.0.1.41:8080" {
		t.Fatalf("to the backend: %s", got)
	}

	a.restart(t, "--enable-socket-lb")
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny"})
	// The pinned policy links were updated in place, the socket LB's
	// attached after them: the agent moves its own after the socket LB's.
	a.waitLog(t, "Moved a policy program after the other programs of its hook")
	testenv.Eventually(t, waitTimeout, "the Service reached through its allowed backend", func() (bool, string) {
		got := connectFrom(t, cgA, "10.96.0.20:80", "")
		return got == "ok: hello from 127.0.1.41:8080", got
	})
	if got := connectFrom(t, cgA, "127.0.1.42:8080", ""); got != "EPERM" {
		t.Errorf("to an address policy does not allow: %s, want EPERM", got)
	}
	out, err := a.bpf("policy", "list", "--endpoint", "default/client-a", "--server", "http://"+a.addr)
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 2 ||
		!strings.HasPrefix(lines[0], "endpoint ") || !strings.Contains(lines[0], "enforce=egress") ||
		!strings.HasSuffix(lines[1], " TCP/8080 allow") {
		t.Errorf("apiary bpf policy list --endpoint default/client-a:\n%s", out)
	}

	a.restart(t, "--enable-socket-lb", "--policy-audit-mode")
	// The counts are the attached programs' (read once they are).
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny"})
	testenv.Eventually(t, waitTimeout, "audit mode: what policy denies goes through", func() (bool, string) {
		got := connectFrom(t, cgA, "127.0.1.42:8080", "")
		return got == "ok: hello from 127.0.1.42:8080", got
	})
	if n, err := a.labelledMetric(`apiary_policy_decisions_total{direction="egress",verdict="audited"}`); err != nil || n < 1 {
		t.Errorf("audited egress verdicts: %v %v, want at least 1", n, err)
	}

	// --enable-policy=never detaches the programs: nothing is enforced.
	a.restart(t, "--enable-socket-lb", "--enable-policy=never")
	a.waitLog(t, "Disabled (--enable-policy=never); detached policy_sockops, policy_connect4, policy_sendmsg4, policy_connect6, policy_sendmsg6, policy_ingress, policy_egress, "+
		"policy_recvmsg4, policy_getpeername4, policy_recvmsg6, policy_getpeername6")
	if _, err := os.Stat(filepath.Join(a.pinDir, "links", "policy_connect4")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the connect4 link is still pinned: %v", err)
	}
	if got := connectFrom(t, cgA, "127.0.1.42:8080", ""); got != "ok: hello from 127.0.1.42:8080" {
		t.Errorf("with --enable-policy=never: %s", got)
	}
}

// labelledMetric returns the value of one series of /metrics, named with
// its labels as Prometheus prints them.
func (a *agent) labelledMetric(series string) (float64, error) {
	code, body, err := httpGet(a.url("/metrics"))
	if err != nil {
		return 0, err
	}
	if code != 200 {
		return 0, fmt.Errorf("GET /metrics: %d", code)
	}
	for line := range strings.Lines(body) {
		if rest, ok := strings.CutPrefix(line, series+" "); ok {
			return strconv.ParseFloat(strings.TrimSpace(rest), 64)
		}
	}
	return 0, fmt.Errorf("no series %s in /metrics", series)
}

// verdictPolicies let client-a reach 127.0.1.52:8080, and deny it
// 127.0.1.53 in a policy that is only audited: that connection goes
// through, reported as audited.
const verdictPolicies = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: egress-v, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toCIDR: [127.0.1.52/32]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata:
  name: try-deny
  namespace: default
  annotations: {apiary.io/audit: "true"}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egressDeny:
  - toCIDR: [127.0.1.53/32]
`

// TestPolicyVerdicts: `apiary monitor -o json` shows each decided
// connection of a pod, naming the endpoint, the destination, the verdict
// and the policy (or default deny) that decided it; an audited policy lets
// its deny through as audited; the metric and the policies table count
// them per policy.
func TestPolicyVerdicts(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	cgA, _, _ := mkCgroups(t, root)
	listen(t, "127.0.1.51:8080", "127.0.1.52:8080", "127.0.1.53:8080")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(t, filepath.Join(configDir, "policies.yaml"), verdictPolicies)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{"--node-name=e2e-node", "--cgroup-root=" + root}})
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny"})

	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+a.addr)
	// The stream is open once the agent counts a subscriber... which it
	// does not export; a verdict seen proves it, so connect until one is.
	type verdict struct {
		Endpoint, Direction, Src, Dst, Proto, Verdict, Policy, Reason string
		RemoteIdentity                                                uint32
	}
	seen := func(dst, want string) (verdict, bool) {
		for line := range strings.Lines(mon.log.String()) {
			var v verdict
			if json.Unmarshal([]byte(line), &v) == nil && v.Dst == dst && v.Verdict == want {
				return v, true
			}
		}
		return verdict{}, false
	}
	for _, tc := range []struct {
		dst, outcome, verdict, policy, reason string
	}{
		{"127.0.1.51:8080", "EPERM", "denied", "", "default deny"},
		{"127.0.1.52:8080", "ok", "allowed", "cnp/default/egress-v", "policy"},
		{"127.0.1.53:8080", "ok", "audited", "cnp/default/try-deny", "policy"},
	} {
		var v verdict
		testenv.Eventually(t, waitTimeout, "apiary monitor shows "+tc.dst+" "+tc.verdict, func() (bool, string) {
			got := connectFrom(t, cgA, tc.dst, "")
			if got != tc.outcome && !(tc.outcome == "ok" && strings.HasPrefix(got, "ok:")) {
				t.Fatalf("connect to %s: %s, want %s", tc.dst, got, tc.outcome)
			}
			var ok bool
			v, ok = seen(tc.dst, tc.verdict)
			_, metrics, _ := httpGet(a.url("/metrics"))
			var pm []string
			for l := range strings.Lines(metrics) {
				if strings.HasPrefix(l, "apiary_policy_") {
					pm = append(pm, l)
				}
			}
			return ok, mon.log.Tail(5) + "\n" + strings.Join(pm, "")
		})
		if v.Endpoint != "default/client-a" || v.Direction != "egress" || v.Proto != "TCP" ||
			v.Policy != tc.policy || v.Reason != tc.reason || v.RemoteIdentity == 0 {
			t.Errorf("verdict for %s: %+v, want endpoint default/client-a, egress, TCP, policy %q, reason %q",
				tc.dst, v, tc.policy, tc.reason)
		}
	}

	// Counted per policy: the metric and the policies table.
	series := `apiary_policy_verdicts_total{direction="egress",policy="cnp/default/egress-v",verdict="allowed"}`
	if n, err := a.labelledMetric(series); err != nil || n < 1 {
		t.Errorf("%s: %v %v, want at least 1", series, n, err)
	}
	testenv.Eventually(t, waitTimeout, "the policy-status table counts the verdicts", func() (bool, string) {
		var rows []struct {
			Name     string
			Verdicts struct{ Allowed, Denied, Audited uint64 }
		}
		if err := a.dump("policy-status", &rows); err != nil {
			return false, err.Error()
		}
		ok := 0
		for _, r := range rows {
			if (r.Name == "cnp/default/egress-v" && r.Verdicts.Allowed > 0) ||
				(r.Name == "cnp/default/try-deny" && r.Verdicts.Audited > 0) {
				ok++
			}
		}
		return ok == 2, fmt.Sprintf("%+v", rows)
	})
}

// endpointsGen reads the agent's policy_endpoints_gen counter.
func endpointsGen(t *testing.T, pinDir string) uint64 {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, bpf.PolicyEndpointsGenMap), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var gen uint64
	if err := m.Lookup(uint32(0), &gen); err != nil {
		t.Fatal(err)
	}
	return gen
}
