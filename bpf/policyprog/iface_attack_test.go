package policyprog

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
)

const (
	icmp6       = unix.IPPROTO_ICMPV6
	hostIDTest  = 1 // reserved:host
	dstOptsProt = 60
)

// ip6Frame is an Ethernet frame of an IPv6 packet with hop limit hop,
// payload l4 of protocol proto after the extension headers exts (each a
// protocol number; all are 8 bytes of padding options).
func ip6Frame(src, dst string, hop uint8, proto uint8, exts []uint8, l4 []byte) []byte {
	eth := make([]byte, 14)
	binary.BigEndian.PutUint16(eth[12:], 0x86dd)
	ip := make([]byte, 40)
	ip[0] = 0x60
	ip[7] = hop
	s16, d16 := netip.MustParseAddr(src).As16(), netip.MustParseAddr(dst).As16()
	copy(ip[8:], s16[:])
	copy(ip[24:], d16[:])
	var body []byte
	next := proto
	for i := len(exts) - 1; i >= 0; i-- {
		h := make([]byte, 8)
		h[0] = next
		h[2] = 1 // PadN of 4 bytes
		h[3] = 4
		body = append(h, body...)
		next = exts[i]
	}
	ip[6] = next
	body = append(body, l4...)
	binary.BigEndian.PutUint16(ip[4:], uint16(len(body)))
	return append(append(eth, ip...), body...)
}

// icmp6Msg is an ICMPv6 message of type typ with a target address (an NS
// or NA's, or "" for none) and payload.
func icmp6Msg(typ uint8, target string, payload string) []byte {
	m := make([]byte, 8)
	m[0] = typ
	if target != "" {
		t := netip.MustParseAddr(target).As16()
		m = append(m, t[:]...)
	}
	return append(m, payload...)
}

// TestInterfaceNeighbourDiscovery: ICMPv6 types 130-137 and 143 pass the
// pod's interface whatever its policy only as the link needs them (hop
// limit 255 neighbour discovery with the pod's own or link-local
// addresses, on the link; MLD with hop limit 1 to link-scope groups);
// anything else of them meets anti-spoofing and policy, and a pod's router
// advertisements and redirects are dropped. The pod denies everything both
// ways.
func TestInterfaceNeighbourDiscovery(t *testing.T) {
	const pod, other, node, routed = "fd00:244::5", "fd00:244::6", "fd00:244::1", "fd00:99::7"
	d := newIfaceDatapath(t, pod)
	d.identity(node, hostIDTest)
	d.identity(other, 1000)
	d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)
	const ll, llNode, solicited, allNodes = "fe80::5", "fe80::1", "ff02::1:ff00:1", "ff02::1"
	for _, tc := range []struct {
		name      string
		prog      string
		src, dst  string
		hop, typ  uint8
		target    string
		want      uint32
		wantStats int // spoofed drops this case adds
	}{
		{"NS for the gateway from the pod's address", FromPod, pod, solicited, 255, 135, node, tcxNext, 0},
		{"NS from link-local", FromPod, ll, solicited, 255, 135, llNode, tcxNext, 0},
		{"unicast NS to the node (NUD)", FromPod, pod, node, 255, 135, node, tcxNext, 0},
		{"DAD NS", FromPod, "::", solicited, 255, 135, pod, tcxNext, 0},
		{"NA for its own address", FromPod, pod, llNode, 255, 136, pod, tcxNext, 0},
		{"RS", FromPod, ll, "ff02::2", 255, 133, "", tcxNext, 0},
		{"MLDv2 report", FromPod, ll, "ff02::16", 1, 143, "", tcxNext, 0},
		{"NA claiming another pod's address", FromPod, pod, allNodes, 255, 136, other, tcxDrop, 1},
		{"NA claiming another pod's address, from link-local to a routed address", FromPod, ll, other, 64, 136, other, tcxDrop, 1},
		{"NA from another pod's address", FromPod, other, allNodes, 255, 136, other, tcxDrop, 1},
		{"NS with payload to a routed address", FromPod, pod, routed, 255, 135, routed, tcxDrop, 0},
		{"NS to another pod", FromPod, pod, other, 255, 135, other, tcxDrop, 0},
		{"NS with hop limit 64", FromPod, pod, solicited, 64, 135, node, tcxDrop, 0},
		{"DAD NA", FromPod, "::", allNodes, 255, 136, pod, tcxDrop, 1},
		{"RA from the pod", FromPod, ll, allNodes, 255, 134, "", tcxDrop, 0},
		{"redirect from the pod", FromPod, ll, pod, 255, 137, "", tcxDrop, 0},
		{"MLD to a routed group", FromPod, ll, "ff05::2", 1, 143, "", tcxDrop, 1},
		{"NS from the node into the pod", ToPod, node, pod, 255, 135, pod, tcxNext, 0},
		{"RA from the node's link-local", ToPod, llNode, allNodes, 255, 134, "", tcxNext, 0},
		{"NS routed from another pod", ToPod, other, pod, 254, 135, pod, tcxDrop, 0},
		{"NS with hop limit 255 from a routed address", ToPod, routed, pod, 255, 135, pod, tcxDrop, 0},
		{"MLD query", ToPod, llNode, allNodes, 1, 130, "", tcxNext, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := d.ifaceStats()[bpf.PolicyIfaceStatsSpoofed]
			target := tc.target
			if tc.typ != 135 && tc.typ != 136 {
				target = ""
			}
			f := ip6Frame(tc.src, tc.dst, tc.hop, icmp6, nil, icmp6Msg(tc.typ, target, "payload"))
			if got := d.run(tc.prog, f); got != tc.want {
				t.Errorf("%s: %#x, want %#x", tc.prog, got, tc.want)
			}
			if got := d.ifaceStats()[bpf.PolicyIfaceStatsSpoofed] - before; got != uint64(tc.wantStats) {
				t.Errorf("spoofed drops: %d, want %d", got, tc.wantStats)
			}
		})
	}
}

// TestInterfaceUnparsable: an IPv6 packet with more extension headers
// than the programs walk, or one cut short, is dropped and counted, not
// judged as port 0; with fewer, its ports are judged. The pod may send
// anything to the peer but UDP to port 5353.
func TestInterfaceUnparsable(t *testing.T) {
	const pod, peer = "fd00:244::5", "fd00:244:1::7"
	d := newIfaceDatapath(t, pod)
	d.identity(peer, 1000)
	d.endpoint(bpf.PolicyEnforceEgress)
	// Every protocol and port (the L3 rule), but UDP 5353.
	if err := d.maps.Policy.Put(bpf.NewPolicyKey(testEndpoint, 1000, bpf.PolicyEgress, 0, 0, 0), bpf.PolicyValue{Cookie: 1}); err != nil {
		t.Fatal(err)
	}
	deny := bpf.PolicyValue{Flags: bpf.PolicyFlagDeny, Cookie: 2}
	if err := d.maps.Policy.Put(bpf.NewPolicyKey(testEndpoint, 1000, bpf.PolicyEgress, udp, 5353, 16), deny); err != nil {
		t.Fatal(err)
	}
	udpTo := func(port uint16) []byte {
		l4 := make([]byte, 12)
		binary.BigEndian.PutUint16(l4[0:], 4000)
		binary.BigEndian.PutUint16(l4[2:], port)
		binary.BigEndian.PutUint16(l4[4:], 12)
		return l4
	}
	exts := func(n int) []uint8 {
		e := make([]uint8, n)
		for i := range e {
			e[i] = dstOptsProt
		}
		return e
	}
	for _, tc := range []struct {
		name  string
		frame []byte
		want  uint32
	}{
		{"2 headers, allowed port", ip6Frame(pod, peer, 64, udp, exts(2), udpTo(53)), tcxNext},
		{"2 headers, denied port", ip6Frame(pod, peer, 64, udp, exts(2), udpTo(5353)), tcxDrop},
		{"7 headers, allowed port", ip6Frame(pod, peer, 64, udp, exts(7), udpTo(53)), tcxNext},
		{"7 headers, denied port", ip6Frame(pod, peer, 64, udp, exts(7), udpTo(5353)), tcxDrop},
		{"9 headers, allowed port", ip6Frame(pod, peer, 64, udp, exts(9), udpTo(53)), tcxDrop},
		{"a header cut short", ip6Frame(pod, peer, 64, udp, exts(2), nil)[:14+40+8+1], tcxDrop},
		{"ports cut short", ip6Frame(pod, peer, 64, udp, exts(1), []byte{0x0f})[:14+40+8+1], tcxDrop},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := d.run(FromPod, tc.frame); got != tc.want {
				t.Errorf("from pod: %#x, want %#x", got, tc.want)
			}
		})
	}
	if got := d.ifaceStats()[bpf.PolicyIfaceStatsUnparsable]; got != 3 {
		t.Errorf("unparsable drops: %d, want 3", got)
	}
}

// runOn runs prog on frame as if it crossed interface ifindex.
func (d *ifaceDatapath) runOn(prog string, ifindex int, frame []byte) uint32 {
	d.t.Helper()
	// struct __sk_buff up to its ifindex field.
	var ctx [11]uint32
	ctx[10] = uint32(ifindex)
	ret, err := d.progs[prog].Run(&ebpf.RunOptions{Data: frame, Context: ctx[:]})
	if err != nil {
		d.t.Fatalf("run %s on %d: %s", prog, ifindex, err)
	}
	return ret
}

// TestInterfaceFragmentsPerPod: a pod that floods first fragments pushes
// out only its own; another pod's later fragment still finds its first.
func TestInterfaceFragmentsPerPod(t *testing.T) {
	const podA, podB, peer = "10.244.0.5", "10.244.0.6", "10.244.1.7"
	d := newIfaceDatapath(t, podA)
	// Pod B on another interface of the host: any will do, nothing is
	// sent on it.
	ifaces, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	other := 0
	for _, ifc := range ifaces {
		if ifc.Index > loIfindex {
			other = ifc.Index
			break
		}
	}
	if other == 0 {
		t.Skip("no interface but loopback")
	}
	v, err := bpf.NewPolicyIfaceValue(ifacePodCgroup, 0, []netip.Addr{netip.MustParseAddr(podB)})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.maps.Ifaces.Put(uint32(other), v); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.maps.Ifaces.Delete(uint32(other)) })
	for _, outer := range []*ebpf.Map{d.maps.Flows, d.maps.Frags} {
		spec := bpf.PolicyIfaceFragsInnerSpec()
		if outer == d.maps.Flows {
			spec = bpf.PolicyIfaceFlowsInnerSpec(16)
		}
		inner := newTestMap(t, spec)
		if err := outer.Put(uint32(other), inner); err != nil {
			t.Fatal(err)
		}
	}
	d.identity(peer, 1000)
	d.endpoint(bpf.PolicyEnforceEgress)
	d.allow(1000, bpf.PolicyEgress, udp, 53)

	first := packet{src: podB, dst: peer, proto: udp, sport: 4000, dport: 53, fragFirst: true, fragID: 7}
	if got := d.runOn(FromPod, other, frame(first)); got != tcxNext {
		t.Fatalf("pod B's first fragment: %#x", got)
	}
	for i := range 20 * bpf.PolicyIfaceFrags { // more than the shared LRU of old held
		f := packet{src: podA, dst: peer, proto: udp, sport: 4000, dport: 53, fragFirst: true, fragID: uint16(1000 + i)}
		if got := d.run(FromPod, frame(f)); got != tcxNext {
			t.Fatalf("pod A's first fragment %d: %#x", i, got)
		}
	}
	later := packet{src: podB, dst: peer, proto: udp, fragN: true, fragID: 7}
	if got := d.runOn(FromPod, other, frame(later)); got != tcxNext {
		t.Errorf("pod B's later fragment after pod A's flood: %#x, want pass", got)
	}
	// Pod A's own oldest are gone, and counted.
	old := packet{src: podA, dst: peer, proto: udp, fragN: true, fragID: 1000}
	if got := d.run(FromPod, frame(old)); got != tcxDrop {
		t.Errorf("pod A's oldest later fragment: %#x, want drop", got)
	}
	if got := d.ifaceStats()[bpf.PolicyIfaceStatsFragUnknown]; got != 1 {
		t.Errorf("fragment-unknown drops: %d, want 1", got)
	}
}

// connectedNetns makes a network namespace with a TCP connection over its
// loopback, and returns the namespace's id in the test's namespace and
// the client's and server's ports. The listener stays open.
func connectedNetns(t *testing.T) (nsid int, client, server uint16) {
	t.Helper()
	type result struct {
		ns             *os.File
		client, server uint16
		err            error
	}
	done := make(chan result)
	go func() {
		// This thread enters the new namespace and never leaves it: Go
		// ends a locked thread whose goroutine returns. The sockets and
		// the namespace's file keep the namespace.
		runtime.LockOSThread()
		r := result{}
		defer func() { done <- r }()
		if r.err = unix.Unshare(unix.CLONE_NEWNET); r.err != nil {
			return
		}
		lo, err := netlink.LinkByName("lo")
		if err == nil {
			err = netlink.LinkSetUp(lo)
		}
		if err != nil {
			r.err = err
			return
		}
		l, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			r.err = err
			return
		}
		c, err := net.Dial("tcp4", l.Addr().String())
		if err != nil {
			r.err = err
			return
		}
		s, err := l.Accept()
		if err != nil {
			r.err = err
			return
		}
		t.Cleanup(func() { c.Close(); s.Close(); l.Close() })
		r.client = uint16(c.LocalAddr().(*net.TCPAddr).Port)
		r.server = uint16(l.Addr().(*net.TCPAddr).Port)
		r.ns, r.err = os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
	}()
	r := <-done
	if r.err != nil {
		t.Fatalf("a connection in a network namespace: %v", r.err)
	}
	defer r.ns.Close()
	// The namespace's id in the test's own (assigned if it has none), as
	// the agent reads a pod's from its interface.
	nsid, err := netlink.GetNetNsIdByFd(int(r.ns.Fd()))
	if err == nil && nsid < 0 {
		if err = netlink.SetNetNsIdByFd(int(r.ns.Fd()), -1); err == nil {
			nsid, err = netlink.GetNetNsIdByFd(int(r.ns.Fd()))
		}
	}
	if err != nil || nsid < 0 {
		t.Fatalf("the namespace's id: %d %v", nsid, err)
	}
	return nsid, r.client, r.server
}

// TestInterfaceKernelConnection: a TCP segment without SYN that policy
// denies and the interface's flows do not know passes only when the pod's
// network namespace has a connection with exactly its addresses and ports
// (one opened before the programs were attached), not a listener's port,
// not another port, and not when the interface does not name the
// namespace.
func TestInterfaceKernelConnection(t *testing.T) {
	const pod = "127.0.0.1"
	nsid, client, server := connectedNetns(t)
	d := newIfaceDatapath(t, pod)
	d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)
	setNetns := func(id int) {
		var v bpf.PolicyIfaceValue
		if err := d.maps.Ifaces.Lookup(uint32(loIfindex), &v); err != nil {
			t.Fatal(err)
		}
		v.SetNetns(id)
		if err := d.maps.Ifaces.Put(uint32(loIfindex), v); err != nil {
			t.Fatal(err)
		}
	}
	seg := func(sport, dport uint16) []byte {
		return frame(packet{src: pod, dst: pod, proto: tcp, sport: sport, dport: dport, tcpFlags: ackFlag | 0x08})
	}
	setNetns(-1)
	if got := d.run(FromPod, seg(client, server)); got != tcxDrop {
		t.Errorf("the connection's segment, the namespace unknown: %#x, want drop", got)
	}
	setNetns(nsid)
	for _, tc := range []struct {
		name         string
		prog         string
		sport, dport uint16
		want         uint32
	}{
		{"to a port no connection has", FromPod, client, server + 1, tcxDrop},
		{"from the listener's port to another", FromPod, server, server + 1, tcxDrop},
		{"the connection's, out", FromPod, client, server, tcxNext},
		{"the connection's, in", ToPod, server, client, tcxNext},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := d.run(tc.prog, seg(tc.sport, tc.dport)); got != tc.want {
				t.Errorf("%s: %#x, want %#x", tc.prog, got, tc.want)
			}
		})
	}
}
