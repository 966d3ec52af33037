package e2e

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Helpers of TestDNSBypassInPodNetns, run in a pod (see runHelper).
const (
	// rawDNSEnv: send one DNS query for A records from a SOCK_RAW
	// IPPROTO_UDP socket (the kernel writes the IP header, the helper the
	// UDP one): "srcport>dst:port:name". Prints "ok" or the send's error.
	rawDNSEnv = "E2E_RAW_DNS"
	// udpcDNSEnv: connect a UDP socket to the resolver it names
	// ("dst:port"), then for each name read on stdin send a query on it
	// and print "rcode=R ips=A,B" or the error (EPERM, timeout).
	udpcDNSEnv = "E2E_UDPC_DNS"
)

func runDNSBypassHelper() (int, bool) {
	if spec := os.Getenv(rawDNSEnv); spec != "" {
		fmt.Println(errWord(rawDNS(spec)))
		return 0, true
	}
	if dst := os.Getenv(udpcDNSEnv); dst != "" {
		return reportErr(udpcDNS(dst)), true
	}
	if spec := os.Getenv(freebindDNSEnv); spec != "" {
		fmt.Println(errWord(freebindDNS(spec)))
		return 0, true
	}
	return 0, false
}

// errWord says how a send ended: ok, EPERM, timeout or the error.
func errWord(err error) string {
	var nerr net.Error
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, unix.EPERM):
		return "EPERM"
	case errors.As(err, &nerr) && nerr.Timeout():
		return "timeout"
	}
	return "error: " + err.Error()
}

func dnsQueryWire(name string) ([]byte, error) {
	return new(dns.Msg).SetQuestion(dns.Fqdn(name), dns.TypeA).Pack()
}

// rawDNS sends a query from a raw socket: no connect or sendmsg hook of a
// UDP socket sees it, only the cgroup's packet hook.
func rawDNS(spec string) error {
	sport, rest, ok := strings.Cut(spec, ">")
	f := strings.SplitN(rest, ":", 3)
	if !ok || len(f) != 3 {
		return fmt.Errorf("bad spec %q", spec)
	}
	sp, err := strconv.Atoi(sport)
	if err != nil {
		return err
	}
	dp, err := strconv.Atoi(f[1])
	if err != nil {
		return err
	}
	wire, err := dnsQueryWire(f[2])
	if err != nil {
		return err
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	// The UDP checksum 0: none, which IPv4 allows.
	b := make([]byte, 8+len(wire))
	binary.BigEndian.PutUint16(b[0:], uint16(sp))
	binary.BigEndian.PutUint16(b[2:], uint16(dp))
	binary.BigEndian.PutUint16(b[4:], uint16(len(b)))
	copy(b[8:], wire)
	return unix.Sendto(fd, b, 0, &unix.SockaddrInet4{Addr: netip.MustParseAddr(f[0]).As4()})
}

// udpcDNS keeps one connected UDP socket and queries on it, a name per
// line of stdin.
func udpcDNS(dst string) error {
	c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(netip.MustParseAddrPort(dst)))
	if err != nil {
		return err
	}
	defer c.Close()
	fmt.Println("connected")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		fmt.Println(udpcQuery(c, sc.Text()))
	}
	return sc.Err()
}

func udpcQuery(c *net.UDPConn, name string) string {
	wire, err := dnsQueryWire(name)
	if err != nil {
		return "error: " + err.Error()
	}
	if _, err := c.Write(wire); err != nil {
		return errWord(err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, dns.MaxMsgSize)
	n, err := c.Read(buf)
	if err != nil {
		return errWord(err)
	}
	var r dns.Msg
	if err := r.Unpack(buf[:n]); err != nil {
		return "error: " + err.Error()
	}
	var ips []string
	for _, rr := range r.Answer {
		if a, ok := rr.(*dns.A); ok {
			ips = append(ips, a.A.String())
		}
	}
	return fmt.Sprintf("rcode=%s ips=%s", dns.RcodeToString[r.Rcode], strings.Join(ips, ","))
}

// Addresses of TestDNSBypassInPodNetns, as TestDNSInterceptionInPodNetns's.
const (
	uidBypass = "1d5d1d5d-0000-4000-8000-00000000005d"
	bypGw4    = "10.236.0.1"
	bypGw6    = "fd00:e6::1"
	bypPod4   = "10.236.0.11"
	bypPod6   = "fd00:e6::11"
)

// bypassPodRule is bypassPod with a DNS rule.
const bypassPodRule = bypassPod + `      rules: {dns: [{matchPattern: "*.allowed.test"}]}
`

// bypassPod is a pod with a policy that opens its resolver on port 53 but
// has no DNS rule.
const bypassPod = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: ifdns, namespace: default, uid: ` + uidBypass + `, labels: {app: ifdns}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + bypPod4 + `, podIPs: [{ip: ` + bypPod4 + `}, {ip: "` + bypPod6 + `"}]}
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: ifdns, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: ifdns}}
  egress:
  - toEntities: [host]
    toPorts:
    - ports: [{port: "53", protocol: ANY}]
`

// TestDNSBypassInPodNetns: DNS of a pod with DNS rules that does not go
// through the DNS proxy is dropped, although its L4 policy allows the
// resolver, and reported as "dns bypass": a UDP socket connected to the
// resolver before the DNS rule existed can no longer send on it (its flow
// is known to the socket, which the drop does not consult); a query from
// a raw socket is dropped at the cgroup's egress hook (the send fails with
// EPERM); a query written on a packet socket, past every hook of the pod,
// is dropped on the host side of its interface. Ordinary queries are
// answered by the proxy all along.
func TestDNSBypassInPodNetns(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	digBin := testenv.RequireProgram(t, "dig")
	dnsmasq := testenv.RequireProgram(t, "dnsmasq", "/usr/sbin")
	root := testenv.Cgroup(t)
	pod := makeIfPodVia(t, root, uidBypass, "ifb53", bypGw4, bypGw6, bypPod4, bypPod6)
	resolverLog := startProcess(t, "dnsmasq", nil, dnsmasq,
		"--keep-in-foreground", "--conf-file=/dev/null", "--pid-file",
		"--no-resolv", "--no-hosts", "--listen-address="+bypGw4, "--bind-interfaces",
		"--port=53", "--log-queries", "--log-facility=-", "--address=/allowed.test/"+dnsAllowed,
		"--address=/denied.test/10.233.1.3")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), bypassPod)
	proxyPort := freePort(t)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + bypGw4,
		"--dns-proxy-addr=" + net.JoinHostPort(bypGw4, strconv.Itoa(proxyPort)), "--dns-upstream=127.0.0.1:1",
	}})
	a.waitPodInterfaces(t, map[string]string{"default/ifdns": pod.hostIf})
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")
	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+a.addr)

	// A socket connected to the resolver while the pod has no DNS rule:
	// answered by the resolver itself.
	resolver := bypGw4 + ":53"
	udpc := pod.command(t, true, []string{udpcDNSEnv + "=" + resolver})
	in, err := udpc.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := udpc.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	udpc.Stderr = os.Stderr
	if err := udpc.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); udpc.Process.Kill(); udpc.Wait() })
	lines := bufio.NewReader(out)
	ask := func(name string) string {
		t.Helper()
		fmt.Fprintln(in, name)
		line, err := lines.ReadString('\n')
		if err != nil {
			t.Fatalf("connected-socket helper: %v", err)
		}
		return strings.TrimSpace(line)
	}
	if line, err := lines.ReadString('\n'); strings.TrimSpace(line) != "connected" {
		t.Fatalf("connected-socket helper: %q %v", line, err)
	}
	testenv.Eventually(t, waitTimeout, "the connected socket answered by the resolver", func() (bool, string) {
		got := ask("www.denied.test")
		return got == "rcode=NOERROR ips=10.233.1.3", got
	})

	// The DNS rule arrives; the proxy answers new queries.
	writeFile(t, filepath.Join(configDir, "pods.yaml"), bypassPodRule)
	dig := func(name string) string {
		o, _ := pod.command(t, true, nil, digBin, "@"+bypGw4, name, "A", "+time=5", "+tries=1").CombinedOutput()
		status, ips := answerOf(string(o))
		if status == "" {
			return "no answer: " + strings.TrimSpace(string(o))
		}
		return status + " " + fmt.Sprint(ips)
	}
	testenv.Eventually(t, waitTimeout, "a new query refused by the DNS rule", func() (bool, string) {
		got := dig("www.denied.test")
		return got == "REFUSED []", got
	})

	// The old socket no longer reaches the resolver past the proxy.
	if got := ask("www.denied.test"); got != "EPERM" {
		t.Errorf("the socket connected before the DNS rule: %s, want EPERM (dropped as a dns bypass)", got)
	}
	bypass := func(what, layer, dst string) {
		t.Helper()
		testenv.Eventually(t, waitTimeout, what+" reported as a dns bypass", func() (bool, string) {
			for line := range strings.Lines(mon.log.String()) {
				var v struct{ Endpoint, Verdict, Reason, Layer, Dst, Proto string }
				if json.Unmarshal([]byte(line), &v) == nil && v.Reason == "dns bypass" && v.Layer == layer && v.Dst == dst {
					if v.Endpoint != "default/ifdns" || v.Verdict != "denied" || v.Proto != "UDP" {
						t.Fatalf("%s: %s", what, line)
					}
					return true, line
				}
			}
			return false, mon.log.Tail(5)
		})
	}
	bypass("the connected socket's query", "socket", resolver)

	// A raw socket: the cgroup's egress hook drops it.
	if got := pod.run(t, true, rawDNSEnv+"=40053>"+resolver+":raw.denied.test"); got != "EPERM" {
		t.Errorf("a query from a raw socket: %s, want EPERM (dropped as a dns bypass)", got)
	}
	// A packet socket: the interface drops it.
	mac, err := net.InterfaceByName(pod.hostIf)
	if err != nil {
		t.Fatal(err)
	}
	pod.run(t, true, pktMACEnv+"="+mac.HardwareAddr.String(), pktDNSEnv+"="+bypPod4+">"+resolver+":pkt.denied.test")
	bypass("a packet socket's query", "interface", resolver)

	// The proxy still answers, and the resolver never saw the bypasses:
	// it logs queries in order, and this one comes after them.
	if got := dig("www.allowed.test"); got != "NOERROR ["+dnsAllowed+"]" {
		t.Errorf("an allowed name after the bypasses: %s", got)
	}
	if got := dig("last.allowed.test"); got != "NOERROR ["+dnsAllowed+"]" {
		t.Errorf("an allowed name after the bypasses: %s", got)
	}
	testenv.Eventually(t, waitTimeout, "the resolver logs the last query", func() (bool, string) {
		return strings.Contains(resolverLog.log.String(), "last.allowed.test"), resolverLog.log.Tail(5)
	})
	for _, name := range []string{"raw.denied.test", "pkt.denied.test"} {
		if strings.Contains(resolverLog.log.String(), name) {
			t.Errorf("the resolver got the bypassing query for %s:\n%s", name, resolverLog.log.Tail(20))
		}
	}
}

// freebindDNSEnv: send one DNS query for A records ("src:port>dst:port:name")
// from a UDP socket bound with IP_FREEBIND and IP_TRANSPARENT to src, which
// need not be the pod's address. Prints "ok" or the send's error.
const freebindDNSEnv = "E2E_FREEBIND_DNS"

func freebindDNS(spec string) error {
	src, rest, ok := strings.Cut(spec, ">")
	f := strings.SplitN(rest, ":", 3)
	if !ok || len(f) != 3 {
		return fmt.Errorf("bad spec %q", spec)
	}
	sap := netip.MustParseAddrPort(src)
	dst := netip.MustParseAddrPort(f[0] + ":" + f[1])
	wire, err := dnsQueryWire(f[2])
	if err != nil {
		return err
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	// IP_FREEBIND lets the socket bind the address; IP_TRANSPARENT lets
	// its datagrams leave from it (a route lookup from a source that is
	// not local fails without it). A pod with CAP_NET_ADMIN has both.
	for _, opt := range []int{unix.IP_FREEBIND, unix.IP_TRANSPARENT} {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IP, opt, 1); err != nil {
			return err
		}
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: sap.Addr().As4(), Port: int(sap.Port())}); err != nil {
		return err
	}
	return unix.Sendto(fd, wire, 0, &unix.SockaddrInet4{Addr: dst.Addr().As4(), Port: int(dst.Port())})
}

// Pods of TestDNSOriginFreebind: the attacker x (with a DNS rule that
// allows every name) and the victim v (no policy), each behind its veth.
const (
	uidFbX  = "1e5e1e5e-0000-4000-8000-00000000005e"
	uidFbV  = "1f5f1f5f-0000-4000-8000-00000000005f"
	fbGwX4  = "10.236.1.1"
	fbX4    = "10.236.1.11"
	fbGwV4  = "10.236.2.1"
	fbV4    = "10.236.2.11"
	fbEvil  = "10.236.9.9" // what the attacker's resolver answers
	fbGood  = "10.236.8.8" // what the proxy's upstream answers
	fbPorts = `[{port: "53", protocol: ANY}]`
)

const fbPods = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: fbx, namespace: default, uid: ` + uidFbX + `, labels: {app: fbx}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + fbX4 + `, podIPs: [{ip: ` + fbX4 + `}, {ip: "fd00:e6:1::11"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: fbv, namespace: default, uid: ` + uidFbV + `, labels: {app: fbv}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + fbV4 + `, podIPs: [{ip: ` + fbV4 + `}, {ip: "fd00:e6:2::11"}]}
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: fbx, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: fbx}}
  egress:
  - toEntities: [host]
    toPorts:
    - ports: ` + fbPorts + `
      rules: {dns: [{matchPattern: "*"}]}
`

// TestDNSOriginFreebind: a pod with a DNS rule binds a UDP socket with
// IP_FREEBIND (and IP_TRANSPARENT) to another pod's address and port and sends a query to a
// resolver it controls. Its packet is dropped on its interface as
// spoofed, but the socket's hook published the origin entry for the
// other pod's address and port; the proxy must not use it for the other
// pod's query from that port (sent to the proxy directly), which goes to
// the proxy's upstream, not to the attacker's resolver.
func TestDNSOriginFreebind(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	digBin := testenv.RequireProgram(t, "dig")
	dnsmasq := testenv.RequireProgram(t, "dnsmasq", "/usr/sbin")
	root := testenv.Cgroup(t)
	x := makeIfPodVia(t, root, uidFbX, "fbx", fbGwX4, "fd00:e6:1::1", fbX4, "fd00:e6:1::11")
	v := makeIfPodVia(t, root, uidFbV, "fbv", fbGwV4, "fd00:e6:2::1", fbV4, "fd00:e6:2::11")
	dnsmasqOn := func(name, addr, port, answer string) {
		startProcess(t, name, nil, dnsmasq,
			"--keep-in-foreground", "--conf-file=/dev/null", "--pid-file",
			"--no-resolv", "--no-hosts", "--listen-address="+addr, "--bind-interfaces",
			"--port="+port, "--address=/#/"+answer)
	}
	dnsmasqOn("evil resolver", fbGwX4, "53", fbEvil)
	upstream := freePort(t)
	dnsmasqOn("upstream", "127.0.0.1", strconv.Itoa(upstream), fbGood)

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), fbPods)
	proxyPort := strconv.Itoa(freePort(t))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + fbGwV4 + "," + fbGwX4,
		"--dns-proxy-addr=" + net.JoinHostPort(fbGwV4, proxyPort),
		"--dns-upstream=127.0.0.1:" + strconv.Itoa(upstream),
	}})
	a.waitPodInterfaces(t, map[string]string{"default/fbx": x.hostIf, "default/fbv": v.hostIf})
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")

	// The victim asks the proxy directly, from a port of its own.
	const vPort = "41053"
	ask := func() string {
		o, _ := v.command(t, true, nil, digBin, "@"+fbGwV4, "-p", proxyPort, "-b", fbV4+"#"+vPort,
			"www.example.test", "A", "+time=5", "+tries=1").CombinedOutput()
		status, ips := answerOf(string(o))
		return status + " " + fmt.Sprint(ips)
	}
	want := "NOERROR [" + fbGood + "]"
	testenv.Eventually(t, waitTimeout, "the victim answered by the proxy's upstream", func() (bool, string) {
		got := ask()
		return got == want, got
	})
	// The attacker's hook runs and its DNS rule is in force: its own
	// queries reach its resolver through the proxy.
	testenv.Eventually(t, waitTimeout, "the attacker's query answered by its resolver", func() (bool, string) {
		o, _ := x.command(t, true, nil, digBin, "@"+fbGwX4, "www.example.test", "A", "+time=5", "+tries=1").CombinedOutput()
		status, ips := answerOf(string(o))
		got := status + " " + fmt.Sprint(ips)
		return got == "NOERROR ["+fbEvil+"]", got
	})
	for range 3 {
		if got := x.run(t, true, freebindDNSEnv+"="+fbV4+":"+vPort+">"+fbGwX4+":53:www.example.test"); got != "ok" {
			t.Fatalf("the attacker's send: %s", got)
		}
		if got := ask(); got != want {
			t.Fatalf("the victim's query after the attacker published its origin: %s, want %s", got, want)
		}
	}
}
