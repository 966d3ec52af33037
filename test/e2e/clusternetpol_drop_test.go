package e2e

// A ClusterNetworkPolicy Deny drops (network-policy-api: "Deny: Drops the
// selected traffic"): where a pod's interface is enforced, the socket
// hooks let its connect() and sendmsg() through and the interface drops
// the packets, whatever made them.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Pods of TestClusterNetworkPolicyDrop, each in a network namespace of
// its own (see makeIfPodVia).
const (
	uidCNDropA = "38383838-0000-4000-8000-0000000000da"
	uidCNDropB = "38383838-0000-4000-8000-0000000000db"
	cnDropGw4  = "10.239.0.1"
	cnDropA4   = "10.239.0.11"
	cnDropB4   = "10.239.0.12"
	cnDropGw6  = "fd00:e39::1"
	cnDropA6   = "fd00:e39::11"
	cnDropB6   = "fd00:e39::12"
)

// rawUDPSendEnv: send UDP datagrams from a SOCK_RAW socket (the kernel
// makes the IP header, the helper the UDP one), each "dst:port:payload",
// separated by ";".
const rawUDPSendEnv = "E2E_RAW_UDP_SEND"

// runCNDropHelper runs the helper of this file the environment asks for.
func runCNDropHelper() (int, bool) {
	if spec := os.Getenv(rawUDPSendEnv); spec != "" {
		return reportErr(rawUDPSend(spec)), true
	}
	return 0, false
}

// rawUDPSend sends each datagram of spec (IPv4) from a raw socket.
func rawUDPSend(spec string) error {
	grams, err := parseDatagrams(spec)
	if err != nil {
		return err
	}
	if err := oneCPU(); err != nil {
		return err
	}
	for _, g := range grams {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
		if err != nil {
			return fmt.Errorf("raw socket: %w", err)
		}
		// Checksum 0: none, which IPv4 allows.
		err = unix.Sendto(fd, udpHeader(40000, g.port, g.payload), 0, &unix.SockaddrInet4{Addr: g.dst.As4()})
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("send to %s:%d: %w", g.dst, g.port, err)
		}
	}
	fmt.Println("sent")
	return nil
}

const clusterNetpolDropPods = `apiVersion: v1
kind: Namespace
metadata: {name: cn-drop, labels: {tenant: drop}}
---
apiVersion: v1
kind: Pod
metadata: {name: cda, namespace: cn-drop, uid: ` + uidCNDropA + `, labels: {app: cda}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + cnDropA4 + `, podIPs: [{ip: ` + cnDropA4 + `}, {ip: "` + cnDropA6 + `"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: cdb, namespace: cn-drop, uid: ` + uidCNDropB + `, labels: {app: cdb}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + cnDropB4 + `, podIPs: [{ip: ` + cnDropB4 + `}, {ip: "` + cnDropB6 + `"}]}
`

// clusterNetpolDropPolicies: cda may not reach cdb on TCP 7010 and UDP
// 7011 (Admin Deny), nor TCP 7016 (Baseline Deny), nor itself on TCP
// 7014 (Admin Deny: the pod's own address, through lo, which no
// interface sees), nor TCP 7017 to a network holding cdb's address (a
// networks peer matches pods by address); a CNP denies it TCP 7013 to
// cdb (EPERM, as before).
const clusterNetpolDropPolicies = `apiVersion: policy.networking.k8s.io/v1beta1
kind: ClusterNetworkPolicy
metadata: {name: drop}
spec:
  tier: Admin
  priority: 1
  subject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: cda}}}}
  egress:
  - name: drop-tcp
    action: Deny
    to: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: cdb}}}}]
    protocols: [{tcp: {destinationPort: {number: 7010}}}]
  - name: drop-udp
    action: Deny
    to: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: cdb}}}}]
    protocols: [{udp: {destinationPort: {number: 7011}}}]
  - name: drop-by-address
    action: Deny
    to: [{networks: ["10.239.0.12/32"]}]
    protocols: [{tcp: {destinationPort: {number: 7017}}}]
  - name: no-pod-there
    action: Deny
    to: [{networks: [10.239.0.200/32]}]
    protocols: [{tcp: {destinationPort: {number: 7012}}}]
  - name: drop-self
    action: Deny
    to: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: cda}}}}]
    protocols: [{tcp: {destinationPort: {number: 7014}}}]
---
apiVersion: policy.networking.k8s.io/v1beta1
kind: ClusterNetworkPolicy
metadata: {name: base-drop}
spec:
  tier: Baseline
  priority: 1
  subject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: cda}}}}
  egress:
  - name: drop-7016
    action: Deny
    to: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: cdb}}}}]
    protocols: [{tcp: {destinationPort: {number: 7016}}}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: refuse-7013, namespace: cn-drop}
spec:
  endpointSelector: {matchLabels: {app: cda}}
  egressDeny:
  - toEndpoints: [{matchLabels: {app: cdb}}]
    toPorts: [{ports: [{port: "7013", protocol: TCP}]}]
  enableDefaultDeny: {egress: false}
`

// TestClusterNetworkPolicyDrop: a pod whose egress a ClusterNetworkPolicy
// denies sees its TCP connect() time out (not EPERM: the suite of
// network-policy-api takes only a timeout for a denial), its UDP
// datagrams sent without error and lost, as are those of its raw and
// packet sockets: each dropped at its interface, and reported there with
// the rule's name. Baseline Deny drops too; a CNP's deny stays EPERM; a
// connection to the pod's own address, which no interface sees, is
// dropped by the socket level. Where no interface is enforced the same
// Deny is EPERM (TestClusterNetworkPolicy's pods, which have none).
func TestClusterNetworkPolicyDrop(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); err != nil || strings.TrimSpace(string(b)) != "1" {
		testenv.Skip(t, "the host does not forward IPv4 (net.ipv4.ip_forward), so pods cannot reach each other")
	}
	root := testenv.Cgroup(t)
	podA := makeIfPodVia(t, root, uidCNDropA, "cda", cnDropGw4, cnDropGw6, cnDropA4, cnDropA6)
	podB := makeIfPodVia(t, root, uidCNDropB, "cdb", cnDropGw4, cnDropGw6, cnDropB4, cnDropB6)
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), clusterNetpolDropPods)
	writeFile(t, filepath.Join(configDir, "policy.yaml"), clusterNetpolDropPolicies)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root,
		"--node-ips=" + cnDropGw4 + "," + cnDropGw6, "--enable-ipv6",
	}})
	a.waitPodInterfaces(t, map[string]string{"cn-drop/cda": podA.hostIf, "cn-drop/cdb": podB.hostIf})
	a.waitEndpointPolicy(t, map[string]string{"cn-drop/cda": "off default-allow"})
	// The pod side of cda's veth, whose index the socket hooks compare a
	// packet's device with.
	out, err := podA.command(t, false, nil, "cat", "/sys/class/net/eth0/ifindex").Output()
	if err != nil {
		t.Fatal(err)
	}
	eth0 := strings.TrimSpace(string(out))
	testenv.Eventually(t, waitTimeout, "cda's row says its interface is enforced, by eth0's index "+eth0, func() (bool, string) {
		var rows []struct {
			Name       string
			PodIface   bool
			PodIfindex int
		}
		if err := a.dump("endpoint-policy", &rows); err != nil {
			return false, err.Error()
		}
		for _, r := range rows {
			if r.Name == "cn-drop/cda" {
				return r.PodIface && fmt.Sprint(r.PodIfindex) == eth0, fmt.Sprintf("%+v", r)
			}
		}
		return false, fmt.Sprintf("%+v", rows)
	})
	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+a.addr)

	for _, port := range []string{"7010", "7012", "7013", "7016", "7017"} {
		startHelper(t, "server in cdb on "+port, podB.command(t, true, []string{serveEnv + "=" + cnDropB4 + ":" + port}), "listening")
	}
	startHelper(t, "server in cda on 7014", podA.command(t, true, []string{serveEnv + "=" + cnDropA4 + ":7014"}), "listening")

	connect := func(addr string) string {
		out, err := podA.command(t, true, []string{connectEnv + "=" + addr}).Output()
		if err != nil {
			return fmt.Sprintf("helper: %v", err)
		}
		return strings.TrimSpace(string(out))
	}
	t.Run("TCP", func(t *testing.T) {
		for _, c := range []struct{ addr, want, why string }{
			{cnDropB4 + ":7012", "ok: hello from " + cnDropB4 + ":7012", "allowed (a networks Deny of an address no pod has)"},
			{cnDropB4 + ":7010", "timeout", "Admin Deny: dropped"},
			{cnDropB4 + ":7016", "timeout", "Baseline Deny: dropped"},
			{cnDropB4 + ":7013", "EPERM", "a CNP's deny: refused"},
			{cnDropB4 + ":7017", "timeout", "Admin Deny of networks holding cdb's address: dropped"},
			{cnDropA4 + ":7014", "timeout", "Admin Deny of the pod's own address: dropped through lo"},
		} {
			if got := connect(c.addr); got != c.want {
				t.Errorf("cda -> %s (%s): %s, want %s", c.addr, c.why, got, c.want)
				for _, tbl := range []string{"ipcache", "selectors", "policy-entries"} {
					out, _ := a.db("show", tbl)
					t.Logf("%s:\n%s", tbl, out)
				}
			}
		}
	})

	// A packet socket in cdb reports each datagram to it that arrives;
	// a datagram to an allowed port sent after the denied ones on the
	// same path arrives first only if they were dropped.
	l := podB.command(t, true, []string{pktListenEnv + "=" + cnDropB4})
	stdout, err := l.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Process.Kill(); l.Wait() })
	lines := make(chan string, 64)
	go func() {
		s := bufio.NewScanner(stdout)
		for s.Scan() {
			lines <- s.Text()
		}
		close(lines)
	}()
	next := func() string {
		select {
		case line := <-lines:
			return line
		case <-time.After(waitTimeout):
			return "nothing within " + waitTimeout.String()
		}
	}
	if got := next(); got != "listening" {
		t.Fatalf("listener in pod cdb: %q", got)
	}
	for _, c := range []struct {
		what, env, allowed string
		inPod              bool
	}{
		{"a UDP socket (sent without error)", udpSendEnv, "7020", true},
		{"a raw socket", rawUDPSendEnv, "7021", true},
		{"a packet socket", pktSendEnv, "7022", true},
	} {
		spec := cnDropB4 + ":7011:denied;" + cnDropB4 + ":" + c.allowed + ":allowed"
		env := []string{c.env + "=" + spec}
		if c.env == pktSendEnv {
			spec = cnDropA4 + ">" + cnDropB4 + ":7011:denied;" + cnDropA4 + ">" + cnDropB4 + ":" + c.allowed + ":allowed"
			env = []string{c.env + "=" + spec, pktMACEnv + "=" + hostMACOf(t, podA)}
		}
		if out := podA.run(t, c.inPod, env...); out != "sent" {
			t.Errorf("%s: %q, want sent", c.what, out)
		}
		if got := next(); got != "udp "+c.allowed {
			t.Errorf("%s: pod cdb's packet socket first saw %q, want %q: a datagram an Admin Deny denies went through", c.what, got, "udp "+c.allowed)
		}
	}

	testenv.Eventually(t, waitTimeout, "apiary monitor shows cda's drops at its interface by clusternetpol/drop", func() (bool, string) {
		seen := map[string]bool{}
		for line := range strings.Lines(mon.log.String()) {
			var v struct{ Endpoint, Direction, Dst, Verdict, Policy, Layer string }
			if json.Unmarshal([]byte(line), &v) != nil || v.Endpoint != "cn-drop/cda" || v.Verdict != "denied" {
				continue
			}
			seen[v.Layer+" "+v.Dst+" "+v.Policy] = true
		}
		want := []string{
			"interface " + cnDropB4 + ":7010 clusternetpol/drop/drop-tcp",
			"interface " + cnDropB4 + ":7011 clusternetpol/drop/drop-udp",
			"interface " + cnDropB4 + ":7016 clusternetpol/base-drop/drop-7016",
			"socket " + cnDropB4 + ":7013 cnp/cn-drop/refuse-7013",
			"socket " + cnDropA4 + ":7014 clusternetpol/drop/drop-self",
		}
		for _, w := range want {
			if !seen[w] {
				return false, fmt.Sprintf("no %q in %v", w, seen)
			}
		}
		// The socket level let the drops through without an event.
		for k := range seen {
			if strings.HasPrefix(k, "socket "+cnDropB4+":7010") || strings.HasPrefix(k, "socket "+cnDropB4+":7011") {
				return false, "a socket-level denial of a dropped connection: " + k
			}
		}
		return true, ""
	})

	entries, err := a.db("show", "policy-entries")
	if err != nil || !strings.Contains(entries, "drop (final)") {
		t.Errorf("policy-entries shows no drop (final) entry: %v\n%s", err, entries)
	}
}
