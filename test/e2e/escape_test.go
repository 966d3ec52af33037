package e2e

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Pods of TestPolicyNoWayAround, on node e2e-node.
const (
	uidEsc     = "0e0e0e0e-0000-4000-8000-00000000000e"
	uidLate    = "0f0f0f0f-0000-4000-8000-00000000000f"
	uidHost    = "0d0d0d0d-0000-4000-8000-00000000000d"
	uidStray   = "01010101-0000-4000-8000-000000000001"
	uidOffline = "02020202-0000-4000-8000-000000000002"
	uidFlood   = "03030303-0000-4000-8000-000000000003"
	uidReuse   = "04040404-0000-4000-8000-000000000004"
	ipEsc      = "127.0.4.11"
	ipReuse    = "127.0.4.13"
	// Peers: the policy allows v4Allowed and v6Allowed on port 8080.
	v4Allowed = "127.0.4.21"
	v4Denied  = "127.0.4.22"
	v6Allowed = "fd00:e2::71"
	v6Denied  = "fd00:e2::72"
)

const escapePods = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: esc, namespace: default, uid: ` + uidEsc + `, labels: {app: esc}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipEsc + `, podIPs: [{ip: ` + ipEsc + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: flood, namespace: default, uid: ` + uidFlood + `, labels: {app: flood}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: 127.0.4.12, podIPs: [{ip: 127.0.4.12}]}
---
apiVersion: v1
kind: Pod
metadata: {name: reuse, namespace: default, uid: ` + uidReuse + `, labels: {app: reuse}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipReuse + `, podIPs: [{ip: ` + ipReuse + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: host, namespace: default, uid: ` + uidHost + `, labels: {app: esc}}
spec: {nodeName: e2e-node, hostNetwork: true, containers: [{name: c, image: busybox}]}
status: {phase: Running}
`

// latePod is a second pod of the workload whose IP the kubelet has not
// reported yet.
const latePod = `apiVersion: v1
kind: Pod
metadata: {name: late, namespace: default, uid: ` + uidLate + `, labels: {app: esc}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Pending}
`

// escapePolicy: app=esc may reach one IPv4 and one IPv6 address on 8080.
const escapePolicy = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: esc, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: esc}}
  egress:
  - toCIDR: [` + v4Allowed + `/32, "` + v6Allowed + `/128"]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: reuse, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: reuse}}
  egress:
  - toCIDR: [` + v4Allowed + `/32]
    toPorts: [{ports: [{port: "8090", protocol: TCP}]}]
  ingress:
  - fromCIDR: [192.0.2.1/32]
`

// addLoopback6 puts IPv6 addresses on lo until the test ends.
func addLoopback6(t *testing.T, addrs ...string) {
	t.Helper()
	testenv.RequireProgram(t, "ip")
	for _, a := range addrs {
		if out, err := exec.Command("ip", "-6", "addr", "add", a+"/128", "dev", "lo", "nodad").CombinedOutput(); err != nil {
			t.Fatalf("ip -6 addr add %s: %v: %s", a, err, out)
		}
		t.Cleanup(func() { exec.Command("ip", "-6", "addr", "del", a+"/128", "dev", "lo").Run() })
	}
}

// TestPolicyNoWayAround: ways a process in a pod could get around its
// egress policy, each closed on the shipped binary: IPv6 (the same policy
// holds, an IPv6 CIDR allows), an IPv4 address written as ::ffff:a.b.c.d on
// a dual-stack socket (EPERM at once), a pod cgroup the agent has not
// classified (denied, also while the agent is down), a pod whose IP is not
// reported yet (enforced by its labels' identity from its first
// connection). A host-network pod, the host's, is not enforced.
func TestPolicyNoWayAround(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	addLoopback6(t, v6Allowed, v6Denied)
	root := testenv.Cgroup(t)
	mk := func(uid string) string {
		t.Helper()
		dir := filepath.Join(root, "kubepods", "besteffort", "pod"+uid, "ctr")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			for p := dir; p != root; p = filepath.Dir(p) {
				removeCgroup(p)
			}
		})
		return dir
	}
	cgEsc, cgHost, cgStray := mk(uidEsc), mk(uidHost), mk(uidStray)
	cgFlood, cgReuse := mk(uidFlood), mk(uidReuse)
	listen(t, v4Allowed+":8080", v4Denied+":8080", "["+v6Allowed+"]:8080", "["+v6Denied+"]:8080", "[::1]:8089")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), escapePods)
	writeFile(t, filepath.Join(configDir, "policy.yaml"), escapePolicy)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{"--node-name=e2e-node", "--cgroup-root=" + root}})
	a.waitEndpointPolicy(t, map[string]string{
		"default/esc": "off default-deny", "default/host": "off off", "default/flood": "off off",
		"default/reuse": "default-deny default-deny",
	})

	check := func(t *testing.T, who, dir string, want map[string]string) {
		t.Helper()
		for addr, w := range want {
			got := connectFrom(t, dir, addr, "")
			if got != w && !(w == "ok" && strings.HasPrefix(got, "ok:")) {
				t.Errorf("%s to %s: %s, want %s", who, addr, got, w)
			}
		}
	}

	t.Run("IPv6 and IPv4-mapped addresses meet the same policy", func(t *testing.T) {
		check(t, "esc", cgEsc, map[string]string{
			v4Allowed + ":8080":               "ok",
			v4Denied + ":8080":                "EPERM",
			"[" + v6Allowed + "]:8080":        "ok",
			"[" + v6Denied + "]:8080":         "EPERM",
			"[::1]:8089":                      "EPERM",
			"[::ffff:" + v4Denied + "]:8080":  "EPERM",
			"[::ffff:" + v4Allowed + "]:8080": "ok",
		})
	})

	t.Run("one pod's flood leaves another's connection working", func(t *testing.T) {
		// esc serves; its replies pass its egress default deny only as
		// the accepted connection's flow.
		cmd := helperIn(t, cgEsc, echoEnv+"="+ipEsc+":9091")
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "listening\n" {
			t.Fatalf("echo server in esc: %q %v", line, err)
		}
		conn, err := net.DialTimeout("tcp4", ipEsc+":9091", 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		r := bufio.NewReader(conn)
		pingPong := func(when string) {
			t.Helper()
			conn.SetDeadline(time.Now().Add(2 * time.Second))
			io.WriteString(conn, "ping\n")
			if line, err := r.ReadString('\n'); err != nil || line != "pong\n" {
				t.Errorf("%s: %q %v, want pong", when, line, err)
			}
		}
		pingPong("before the flood")
		if out, err := helperIn(t, cgFlood, floodEnv+"=200000").Output(); err != nil || string(out) != "sent\n" {
			t.Fatalf("flood: %q %v", out, err)
		}
		pingPong("after 200,000 datagrams from another pod")
	})

	t.Run("a listener does not inherit its socket's flow", func(t *testing.T) {
		peer := v4Allowed + ":8090"
		ln, err := net.Listen("tcp4", peer)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			if c, err := ln.Accept(); err == nil {
				io.WriteString(c, "hello\n")
				c.Close()
			}
		}()
		local := ipReuse + ":9092"
		cmd := helperIn(t, cgReuse, reuseEnv+"="+peer, bindEnv+"="+local)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "listening\n" {
			t.Fatalf("connect, then listen on the same socket: %q %v", line, err)
		}
		ln.Close()
		// The peer the socket had a flow with, from the port it had.
		d := net.Dialer{Timeout: 2 * time.Second, LocalAddr: net.TCPAddrFromAddrPort(netip.MustParseAddrPort(peer))}
		c, err := d.Dial("tcp4", local)
		if err == nil {
			c.Close()
			t.Fatalf("the old peer reached the reused listener; want it denied by ingress")
		}
		if !os.IsTimeout(err) {
			t.Errorf("the old peer into the reused listener: %v, want a timeout (dropped by ingress)", err)
		}
	})

	t.Run("a host-network pod is the host's", func(t *testing.T) {
		check(t, "the host-network pod", cgHost, map[string]string{v4Denied + ":8080": "ok", "[" + v6Denied + "]:8080": "ok"})
	})

	t.Run("an unclassified pod cgroup is denied", func(t *testing.T) {
		check(t, "a pod cgroup no Pod names", cgStray, map[string]string{v4Allowed + ":8080": "EPERM", "[" + v6Allowed + "]:8080": "EPERM"})
		// Outside the kubelet's tree, nothing changes.
		check(t, "a process outside the pods", root, map[string]string{v4Denied + ":8080": "ok"})
		out, err := a.bpf("policy", "list")
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out, "pod tree cgroup") {
			t.Errorf("apiary bpf policy list shows no pod tree:\n%s", out)
		}
	})

	t.Run("a pod without an IP yet is enforced from its first connection", func(t *testing.T) {
		cgLate := mk(uidLate)
		// Unclassified until the agent knows it: denied, not open.
		check(t, "the new pod", cgLate, map[string]string{v4Allowed + ":8080": "EPERM"})
		writeFile(t, filepath.Join(configDir, "late.yaml"), latePod)
		a.waitEndpointPolicy(t, map[string]string{"default/late": "off default-deny"})
		check(t, "the new pod", cgLate, map[string]string{v4Allowed + ":8080": "ok", v4Denied + ":8080": "EPERM"})
	})

	t.Run("a pod started while the agent is down waits for it", func(t *testing.T) {
		a.stop(t)
		cgOffline := mk(uidOffline)
		check(t, "a pod started while the agent is down", cgOffline, map[string]string{v4Allowed + ":8080": "EPERM"})
		check(t, "esc while the agent is down", cgEsc, map[string]string{v4Allowed + ":8080": "ok", v4Denied + ":8080": "EPERM"})
		writeFile(t, filepath.Join(configDir, "offline.yaml"), strings.ReplaceAll(strings.ReplaceAll(latePod,
			uidLate, uidOffline), "name: late", "name: offline"))
		a.start(t)
		a.waitEndpointPolicy(t, map[string]string{"default/offline": "off default-deny"})
		check(t, "the pod once the agent is back", cgOffline, map[string]string{v4Allowed + ":8080": "ok", v4Denied + ":8080": "EPERM"})
	})
}

// Environment variables of the helpers of TestPolicyNoWayAround.
const (
	// echoEnv: listen on the address and answer every line with "pong".
	echoEnv = "E2E_ECHO"
	// floodEnv: send that many datagrams, each to a peer of its own.
	floodEnv = "E2E_FLOOD"
	// reuseEnv: connect from E2E_BIND (address:port) to the address,
	// read its greeting, disconnect the socket (AF_UNSPEC) and listen on
	// it, greeting whoever connects.
	reuseEnv = "E2E_REUSE"
)

// runEscapeHelper runs the helper the environment asks for, if any.
func runEscapeHelper() (int, bool) {
	if addr := os.Getenv(echoEnv); addr != "" {
		return echo(addr), true
	}
	if n := os.Getenv(floodEnv); n != "" {
		return flood(n), true
	}
	if addr := os.Getenv(reuseEnv); addr != "" {
		return reuse(addr, os.Getenv(bindEnv)), true
	}
	return 0, false
}

func echo(addr string) int {
	ln, err := net.Listen("tcp4", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("listening")
	for {
		c, err := ln.Accept()
		if err != nil {
			return 1
		}
		go func() {
			defer c.Close()
			r := bufio.NewReader(c)
			for {
				if _, err := r.ReadString('\n'); err != nil {
					return
				}
				io.WriteString(c, "pong\n")
			}
		}()
	}
}

// flood sends n datagrams from one socket to 127.3.x.y, ports 1000 and up,
// a different peer each.
func flood(n string) int {
	count, err := strconv.Atoi(n)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer unix.Close(fd)
	for i := range count {
		sa := &unix.SockaddrInet4{Addr: [4]byte{127, 3, byte(i >> 8), byte(i)}, Port: 1000 + i%50000}
		if err := unix.Sendto(fd, []byte("x"), 0, sa); err != nil && !errors.Is(err, unix.ECONNREFUSED) {
			fmt.Fprintf(os.Stderr, "datagram %d: %v\n", i, err)
			return 1
		}
	}
	fmt.Println("sent")
	return 0
}

func reuse(dst, local string) int {
	fail := func(err error) int { fmt.Println("error:", err); return 1 }
	d, l := netip.MustParseAddrPort(dst), netip.MustParseAddrPort(local)
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fail(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: l.Addr().As4(), Port: int(l.Port())}); err != nil {
		return fail(err)
	}
	if err := unix.Connect(fd, &unix.SockaddrInet4{Addr: d.Addr().As4(), Port: int(d.Port())}); err != nil {
		return fail(err)
	}
	buf := make([]byte, 64)
	if _, err := testenv.IgnoringEINTR(func() (int, error) { return unix.Read(fd, buf) }); err != nil {
		return fail(err)
	}
	unspec := [16]byte{} // struct sockaddr with sa_family AF_UNSPEC
	if _, _, errno := unix.Syscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&unspec[0])), uintptr(len(unspec))); errno != 0 {
		return fail(fmt.Errorf("disconnect: %w", errno))
	}
	if err := unix.Listen(fd, 8); err != nil {
		return fail(err)
	}
	fmt.Println("listening")
	for {
		c, _, err := unix.Accept(fd)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return 1
		}
		unix.Write(c, []byte("hello from the reused socket\n"))
		unix.Close(c)
	}
}
