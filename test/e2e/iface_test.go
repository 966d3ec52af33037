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
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Pods of TestPolicyPacketLevel, each in a network namespace of its own
// with a veth to the host, as a ptp CNI plugin makes them: the pod's
// address inside, the gateway address on the host side, a /32 (/128)
// route to the pod there.
const (
	uidIfA  = "1a1a1a1a-0000-4000-8000-00000000001a"
	uidIfB  = "1b1b1b1b-0000-4000-8000-00000000001b"
	ifGw4   = "10.231.0.1"
	ifA4    = "10.231.0.11"
	ifB4    = "10.231.0.12"
	ifFake4 = "10.231.0.99"
	ifGw6   = "fd00:e3::1"
	ifA6    = "fd00:e3::11"
	ifB6    = "fd00:e3::12"
	ifFake6 = "fd00:e3::99"
)

const ifacePods = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: ifa, namespace: default, uid: ` + uidIfA + `, labels: {app: ifa}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ifA4 + `, podIPs: [{ip: ` + ifA4 + `}, {ip: "` + ifA6 + `"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: ifb, namespace: default, uid: ` + uidIfB + `, labels: {app: ifb}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ifB4 + `, podIPs: [{ip: ` + ifB4 + `}, {ip: "` + ifB6 + `"}]}
`

// ifacePolicies: ifa may send to the node on UDP 7002 and TCP 8080 only;
// ifb may receive from the node on UDP 7001 and TCP 8080 only.
const ifacePolicies = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: ifa, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: ifa}}
  egress:
  - toEntities: [host]
    toPorts: [{ports: [{port: "7002", protocol: UDP}, {port: "8080", protocol: TCP}]}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: ifb, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: ifb}}
  ingress:
  - fromEntities: [host]
    toPorts: [{ports: [{port: "7001", protocol: UDP}, {port: "8080", protocol: TCP}]}]
`

// Helpers of TestPolicyPacketLevel, run in a pod (see runHelper).
const (
	// pktSendEnv: send UDP datagrams as hand-made IP packets through an
	// AF_PACKET socket on eth0, to the MAC in pktMACEnv; each datagram is
	// "src>dst:port:payload", datagrams separated by ";".
	pktSendEnv = "E2E_PKT_SEND"
	pktMACEnv  = "E2E_PKT_MAC"
	// pktListenEnv: print "udp PORT" for each UDP datagram to the address
	// it names that an AF_PACKET socket on eth0 sees.
	pktListenEnv = "E2E_PKT_LISTEN"
	// udpSendEnv: send datagrams from one ordinary UDP socket, each
	// "dst:port:payload", separated by ";".
	udpSendEnv = "E2E_UDP_SEND"
	// pktDNSEnv: send a DNS query for A records of a name through an
	// AF_PACKET socket, as pktSendEnv: "src>dst:port:name".
	pktDNSEnv = "E2E_PKT_DNS"
)

// pktDNS sends a DNS query made by hand through a packet socket: no
// socket hook sees it, so nothing tells the DNS proxy whom it is for.
func pktDNS(spec, mac string) error {
	grams, err := parseDatagrams(spec)
	if err != nil {
		return err
	}
	q := new(dns.Msg).SetQuestion(dns.Fqdn(grams[0].payload), dns.TypeA)
	wire, err := q.Pack()
	if err != nil {
		return err
	}
	grams[0].payload = string(wire)
	return sendFrames(grams[:1], mac)
}

func runIfaceHelper() (int, bool) {
	if spec := os.Getenv(pktSendEnv); spec != "" {
		return reportErr(pktSend(spec, os.Getenv(pktMACEnv))), true
	}
	if addr := os.Getenv(pktListenEnv); addr != "" {
		return reportErr(pktListen(netip.MustParseAddr(addr))), true
	}
	if spec := os.Getenv(udpSendEnv); spec != "" {
		return reportErr(udpSend(spec)), true
	}
	if spec := os.Getenv(pktDNSEnv); spec != "" {
		return reportErr(pktDNS(spec, os.Getenv(pktMACEnv))), true
	}
	if code, ok := runForgeHelper(); ok {
		return code, true
	}
	return 0, false
}

func reportErr(err error) int {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// datagram is one of a helper's datagrams: "[src>]dst:port:payload".
type datagram struct {
	src, dst netip.Addr
	port     uint16
	payload  string
}

func parseDatagrams(spec string) ([]datagram, error) {
	var out []datagram
	for d := range strings.SplitSeq(spec, ";") {
		var g datagram
		if src, rest, ok := strings.Cut(d, ">"); ok {
			g.src, d = netip.MustParseAddr(src), rest
		}
		// The address may hold colons: port and payload are the last two.
		i := strings.LastIndex(d, ":")
		j := strings.LastIndex(d[:i], ":")
		port, err := strconv.Atoi(d[j+1 : i])
		if err != nil {
			return nil, fmt.Errorf("datagram %q: %w", d, err)
		}
		g.dst, g.port, g.payload = netip.MustParseAddr(d[:j]), uint16(port), d[i+1:]
		out = append(out, g)
	}
	return out, nil
}

// pktSend sends each datagram as an IP packet made by hand, through a
// packet socket: no socket hook sees it.
func pktSend(spec, mac string) error {
	grams, err := parseDatagrams(spec)
	if err != nil {
		return err
	}
	return sendFrames(grams, mac)
}

// sendFrames sends each datagram as an IP packet through a packet socket
// on eth0, to the MAC mac.
func sendFrames(grams []datagram, mac string) error {
	hw, err := net.ParseMAC(mac)
	if err != nil {
		return err
	}
	eth0, err := net.InterfaceByName("eth0")
	if err != nil {
		return err
	}
	if err := oneCPU(); err != nil {
		return err
	}
	for _, g := range grams {
		proto := uint16(unix.ETH_P_IP)
		if g.dst.Is6() {
			proto = unix.ETH_P_IPV6
		}
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, int(htons(proto)))
		if err != nil {
			return fmt.Errorf("packet socket: %w", err)
		}
		sa := &unix.SockaddrLinklayer{Protocol: htons(proto), Ifindex: eth0.Index, Halen: 6}
		copy(sa.Addr[:], hw)
		err = unix.Sendto(fd, udpPacket(g), 0, sa)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("send: %w", err)
		}
	}
	fmt.Println("sent")
	return nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// udpPacket is the IPv4 or IPv6 packet of the datagram g, with its
// checksums.
func udpPacket(g datagram) []byte {
	udp := make([]byte, 8+len(g.payload))
	binary.BigEndian.PutUint16(udp[0:], 40000)
	binary.BigEndian.PutUint16(udp[2:], g.port)
	binary.BigEndian.PutUint16(udp[4:], uint16(len(udp)))
	copy(udp[8:], g.payload)
	src, dst := g.src.AsSlice(), g.dst.AsSlice()
	pseudo := append(append(append([]byte{}, src...), dst...), 0, unix.IPPROTO_UDP, byte(len(udp)>>8), byte(len(udp)))
	sum := inetChecksum(append(pseudo, udp...))
	if sum == 0 {
		sum = 0xffff
	}
	binary.BigEndian.PutUint16(udp[6:], sum)
	if g.dst.Is4() {
		ip := make([]byte, 20)
		ip[0], ip[8], ip[9] = 0x45, 64, unix.IPPROTO_UDP
		binary.BigEndian.PutUint16(ip[2:], uint16(20+len(udp)))
		copy(ip[12:], src)
		copy(ip[16:], dst)
		binary.BigEndian.PutUint16(ip[10:], inetChecksum(ip))
		return append(ip, udp...)
	}
	ip := make([]byte, 40)
	ip[0], ip[6], ip[7] = 0x60, unix.IPPROTO_UDP, 64
	binary.BigEndian.PutUint16(ip[4:], uint16(len(udp)))
	copy(ip[8:], src)
	copy(ip[24:], dst)
	return append(ip, udp...)
}

func inetChecksum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

// pktListen prints the destination port of each UDP packet to addr that a
// packet socket on eth0 receives: what a process with CAP_NET_RAW sees of
// the traffic its sockets' policy would drop.
func pktListen(addr netip.Addr) error {
	eth0, err := net.InterfaceByName("eth0")
	if err != nil {
		return err
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		return fmt.Errorf("packet socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: eth0.Index}); err != nil {
		return err
	}
	fmt.Println("listening")
	buf := make([]byte, 2048)
	for {
		n, from, err := unix.Recvfrom(fd, buf, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		p := buf[:n]
		var dst netip.Addr
		var l4 []byte
		switch {
		case n >= 28 && p[0]>>4 == 4 && p[9] == unix.IPPROTO_UDP:
			dst, l4 = netip.AddrFrom4([4]byte(p[16:20])), p[int(p[0]&0xf)*4:]
		case n >= 48 && p[0]>>4 == 6 && p[6] == unix.IPPROTO_UDP:
			dst, l4 = netip.AddrFrom16([16]byte(p[24:40])), p[40:]
		default:
			continue
		}
		if dst == addr && len(l4) >= 4 {
			fmt.Printf("udp %d\n", binary.BigEndian.Uint16(l4[2:]))
		}
	}
}

// sendTo sends a datagram to each port of addr, in order.
func sendTo(addr string, ports ...string) error {
	for _, port := range ports {
		c, err := net.Dial("udp", net.JoinHostPort(addr, port))
		if err != nil {
			return err
		}
		_, err = c.Write([]byte("datagram"))
		c.Close()
		if err != nil {
			return err
		}
	}
	return nil
}

// oneCPU keeps the calling thread (and the process, when it is the only
// one) on the CPU it runs on: a veth queues what it is given on the
// sending CPU's backlog, so the datagrams of one CPU arrive in the order
// they were sent, which the tests' checks rely on.
func oneCPU() error {
	runtime.LockOSThread()
	var set unix.CPUSet
	set.Set(cpu())
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return fmt.Errorf("pin to a CPU: %w", err)
	}
	return nil
}

func cpu() int {
	var c, node uint32
	if _, _, errno := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&c)), uintptr(unsafe.Pointer(&node)), 0); errno != 0 {
		return 0
	}
	return int(c)
}

// udpSend sends each datagram from one ordinary UDP socket.
func udpSend(spec string) error {
	grams, err := parseDatagrams(spec)
	if err != nil {
		return err
	}
	if err := oneCPU(); err != nil {
		return err
	}
	for _, g := range grams {
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(g.dst, g.port)))
		if err != nil {
			return err
		}
		_, err = c.Write([]byte(g.payload))
		c.Close()
		if err != nil {
			return err
		}
	}
	fmt.Println("sent")
	return nil
}

// ifPod is a pod of TestPolicyPacketLevel: a network namespace with eth0,
// whose peer (hostIf) is on the host, and a cgroup with a process in the
// namespace (as a pod's sandbox would be).
type ifPod struct {
	netns, hostIf, cgroup string
	addr4, addr6          string
}

// ipCmd runs ip with args, failing the test on an error.
func ipCmd(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// makeIfPod makes the pod's namespace, veth, addresses and routes, its
// cgroup under root with a sleeping process in the namespace, and removes
// them when the test ends.
func makeIfPod(t *testing.T, root, uid, name, addr4, addr6 string) *ifPod {
	t.Helper()
	return makeIfPodVia(t, root, uid, name, ifGw4, ifGw6, addr4, addr6)
}

// makeIfPodVia is makeIfPod with the gateway addresses gw4 and gw6 on the
// host side.
func makeIfPodVia(t *testing.T, root, uid, name, gw4, gw6, addr4, addr6 string) *ifPod {
	t.Helper()
	p := &ifPod{
		netns:  fmt.Sprintf("apiary-e2e-%s-%d", name, os.Getpid()),
		hostIf: fmt.Sprintf("e2e%s%d", name, os.Getpid()%100000),
		addr4:  addr4, addr6: addr6,
	}
	ipCmd(t, "netns", "add", p.netns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", p.netns).Run() })
	inNS := func(args ...string) { ipCmd(t, append([]string{"netns", "exec", p.netns}, args...)...) }
	// No duplicate address detection: the addresses are usable at once.
	inNS("sh", "-c", "echo 0 > /proc/sys/net/ipv6/conf/default/accept_dad")
	inNS("ip", "link", "set", "lo", "up")
	ipCmd(t, "link", "add", p.hostIf, "type", "veth", "peer", "name", "eth0", "netns", p.netns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", p.hostIf).Run() })
	if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+p.hostIf+"/accept_dad", []byte("0"), 0o644); err != nil {
		t.Fatal(err)
	}
	ipCmd(t, "addr", "add", gw4+"/32", "dev", p.hostIf)
	ipCmd(t, "-6", "addr", "add", gw6+"/128", "dev", p.hostIf, "nodad")
	ipCmd(t, "link", "set", p.hostIf, "up")
	ipCmd(t, "route", "add", addr4+"/32", "dev", p.hostIf)
	ipCmd(t, "-6", "route", "add", addr6+"/128", "dev", p.hostIf)
	inNS("ip", "addr", "add", addr4+"/32", "dev", "eth0")
	inNS("ip", "-6", "addr", "add", addr6+"/128", "dev", "eth0", "nodad")
	inNS("ip", "link", "set", "eth0", "up")
	inNS("ip", "route", "add", "default", "via", gw4, "dev", "eth0", "onlink")
	inNS("ip", "-6", "route", "add", "default", "via", gw6, "dev", "eth0", "onlink")

	p.cgroup = filepath.Join(root, "kubepods", "besteffort", "pod"+uid)
	if err := os.MkdirAll(p.cgroup, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for d := p.cgroup; d != root; d = filepath.Dir(d) {
			removeCgroup(d)
		}
	})
	sandbox := p.command(t, true, nil, "sleep", "infinity")
	if err := sandbox.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sandbox.Process.Kill(); sandbox.Wait() })
	return p
}

// command returns a command that runs args (the test binary as a helper
// when args is empty) in the pod's network namespace, and in its cgroup
// when inPod (else in the test's: a process that only entered the pod's
// namespace).
func (p *ifPod) command(t *testing.T, inPod bool, env []string, args ...string) *exec.Cmd {
	t.Helper()
	if len(args) == 0 {
		self, err := os.Executable()
		if err != nil {
			t.Fatal(err)
		}
		args = []string{self}
	}
	cmd := exec.Command("ip", append([]string{"netns", "exec", p.netns}, args...)...)
	cmd.Env = append(cleanEnv(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if inPod {
		f, err := os.Open(p.cgroup)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, int(f.Fd())
	}
	return cmd
}

// run runs the test binary as a helper with env in the pod (see command).
func (p *ifPod) run(t *testing.T, inPod bool, env ...string) string {
	t.Helper()
	out, err := p.command(t, inPod, env).CombinedOutput()
	if err != nil {
		t.Fatalf("helper %v in %s: %v: %s", env, p.netns, err, out)
	}
	return strings.TrimSpace(string(out))
}

// udpListener is a UDP socket of the host (the test process) on addr.
type udpListener struct {
	conn *net.UDPConn
	addr string
}

func listenUDP(t *testing.T, addr string) *udpListener {
	t.Helper()
	c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(addr)))
	if err != nil {
		t.Fatalf("listen %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return &udpListener{conn: c, addr: addr}
}

// next returns the next datagram's source address and payload, or fails
// the test when none comes within waitTimeout.
func (l *udpListener) next(t *testing.T) (netip.Addr, string) {
	t.Helper()
	l.conn.SetReadDeadline(time.Now().Add(waitTimeout))
	buf := make([]byte, 1500)
	n, from, err := l.conn.ReadFromUDPAddrPort(buf)
	if err != nil {
		t.Fatalf("read a datagram on %s: %v", l.addr, err)
	}
	return from.Addr().Unmap(), string(buf[:n])
}

// none fails the test if a datagram is waiting. Called once a datagram
// sent after the one it checks has arrived on the same path, so that one
// would have arrived first.
func (l *udpListener) none(t *testing.T, what string) {
	t.Helper()
	rc, err := l.conn.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	l.conn.SetReadDeadline(time.Time{})
	buf := make([]byte, 1500)
	var n int
	var rerr error
	// A read that does not wait: a deadline in the past would not read.
	err = rc.Read(func(fd uintptr) bool {
		n, _, rerr = unix.Recvfrom(int(fd), buf, unix.MSG_DONTWAIT)
		return true
	})
	switch {
	case err != nil:
		t.Fatal(err)
	case rerr == nil:
		t.Errorf("%s: %s got %q", what, l.addr, buf[:n])
	case !errors.Is(rerr, unix.EAGAIN):
		t.Errorf("%s: read %s: %v", what, l.addr, rerr)
	}
}

// TestPolicyPacketLevel: what a process in a pod with its own network
// namespace can do without its sockets' hooks, each judged at the host
// side of its veth by the shipped binary: a packet socket's frame to a
// port its egress policy denies never reaches the host; a packet socket
// in a pod whose ingress policy denies a datagram never sees it; a packet
// with another source address than the pod's is dropped and counted; a
// socket made outside the pod's cgroup meets the pod's policy. Allowed
// traffic and its replies pass; drops are in apiary monitor. IPv4 and
// IPv6. The programs hold while the agent is down, and the test's cases
// fail once they are turned off (--policy-pod-interfaces=false).
func TestPolicyPacketLevel(t *testing.T) {
	t.Parallel()
	for _, attach := range []string{"tcx", "tc"} {
		t.Run(attach, func(t *testing.T) { testPolicyPacketLevel(t, attach) })
	}
}

// testPolicyPacketLevel is TestPolicyPacketLevel with the programs
// attached as attach says (--policy-interface-attach).
func testPolicyPacketLevel(t *testing.T, attach string) {
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	root := testenv.Cgroup(t)
	podA := makeIfPod(t, root, uidIfA, "ifa", ifA4, ifA6)
	podB := makeIfPod(t, root, uidIfB, "ifb", ifB4, ifB6)
	hostMAC := func(p *ifPod) string {
		ifc, err := net.InterfaceByName(p.hostIf)
		if err != nil {
			t.Fatal(err)
		}
		return ifc.HardwareAddr.String()
	}
	listen(t, ifGw4+":8080", "["+ifGw6+"]:8080")
	denied4, allowed4 := listenUDP(t, ifGw4+":7004"), listenUDP(t, ifGw4+":7002")
	denied6, allowed6 := listenUDP(t, "["+ifGw6+"]:7004"), listenUDP(t, "["+ifGw6+"]:7002")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), ifacePods)
	writeFile(t, filepath.Join(configDir, "policies.yaml"), ifacePolicies)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--allow-localhost=policy",
		"--node-ips=" + ifGw4 + "," + ifGw6, "--enable-ipv6", "--policy-interface-attach=" + attach,
	}})
	a.waitPodInterfaces(t, map[string]string{"default/ifa": podA.hostIf, "default/ifb": podB.hostIf})
	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+a.addr)

	fams := []struct {
		name            string
		gw, a, b, fake  string
		denied, allowed *udpListener
		gwPort          func(int) string
	}{
		{"IPv4", ifGw4, ifA4, ifB4, ifFake4, denied4, allowed4, func(p int) string { return ifGw4 + ":" + strconv.Itoa(p) }},
		{"IPv6", ifGw6, ifA6, ifB6, ifFake6, denied6, allowed6, func(p int) string { return "[" + ifGw6 + "]:" + strconv.Itoa(p) }},
	}
	// packetSocket sends, from a packet socket in pod A, a datagram to the
	// denied port, then one to the allowed port: the second arrives, the
	// first never does.
	packetSocket := func(t *testing.T, f int) {
		fam := fams[f]
		podA.run(t, true, pktMACEnv+"="+hostMAC(podA), pktSendEnv+"="+
			fam.a+">"+fam.gw+":7004:denied;"+fam.a+">"+fam.gw+":7002:allowed")
		if from, got := fam.allowed.next(t); got != "allowed" || from.String() != fam.a {
			t.Fatalf("port 7002 got %q from %s, want %q from %s", got, from, "allowed", fam.a)
		}
		fam.denied.none(t, "a packet socket's frame to a port the egress policy denies")
	}

	for f, fam := range fams {
		t.Run(fam.name, func(t *testing.T) {
			// What is allowed goes through, replies included.
			testenv.Eventually(t, waitTimeout, "pod A connects to the node", func() (bool, string) {
				got := podA.run(t, true, connectEnv+"="+fam.gwPort(8080))
				return strings.HasPrefix(got, "ok"), got
			})

			t.Run("packet socket out", func(t *testing.T) { packetSocket(t, f) })

			t.Run("forged source", func(t *testing.T) {
				podA.run(t, true, pktMACEnv+"="+hostMAC(podA), pktSendEnv+"="+
					fam.fake+">"+fam.gw+":7002:forged;"+fam.b+">"+fam.gw+":7002:forged;"+fam.a+">"+fam.gw+":7002:own")
				if from, got := fam.allowed.next(t); got != "own" || from.String() != fam.a {
					t.Errorf("port 7002 first got %q from %s, want %q from %s: a forged packet passed", got, from, "own", fam.a)
				}
			})

			t.Run("socket born outside the pod's cgroup", func(t *testing.T) {
				podA.run(t, false, udpSendEnv+"="+fam.gw+":7004:outside;"+fam.gw+":7002:outside")
				if _, got := fam.allowed.next(t); got != "outside" {
					t.Fatalf("port 7002 got %q, want %q", got, "outside")
				}
				fam.denied.none(t, "a socket made outside the pod's cgroup")
			})

			t.Run("packet socket in", func(t *testing.T) {
				l := podB.command(t, true, []string{pktListenEnv + "=" + fam.b})
				stdout, err := l.StdoutPipe()
				if err != nil {
					t.Fatal(err)
				}
				if err := l.Start(); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { l.Process.Kill(); l.Wait() })
				lines := bufio.NewScanner(stdout)
				if !lines.Scan() || lines.Text() != "listening" {
					t.Fatalf("listener in pod B: %q", lines.Text())
				}
				// In order, from one CPU (see oneCPU).
				done := make(chan error)
				go func() {
					defer runtime.UnlockOSThread()
					if err := oneCPU(); err != nil {
						done <- err
						return
					}
					done <- sendTo(fam.b, "7003", "7001")
				}()
				if err := <-done; err != nil {
					t.Fatal(err)
				}
				if !lines.Scan() || lines.Text() != "udp 7001" {

					t.Errorf("pod B's packet socket first saw %q, want %q: it saw a datagram its ingress policy denies", lines.Text(), "udp 7001")
				}
			})
		})
	}

	// The drops are verdicts, at the interface.
	testenv.Eventually(t, waitTimeout, "apiary monitor shows the interface's drops", func() (bool, string) {
		var spoofed, deniedOut, deniedIn bool
		for line := range strings.Lines(mon.log.String()) {
			var v struct{ Endpoint, Direction, Dst, Verdict, Reason, Layer string }
			if json.Unmarshal([]byte(line), &v) != nil || v.Layer != "interface" || v.Verdict != "denied" {
				continue
			}
			spoofed = spoofed || (v.Endpoint == "default/ifa" && v.Reason == "spoofed source")
			deniedOut = deniedOut || (v.Endpoint == "default/ifa" && v.Direction == "egress" && v.Dst == ifGw4+":7004")
			deniedIn = deniedIn || (v.Endpoint == "default/ifb" && v.Direction == "ingress" && v.Dst == ifB4+":7003")
		}
		return spoofed && deniedOut && deniedIn, mon.log.Tail(10)
	})
	if n, err := a.labelledMetric(`apiary_policy_interface_drops_total{reason="spoofed"}`); err != nil || n < 4 {
		t.Errorf("spoofed drops: %v %v, want at least 4", n, err)
	}

	// The pinned programs hold while the agent is down.
	a.stop(t)
	t.Run("agent down", func(t *testing.T) { packetSocket(t, 0) })
	a.start(t)
	t.Run("agent back", func(t *testing.T) { packetSocket(t, 1) })

	// An interface that goes takes its programs and entries with it: the
	// row says the pod has none, nothing of it is left pinned.
	hostB, err := net.InterfaceByName(podB.hostIf)
	if err != nil {
		t.Fatal(err)
	}
	ipCmd(t, "link", "del", podB.hostIf)
	testenv.Eventually(t, waitTimeout, "pod B's interface gone from pod-interfaces and its pins removed", func() (bool, string) {
		var rows []struct {
			Name    string
			Ifindex int
			Error   string
		}
		if err := a.dump("pod-interfaces", &rows); err != nil {
			return false, err.Error()
		}
		pins, _ := filepath.Glob(filepath.Join(a.pinDir, "links", "ifaces", strconv.Itoa(hostB.Index)+"_*"))
		for _, r := range rows {
			if r.Name == "default/ifb" {
				return r.Ifindex == 0 && r.Error != "" && len(pins) == 0, fmt.Sprintf("%+v, pins %v", r, pins)
			}
		}
		return false, fmt.Sprintf("no row for default/ifb: %+v", rows)
	})

	// Turned off, the frame gets through: the cases above see what the
	// programs stop.
	a.restart(t, "--policy-pod-interfaces=false")
	testenv.Eventually(t, waitTimeout, "without the interface programs, the frame to port 7004 arrives", func() (bool, string) {
		podA.run(t, true, pktMACEnv+"="+hostMAC(podA), pktSendEnv+"="+ifA4+">"+ifGw4+":7004:through")
		denied4.conn.SetReadDeadline(time.Now().Add(time.Second))
		buf := make([]byte, 1500)
		n, _, err := denied4.conn.ReadFromUDPAddrPort(buf)
		return err == nil && string(buf[:n]) == "through", fmt.Sprint(err)
	})
}

// waitPodInterfaces waits until the pod-interfaces table lists each
// endpoint of want on its host interface, attached.
func (a *agent) waitPodInterfaces(t *testing.T, want map[string]string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, fmt.Sprintf("pod-interfaces %v", want), func() (bool, string) {
		var rows []struct {
			Name, Interface string
			Ifindex         int
			Status          struct{ Kind string }
		}
		if err := a.dump("pod-interfaces", &rows); err != nil {
			return false, err.Error()
		}
		got := map[string]string{}
		for _, r := range rows {
			if r.Ifindex != 0 && r.Status.Kind == "Done" {
				got[r.Name] = r.Interface
			}
		}
		return fmt.Sprint(got) == fmt.Sprint(want), fmt.Sprintf("%+v", rows)
	})
}

// Addresses of TestDNSInterceptionInPodNetns: a pod of its own network
// namespace, its resolver (dnsmasq) on the node's side of its veth.
const (
	uidIfDNS   = "1c1c1c1c-0000-4000-8000-00000000001c"
	dnsGw4     = "10.233.0.1"
	dnsGw6     = "fd00:e4::1"
	dnsPod4    = "10.233.0.11"
	dnsPod6    = "fd00:e4::11"
	dnsAllowed = "10.233.1.2" // what dnsmasq answers for *.allowed.test
)

const ifDNSPods = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: ifdns, namespace: default, uid: ` + uidIfDNS + `, labels: {app: ifdns}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + dnsPod4 + `, podIPs: [{ip: ` + dnsPod4 + `}, {ip: "` + dnsPod6 + `"}]}
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
      rules: {dns: [{matchPattern: "*.allowed.test"}]}
`

// TestDNSInterceptionInPodNetns: a pod in a network namespace of its own
// (as a real pod is) asks its resolver, on the node, through the agent's
// DNS proxy without knowing it, across the programs on its interface: an
// allowed name is answered, another is REFUSED, over UDP and TCP. A query
// the pod writes by hand on a packet socket to the proxy's address, past
// every socket hook, meets the pod's DNS rules too (refused, in apiary
// monitor), not an unfiltered upstream.
func TestDNSInterceptionInPodNetns(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	digBin := testenv.RequireProgram(t, "dig")
	dnsmasq := testenv.RequireProgram(t, "dnsmasq", "/usr/sbin")
	root := testenv.Cgroup(t)
	pod := makeIfPodVia(t, root, uidIfDNS, "ifd", dnsGw4, dnsGw6, dnsPod4, dnsPod6)
	startProcess(t, "dnsmasq", nil, dnsmasq,
		"--keep-in-foreground", "--conf-file=/dev/null", "--pid-file",
		"--no-resolv", "--no-hosts", "--listen-address="+dnsGw4, "--bind-interfaces",
		"--port=53", "--log-queries", "--log-facility=-", "--address=/allowed.test/"+dnsAllowed,
		"--address=/denied.test/10.233.1.3")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), ifDNSPods)
	proxyPort := freePort(t)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + dnsGw4,
		// The proxy listens where the pod can reach it: the node's side
		// of its veth.
		"--dns-proxy-addr=" + net.JoinHostPort(dnsGw4, strconv.Itoa(proxyPort)), "--dns-upstream=127.0.0.1:1",
	}})
	a.waitPodInterfaces(t, map[string]string{"default/ifdns": pod.hostIf})
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")
	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "--type", "dns", "-o", "json", "--server", "http://"+a.addr)

	dig := func(name string, tcp bool) (string, []string) {
		args := []string{"@" + dnsGw4, name, "A", "+time=5", "+tries=1"}
		if tcp {
			args = append(args, "+tcp")
		}
		out, _ := pod.command(t, true, nil, append([]string{digBin}, args...)...).CombinedOutput()
		return answerOf(string(out))
	}
	for _, tcp := range []bool{false, true} {
		t.Run(fmt.Sprintf("tcp=%t", tcp), func(t *testing.T) {
			testenv.Eventually(t, waitTimeout, "an allowed name answered", func() (bool, string) {
				status, ips := dig("www.allowed.test", tcp)
				return status == "NOERROR" && fmt.Sprint(ips) == "["+dnsAllowed+"]", fmt.Sprint(status, ips)
			})
			if status, ips := dig("www.denied.test", tcp); status != "REFUSED" || len(ips) != 0 {
				t.Errorf("www.denied.test: %s %v, want REFUSED", status, ips)
			}
		})
	}

	// Past the socket hooks: a query on a packet socket to the proxy.
	mac, err := net.InterfaceByName(pod.hostIf)
	if err != nil {
		t.Fatal(err)
	}
	proxy := dnsGw4 + ":" + strconv.Itoa(proxyPort)
	testenv.Eventually(t, waitTimeout, "the hand-made query refused by the pod's DNS rules", func() (bool, string) {
		pod.run(t, true, pktMACEnv+"="+mac.HardwareAddr.String(), pktDNSEnv+"="+dnsPod4+">"+proxy+":raw.denied.test")
		for line := range strings.Lines(mon.log.String()) {
			var v struct {
				Endpoint, Verdict string
				DNS               struct{ Query string }
			}
			if json.Unmarshal([]byte(line), &v) == nil && v.DNS.Query == "raw.denied.test." {
				if v.Endpoint != "default/ifdns" || v.Verdict != "denied" {
					t.Fatalf("the hand-made query: %s", line)
				}
				return true, line
			}
		}
		return false, mon.log.Tail(5)
	})
}
