package e2e

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"

	"golang.org/x/sys/unix"
)

// Helpers of TestPolicyPacketForgery, run in a pod (see runHelper).
const (
	// framesEnv: send the frames (JSON, []forgedFrame) through an
	// AF_PACKET socket on eth0 to the MAC in pktMACEnv, in order, from
	// one CPU.
	framesEnv = "E2E_FRAMES"
	// pktWatchEnv: print each IPv6 packet to the address it names that
	// an AF_PACKET socket on eth0 receives: "udp SPORT>DPORT", "tcp
	// SPORT>DPORT" or "icmp6 TYPE".
	pktWatchEnv = "E2E_PKT_WATCH"
	// udpRecvEnv: "WATCHED,CONTROL", two UDP addresses: print "PORT
	// PAYLOAD" for each datagram to CONTROL, then for those waiting on
	// WATCHED, then "drained" (see udpRecv).
	udpRecvEnv = "E2E_UDP_RECV"
	// tcpPushEnv: listen on the TCP address; greet every connection
	// with "hello"; write each line of stdin to the first connection and
	// print the line it answers.
	tcpPushEnv = "E2E_TCP_PUSH"
	// tcpEchoEnv: connect to the TCP address from tcpEchoFromEnv's, read
	// the greeting, print "connected", then send back every line.
	tcpEchoEnv     = "E2E_TCP_ECHO"
	tcpEchoFromEnv = "E2E_TCP_ECHO_FROM"
)

func runForgeHelper() (int, bool) {
	switch {
	case os.Getenv(framesEnv) != "":
		return reportErr(sendForged(os.Getenv(framesEnv), os.Getenv(pktMACEnv))), true
	case os.Getenv(pktWatchEnv) != "":
		return reportErr(pktWatch(netip.MustParseAddr(os.Getenv(pktWatchEnv)))), true
	case os.Getenv(udpRecvEnv) != "":
		watched, control, _ := strings.Cut(os.Getenv(udpRecvEnv), ",")
		return reportErr(udpRecv(watched, control)), true
	case os.Getenv(tcpPushEnv) != "":
		return reportErr(tcpPush(os.Getenv(tcpPushEnv))), true
	case os.Getenv(tcpEchoEnv) != "":
		return reportErr(tcpEcho(os.Getenv(tcpEchoEnv), os.Getenv(tcpEchoFromEnv))), true
	}
	return 0, false
}

// forgedFrame is an IPv6 packet a pod makes by hand.
type forgedFrame struct {
	// Kind: "udp", "tcp" (flags PSH/ACK, or SYN when Syn), "na" or "ns".
	Kind string
	// Src: an address, or "ll" for the sender's link-local address.
	Src, Dst     string
	SPort, DPort uint16
	// DstOpts: destination options headers before UDP.
	DstOpts int
	Syn     bool
	// Target of an NA or NS; LLAddr the NA's target link-layer address
	// (the sender's own when empty).
	Target, LLAddr string
	Payload        string
}

// sendForged sends the frames of spec, in order, from one CPU (see
// oneCPU), through a packet socket on eth0 to mac.
func sendForged(spec, mac string) error {
	var frames []forgedFrame
	if err := json.Unmarshal([]byte(spec), &frames); err != nil {
		return fmt.Errorf("frames %q: %w", spec, err)
	}
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
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, int(htons(unix.ETH_P_IPV6)))
	if err != nil {
		return fmt.Errorf("packet socket: %w", err)
	}
	defer unix.Close(fd)
	sa := &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_IPV6), Ifindex: eth0.Index, Halen: 6}
	copy(sa.Addr[:], hw)
	for _, f := range frames {
		pkt, err := f.packet(eth0)
		if err != nil {
			return err
		}
		if err := unix.Sendto(fd, pkt, 0, sa); err != nil {
			return fmt.Errorf("send %+v: %w", f, err)
		}
	}
	fmt.Println("sent")
	return nil
}

// linkLocal is the fe80::/10 address of ifc.
func linkLocal(ifc *net.Interface) (netip.Addr, error) {
	addrs, err := ifc.Addrs()
	if err != nil {
		return netip.Addr{}, err
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.IsLinkLocalUnicast() && n.IP.To4() == nil {
			return netip.AddrFrom16([16]byte(n.IP.To16())), nil
		}
	}
	return netip.Addr{}, fmt.Errorf("%s has no link-local address", ifc.Name)
}

// packet is the frame's IPv6 packet, with its checksums.
func (f forgedFrame) packet(eth0 *net.Interface) ([]byte, error) {
	src, err := netip.Addr{}, error(nil)
	if f.Src == "ll" {
		src, err = linkLocal(eth0)
	} else {
		src, err = netip.ParseAddr(f.Src)
	}
	if err != nil {
		return nil, err
	}
	dst, err := netip.ParseAddr(f.Dst)
	if err != nil {
		return nil, err
	}
	var proto byte
	var l4 []byte
	hop := byte(64)
	switch f.Kind {
	case "udp":
		proto, l4 = unix.IPPROTO_UDP, udpHeader(f.SPort, f.DPort, f.Payload)
	case "tcp":
		proto, l4 = unix.IPPROTO_TCP, tcpSegment(f.SPort, f.DPort, f.Syn, f.Payload)
	case "na", "ns":
		lladdr := eth0.HardwareAddr
		if f.LLAddr != "" {
			if lladdr, err = net.ParseMAC(f.LLAddr); err != nil {
				return nil, err
			}
		}
		proto, hop, l4 = unix.IPPROTO_ICMPV6, 255, ndMessage(f.Kind, netip.MustParseAddr(f.Target), lladdr, f.Payload)
	default:
		return nil, fmt.Errorf("frame kind %q", f.Kind)
	}
	checksumL4(proto, src, dst, l4)
	return ipv6Packet(src, dst, proto, hop, f.DstOpts, l4), nil
}

// udpHeader is a UDP datagram without its checksum.
func udpHeader(sport, dport uint16, payload string) []byte {
	udp := make([]byte, 8, 8+len(payload))
	binary.BigEndian.PutUint16(udp[0:], sport)
	binary.BigEndian.PutUint16(udp[2:], dport)
	binary.BigEndian.PutUint16(udp[4:], uint16(8+len(payload)))
	return append(udp, payload...)
}

// tcpSegment is a TCP segment (PSH/ACK with payload, or a SYN) without
// its checksum.
func tcpSegment(sport, dport uint16, syn bool, payload string) []byte {
	tcp := make([]byte, 20, 20+len(payload))
	binary.BigEndian.PutUint16(tcp[0:], sport)
	binary.BigEndian.PutUint16(tcp[2:], dport)
	binary.BigEndian.PutUint32(tcp[4:], 0x1000)
	tcp[12] = 5 << 4
	if syn {
		tcp[13] = 0x02
	} else {
		binary.BigEndian.PutUint32(tcp[8:], 0x2000)
		tcp[13] = 0x18 // PSH, ACK
	}
	binary.BigEndian.PutUint16(tcp[14:], 65535)
	return append(tcp, payload...)
}

// ndMessage is a neighbour advertisement (override, with the target's
// link-layer address) or solicitation (with payload after its target)
// for target, without its checksum.
func ndMessage(kind string, target netip.Addr, lladdr net.HardwareAddr, payload string) []byte {
	m := make([]byte, 24, 32+len(payload))
	m[0] = 135
	if kind == "na" {
		m[0], m[4] = 136, 0x20 // override
	}
	t := target.As16()
	copy(m[8:], t[:])
	if kind == "na" {
		m = append(append(m, 2, 1), lladdr...) // target link-layer address
	}
	return append(m, payload...)
}

// checksumL4 sets the UDP, TCP or ICMPv6 checksum of l4.
func checksumL4(proto byte, src, dst netip.Addr, l4 []byte) {
	s, d := src.As16(), dst.As16()
	pseudo := append(append(append([]byte{}, s[:]...), d[:]...), 0, 0, byte(len(l4)>>8), byte(len(l4)), 0, 0, 0, proto)
	off := map[byte]int{unix.IPPROTO_UDP: 6, unix.IPPROTO_TCP: 16, unix.IPPROTO_ICMPV6: 2}[proto]
	sum := inetChecksum(append(pseudo, l4...))
	if sum == 0 && proto == unix.IPPROTO_UDP {
		sum = 0xffff
	}
	binary.BigEndian.PutUint16(l4[off:], sum)
}

// ipv6Packet is the IPv6 packet of l4 with dstOpts destination options
// headers (8 bytes each: a PadN option) before it.
func ipv6Packet(src, dst netip.Addr, proto, hop byte, dstOpts int, l4 []byte) []byte {
	next := proto
	var ext []byte
	for range dstOpts {
		ext = append([]byte{next, 0, 1, 4, 0, 0, 0, 0}, ext...)
		next = unix.IPPROTO_DSTOPTS
	}
	ip := make([]byte, 40, 40+len(ext)+len(l4))
	ip[0], ip[6], ip[7] = 0x60, next, hop
	binary.BigEndian.PutUint16(ip[4:], uint16(len(ext)+len(l4)))
	s, d := src.As16(), dst.As16()
	copy(ip[8:], s[:])
	copy(ip[24:], d[:])
	return append(append(ip, ext...), l4...)
}

// pktWatch prints what a packet socket on eth0 receives of the IPv6
// packets to addr (see pktWatchEnv).
func pktWatch(addr netip.Addr) error {
	eth0, err := net.InterfaceByName("eth0")
	if err != nil {
		return err
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, int(htons(unix.ETH_P_IPV6)))
	if err != nil {
		return fmt.Errorf("packet socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_IPV6), Ifindex: eth0.Index}); err != nil {
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
		if n < 48 || p[0]>>4 != 6 || netip.AddrFrom16([16]byte(p[24:40])) != addr {
			continue
		}
		l4 := p[40:]
		switch p[6] {
		case unix.IPPROTO_UDP:
			fmt.Printf("udp %d>%d\n", binary.BigEndian.Uint16(l4), binary.BigEndian.Uint16(l4[2:]))
		case unix.IPPROTO_TCP:
			fmt.Printf("tcp %d>%d\n", binary.BigEndian.Uint16(l4), binary.BigEndian.Uint16(l4[2:]))
		case unix.IPPROTO_ICMPV6:
			fmt.Printf("icmp6 %d\n", l4[0])
		}
	}
}

// udpRecv prints each datagram its socket on control receives, then
// each one waiting on its socket on watched, then "drained": datagrams
// sent to watched before the one to control, on the same path, are
// queued by then (two sockets' reads would not keep their order).
func udpRecv(watched, control string) error {
	var conns [2]*net.UDPConn
	for i, addr := range []string{watched, control} {
		c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(addr)))
		if err != nil {
			return err
		}
		conns[i] = c
	}
	raw, err := conns[0].SyscallConn()
	if err != nil {
		return err
	}
	fmt.Println("listening")
	buf := make([]byte, 2048)
	for {
		n, err := conns[1].Read(buf)
		if err != nil {
			return err
		}
		fmt.Printf("%d %s\n", netip.MustParseAddrPort(control).Port(), buf[:n])
		for {
			var rerr error
			if err := raw.Read(func(fd uintptr) bool {
				n, _, rerr = unix.Recvfrom(int(fd), buf, unix.MSG_DONTWAIT)
				return true
			}); err != nil {
				return err
			}
			if errors.Is(rerr, unix.EAGAIN) {
				break
			}
			if rerr != nil {
				return rerr
			}
			fmt.Printf("%d %s\n", netip.MustParseAddrPort(watched).Port(), buf[:n])
		}
		fmt.Println("drained")
	}
}

// tcpPush serves addr (see tcpPushEnv).
func tcpPush(addr string) error {
	// No keepalives: a probe of B's would teach the interface the flow,
	// and the test checks that the pod's kernel alone keeps it working.
	lc := net.ListenConfig{KeepAlive: -1}
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		return err
	}
	fmt.Println("listening")
	first, err := ln.Accept()
	if err != nil {
		return err
	}
	fmt.Fprintln(first, "hello")
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			fmt.Fprintln(c, "hello")
			c.Close()
		}
	}()
	in, replies := bufio.NewScanner(os.Stdin), bufio.NewReader(first)
	for in.Scan() {
		if _, err := fmt.Fprintln(first, in.Text()); err != nil {
			return err
		}
		line, err := replies.ReadString('\n')
		if err != nil {
			return fmt.Errorf("read the answer: %w", err)
		}
		fmt.Print(line)
	}
	return nil
}

// tcpEcho connects to addr from from and sends back every line it gets
// after the greeting.
func tcpEcho(addr, from string) error {
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.MustParseAddrPort(from)), KeepAlive: -1}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		return err
	}
	r := bufio.NewReader(c)
	if _, err := r.ReadString('\n'); err != nil {
		return fmt.Errorf("greeting: %w", err)
	}
	fmt.Println("connected")
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return err
		}
		if _, err := c.Write([]byte(line)); err != nil {
			return err
		}
	}
}

// Pods of TestPolicyPacketForgery (addresses of their own: the test runs
// in parallel with TestPolicyPacketLevel).
const (
	uidFgA = "1d1d1d1d-0000-4000-8000-00000000001d"
	uidFgB = "1e1e1e1e-0000-4000-8000-00000000001e"
	fgGw4  = "10.235.0.1"
	fgA4   = "10.235.0.11"
	fgB4   = "10.235.0.12"
	fgGw6  = "fd00:e5::1"
	fgA6   = "fd00:e5::11"
	fgB6   = "fd00:e5::12"
)

// forgeryConfig: pod fga may send to fgb, but no TCP to its ports 4444
// and 4446, and to the node on TCP 8080; it lets fgb in on TCP 8080 only.
// Pod fgb lets fga in on every port but UDP 5353.
const forgeryConfig = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: fga, namespace: default, uid: ` + uidFgA + `, labels: {app: fga}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + fgA4 + `, podIPs: [{ip: ` + fgA4 + `}, {ip: "` + fgA6 + `"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: fgb, namespace: default, uid: ` + uidFgB + `, labels: {app: fgb}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + fgB4 + `, podIPs: [{ip: ` + fgB4 + `}, {ip: "` + fgB6 + `"}]}
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: fga, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: fga}}
  egress:
  - toEndpoints: [{matchLabels: {app: fgb}}]
  - toEntities: [host]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
  egressDeny:
  - toEndpoints: [{matchLabels: {app: fgb}}]
    toPorts: [{ports: [{port: "4444", protocol: TCP}, {port: "4446", protocol: TCP}]}]
  ingress:
  - fromEndpoints: [{matchLabels: {app: fgb}}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: fgb, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: fgb}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: fga}}]
  ingressDeny:
  - fromEndpoints: [{matchLabels: {app: fga}}]
    toPorts: [{ports: [{port: "5353", protocol: UDP}]}]
`

// lineReader reads a helper's output lines as they come.
type lineReader struct {
	name  string
	lines chan string
}

// startHelper starts cmd, and returns its output lines once it printed
// the first, want.
func startHelper(t *testing.T, name string, cmd *exec.Cmd, want string) (*lineReader, io.WriteCloser) {
	t.Helper()
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	r := &lineReader{name: name, lines: make(chan string, 100)}
	go func() {
		s := bufio.NewScanner(stdout)
		for s.Scan() {
			r.lines <- s.Text()
		}
		close(r.lines)
	}()
	if got := r.next(t); got != want {
		t.Fatalf("%s printed %q, want %q (stderr %q)", name, got, want, stderr.String())
	}
	return r, stdin
}

// next returns the next line, failing the test when none comes within
// waitTimeout.
func (r *lineReader) next(t *testing.T) string {
	t.Helper()
	select {
	case l, ok := <-r.lines:
		if !ok {
			t.Fatalf("%s ended", r.name)
		}
		return l
	case <-time.After(waitTimeout):
		t.Fatalf("%s printed nothing within %v", r.name, waitTimeout)
	}
	return ""
}

// until reads lines up to want, and fails the test for each line before
// it that bad says is one that should not have come.
func (r *lineReader) until(t *testing.T, want string, bad func(string) bool) {
	t.Helper()
	for {
		l := r.next(t)
		if l == want {
			return
		}
		if bad(l) {
			t.Errorf("%s got %q before %q", r.name, l, want)
		}
	}
}

// framesJSON is the value of framesEnv for frames.
func framesJSON(t *testing.T, frames ...forgedFrame) string {
	b, err := json.Marshal(frames)
	if err != nil {
		t.Fatal(err)
	}
	return framesEnv + "=" + string(b)
}

// hostMACOf is the MAC of the host side of the pod's veth.
func hostMACOf(t *testing.T, p *ifPod) string {
	t.Helper()
	ifc, err := net.InterfaceByName(p.hostIf)
	if err != nil {
		t.Fatal(err)
	}
	return ifc.HardwareAddr.String()
}

// neighMAC is the link-layer address of the node's neighbour entry for
// addr on dev ("" when none).
func neighMAC(t *testing.T, addr, dev string) string {
	t.Helper()
	out, err := exec.Command("ip", "-6", "neigh", "show", addr, "dev", dev).CombinedOutput()
	if err != nil {
		t.Fatalf("ip neigh show: %v: %s", err, out)
	}
	f := strings.Fields(string(out))
	for i, w := range f {
		if w == "lladdr" && i+1 < len(f) {
			return f[i+1]
		}
	}
	return ""
}

// TestPolicyPacketForgery: what a pod forges at the link layer, judged by
// the shipped binary at the host side of its veth, over IPv6 between two
// pods the node routes. A neighbour advertisement claiming the other
// pod's address never reaches the node (its neighbour entry keeps its
// link-layer address), while neighbour discovery from a fresh cache keeps
// working; a solicitation with a payload to a pod that denies it never
// reaches that pod. A datagram with more destination options headers than
// the programs walk does not reach a port the receiver denies (a datagram
// with two does reach an allowed one). A hand-made PSH/ACK from a port
// the sender's ingress allows to a port its egress denies never reaches
// the peer, while a real connection opened before the programs were
// attached, whose packets the same rule denies, keeps working.
func TestPolicyPacketForgery(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	// The node routes between the pods.
	fwd := "/proc/sys/net/ipv6/conf/all/forwarding"
	old, err := os.ReadFile(fwd)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(fwd, []byte("1"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(fwd, old, 0o644) })

	root := testenv.Cgroup(t)
	podA := makeIfPodVia(t, root, uidFgA, "fga", fgGw4, fgGw6, fgA4, fgA6)
	podB := makeIfPodVia(t, root, uidFgB, "fgb", fgGw4, fgGw6, fgB4, fgB6)
	macA, macB := hostMACOf(t, podA), hostMACOf(t, podB)
	listen(t, "["+fgGw6+"]:8080")

	// A connection from B's port 4446 to A's 8080, opened before the
	// programs: A's server is outside A's cgroup, so that only the
	// interface judges it (its socket has no flow state either way).
	push, pushIn := startHelper(t, "A's server", podA.command(t, false, []string{tcpPushEnv + "=[" + fgA6 + "]:8080"}), "listening")
	startHelper(t, "B's client", podB.command(t, true, []string{
		tcpEchoEnv + "=[" + fgA6 + "]:8080", tcpEchoFromEnv + "=[" + fgB6 + "]:4446"}), "connected")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "config.yaml"), forgeryConfig)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--allow-localhost=policy",
		"--node-ips=" + fgGw4 + "," + fgGw6, "--enable-ipv6",
	}})
	a.waitPodInterfaces(t, map[string]string{"default/fga": podA.hostIf, "default/fgb": podB.hostIf})

	t.Run("neighbour discovery", func(t *testing.T) {
		// From a fresh cache, on both sides of both links.
		ipCmd(t, "-6", "neigh", "flush", "dev", podA.hostIf)
		ipCmd(t, "-6", "neigh", "flush", "dev", podB.hostIf)
		for _, p := range []*ifPod{podA, podB} {
			ipCmd(t, "netns", "exec", p.netns, "ip", "-6", "neigh", "flush", "dev", "eth0")
		}
		if got := podA.run(t, true, connectEnv+"=["+fgGw6+"]:8080"); !strings.HasPrefix(got, "ok") {
			t.Errorf("pod A to the node: %s", got)
		}
		if got := podB.run(t, true, connectEnv+"=["+fgA6+"]:8080"); !strings.HasPrefix(got, "ok") {
			t.Errorf("pod B to pod A: %s", got)
		}
	})

	t.Run("forged advertisement", func(t *testing.T) {
		// The node knows B's address on A's link (stale) and A's under a
		// MAC that is not A's; an advertisement with override changes
		// what it knows.
		const bogus = "02:00:00:00:00:0b"
		ipCmd(t, "-6", "neigh", "replace", fgB6, "lladdr", bogus, "dev", podA.hostIf, "nud", "stale")
		ipCmd(t, "-6", "neigh", "replace", fgA6, "lladdr", bogus, "dev", podA.hostIf, "nud", "stale")
		spoofed0, _ := a.labelledMetric(`apiary_policy_interface_drops_total{reason="spoofed"}`)
		podA.run(t, true, pktMACEnv+"="+macA, framesJSON(t,
			// B's address as source and target, then as target only.
			forgedFrame{Kind: "na", Src: fgB6, Dst: "ff02::1", Target: fgB6},
			forgedFrame{Kind: "na", Src: "ll", Dst: "ff02::1", Target: fgB6},
			// A's own: what the link needs.
			forgedFrame{Kind: "na", Src: fgA6, Dst: "ff02::1", Target: fgA6}))
		testenv.Eventually(t, waitTimeout, "the node learns A's own advertisement", func() (bool, string) {
			got := neighMAC(t, fgA6, podA.hostIf)
			return got != bogus && got != "", got
		})
		if got := neighMAC(t, fgB6, podA.hostIf); got != bogus {
			t.Errorf("the node's entry for B's address on A's link is %s, want %s: a forged advertisement reached it", got, bogus)
		}
		if n, err := a.labelledMetric(`apiary_policy_interface_drops_total{reason="spoofed"}`); err != nil || n <= spoofed0 {
			t.Errorf("spoofed drops: %v (%v), want more than %v", n, err, spoofed0)
		}
	})

	t.Run("solicitation with a payload", func(t *testing.T) {
		watch, _ := startHelper(t, "A's packet socket", podA.command(t, true, []string{pktWatchEnv + "=" + fgA6}), "listening")
		podB.run(t, true, pktMACEnv+"="+macB, framesJSON(t,
			forgedFrame{Kind: "ns", Src: fgB6, Dst: fgA6, Target: fgA6, Payload: "smuggled payload"},
			forgedFrame{Kind: "tcp", Syn: true, Src: fgB6, Dst: fgA6, SPort: 40001, DPort: 8080}))
		watch.until(t, "tcp 40001>8080", func(l string) bool { return strings.HasPrefix(l, "icmp6 135") })
	})

	t.Run("extension headers", func(t *testing.T) {
		recv, _ := startHelper(t, "B's sockets", podB.command(t, true, []string{
			udpRecvEnv + "=[" + fgB6 + "]:5353,[" + fgB6 + "]:5354"}), "listening")
		podA.run(t, true, pktMACEnv+"="+macA, framesJSON(t,
			forgedFrame{Kind: "udp", Src: fgA6, Dst: fgB6, SPort: 40002, DPort: 5353, DstOpts: 7, Payload: "seven"},
			forgedFrame{Kind: "udp", Src: fgA6, Dst: fgB6, SPort: 40002, DPort: 5353, DstOpts: 9, Payload: "nine"},
			forgedFrame{Kind: "udp", Src: fgA6, Dst: fgB6, SPort: 40002, DPort: 5354, DstOpts: 2, Payload: "two"}))
		recv.until(t, "drained", func(l string) bool { return strings.HasPrefix(l, "5353") })
		// Seven are walked (the datagram is judged as UDP 5353, denied);
		// nine are more than the programs walk.
		if n, err := a.labelledMetric(`apiary_policy_interface_drops_total{reason="unparsable"}`); err != nil || n < 1 {
			t.Errorf("unparsable drops: %v (%v), want at least 1", n, err)
		}
	})

	t.Run("TCP without SYN", func(t *testing.T) {
		watch, _ := startHelper(t, "B's packet socket", podB.command(t, true, []string{pktWatchEnv + "=" + fgB6}), "listening")
		podA.run(t, true, pktMACEnv+"="+macA, framesJSON(t,
			forgedFrame{Kind: "tcp", Src: fgA6, Dst: fgB6, SPort: 8080, DPort: 4444, Payload: "forged"},
			forgedFrame{Kind: "tcp", Src: fgA6, Dst: fgB6, SPort: 8080, DPort: 4445, Payload: "allowed"}))
		watch.until(t, "tcp 8080>4445", func(l string) bool { return l == "tcp 8080>4444" })

		// The real connection's packets from A's 8080 to B's 4446 are
		// denied by the same rule, and pass: the pod's kernel has it.
		fmt.Fprintln(pushIn, "ping")
		if got := push.next(t); got != "ping" {
			t.Errorf("the connection opened before the programs answered %q, want %q", got, "ping")
		}
	})
}
