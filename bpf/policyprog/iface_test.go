package policyprog

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// Verdicts of the interface programs, as tcx reads their return values.
const (
	tcxNext = ^uint32(0) // -1: passed on
	tcxDrop = 2
)

// loIfindex is the interface BPF_PROG_TEST_RUN gives a packet: loopback.
// The tests register it as the pod's interface.
const loIfindex = 1

// ifaceDatapath is the interface programs on fresh maps, run on packets
// made by the test (BPF_PROG_TEST_RUN), with loopback as the pod's
// interface.
type ifaceDatapath struct {
	t     testing.TB
	maps  InterfaceMaps
	progs map[string]*ebpf.Program
	flows *ebpf.Map
	frags *ebpf.Map
}

const ifacePodCgroup = 4242

func newIfaceDatapath(t testing.TB, podAddrs ...string) *ifaceDatapath {
	t.Helper()
	testenv.RequireRoot(t)
	newMap := func(spec *ebpf.MapSpec) *ebpf.Map { return newTestMap(t, spec) }
	d := &ifaceDatapath{t: t, maps: InterfaceMaps{
		Policy:     newMap(bpf.PolicyMapSpec(1024)),
		Endpoints:  newMap(bpf.PolicyEndpointsMapSpec(64)),
		Stats:      newMap(bpf.PolicyStatsMapSpec()),
		IPCache:    newMap(bpf.IPCacheMapSpec(1024)),
		Prefixes:   newMap(bpf.PolicyPrefixesMapSpec(1024)),
		Events:     newMap(bpf.PolicyEventsMapSpec(bpf.DefaultPolicyEventsSize)),
		Ifaces:     newMap(bpf.PolicyIfacesMapSpec(64)),
		Flows:      newMap(bpf.PolicyIfaceFlowsMapSpec(64, 16)),
		Frags:      newMap(bpf.PolicyIfaceFragsMapSpec(64)),
		IfaceStats: newMap(bpf.PolicyIfaceStatsMapSpec()),
	}}
	progs, err := LoadInterface(d.maps)
	if err != nil {
		t.Fatal(err)
	}
	d.progs = progs
	t.Cleanup(func() {
		for _, p := range progs {
			p.Close()
		}
	})
	var addrs []netip.Addr
	for _, a := range podAddrs {
		addrs = append(addrs, netip.MustParseAddr(a))
	}
	v, err := bpf.NewPolicyIfaceValue(ifacePodCgroup, bpf.PolicyIfaceUnclassifiedDeny, addrs)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.maps.Ifaces.Put(uint32(loIfindex), v); err != nil {
		t.Fatal(err)
	}
	d.flows = newMap(bpf.PolicyIfaceFlowsInnerSpec(16))
	if err := d.maps.Flows.Put(uint32(loIfindex), d.flows); err != nil {
		t.Fatal(err)
	}
	d.frags = newMap(bpf.PolicyIfaceFragsInnerSpec())
	if err := d.maps.Frags.Put(uint32(loIfindex), d.frags); err != nil {
		t.Fatal(err)
	}
	return d
}

func (d *ifaceDatapath) endpoint(flags uint32) {
	d.t.Helper()
	v := bpf.PolicyEndpointValue{EndpointID: testEndpoint, Flags: flags}
	if err := d.maps.Endpoints.Put(uint64(ifacePodCgroup), v); err != nil {
		d.t.Fatal(err)
	}
}

func (d *ifaceDatapath) identity(addr string, id uint32) {
	d.t.Helper()
	a := netip.MustParseAddr(addr)
	if err := d.maps.IPCache.Put(bpf.NewIPCacheKey(netip.PrefixFrom(a, a.BitLen())), bpf.IPCacheValue{Identity: id}); err != nil {
		d.t.Fatal(err)
	}
}

func (d *ifaceDatapath) allow(identity uint32, dir, proto uint8, port uint16) {
	d.t.Helper()
	k := bpf.NewPolicyKey(testEndpoint, identity, dir, proto, port, 16)
	if err := d.maps.Policy.Put(k, bpf.PolicyValue{Cookie: 1}); err != nil {
		d.t.Fatal(err)
	}
}

// run runs prog on the frame and returns its verdict.
func (d *ifaceDatapath) run(prog string, frame []byte) uint32 {
	d.t.Helper()
	ret, err := d.progs[prog].Run(&ebpf.RunOptions{Data: frame})
	if err != nil {
		d.t.Fatalf("run %s: %s", prog, err)
	}
	return ret
}

func (d *ifaceDatapath) ifaceStats() (s [bpf.PolicyIfaceStatsEntries]uint64) {
	d.t.Helper()
	for i := range s {
		var perCPU []uint64
		if err := d.maps.IfaceStats.Lookup(uint32(i), &perCPU); err != nil {
			d.t.Fatal(err)
		}
		for _, n := range perCPU {
			s[i] += n
		}
	}
	return s
}

// packet describes a frame the tests make.
type packet struct {
	src, dst         string
	sport, dport     uint16
	proto            uint8
	tcpFlags         uint8
	fragFirst, fragN bool // the first of several fragments, a later one
	fragID           uint16
}

const (
	synFlag = 0x02
	ackFlag = 0x10
)

// frame builds an Ethernet frame of p (checksums are left zero: nothing
// checks them on the way through a tc program).
func frame(p packet) []byte {
	src, dst := netip.MustParseAddr(p.src), netip.MustParseAddr(p.dst)
	var l4 []byte
	switch p.proto {
	case tcp:
		l4 = make([]byte, 20)
		binary.BigEndian.PutUint16(l4[0:], p.sport)
		binary.BigEndian.PutUint16(l4[2:], p.dport)
		l4[12] = 5 << 4
		l4[13] = p.tcpFlags
	case udp:
		l4 = make([]byte, 8)
		binary.BigEndian.PutUint16(l4[0:], p.sport)
		binary.BigEndian.PutUint16(l4[2:], p.dport)
		binary.BigEndian.PutUint16(l4[4:], 8)
	default:
		l4 = make([]byte, 8)
	}
	if p.fragN {
		l4 = make([]byte, 16) // payload only
	}
	eth := make([]byte, 14)
	copy(eth[0:6], []byte{0x02, 0, 0, 0, 0, 1})
	copy(eth[6:12], []byte{0x02, 0, 0, 0, 0, 2})
	if src.Is4() {
		binary.BigEndian.PutUint16(eth[12:], 0x0800)
		ip := make([]byte, 20)
		ip[0] = 0x45
		binary.BigEndian.PutUint16(ip[2:], uint16(20+len(l4)))
		binary.BigEndian.PutUint16(ip[4:], p.fragID)
		switch {
		case p.fragN:
			binary.BigEndian.PutUint16(ip[6:], 0x2000|3) // offset 24 bytes, more
		case p.fragFirst:
			binary.BigEndian.PutUint16(ip[6:], 0x2000)
		}
		ip[8] = 64
		ip[9] = p.proto
		s4, d4 := src.As4(), dst.As4()
		copy(ip[12:], s4[:])
		copy(ip[16:], d4[:])
		return append(append(eth, ip...), l4...)
	}
	binary.BigEndian.PutUint16(eth[12:], 0x86dd)
	ip := make([]byte, 40)
	ip[0] = 0x60
	ip[6] = p.proto
	ip[7] = 64
	s16, d16 := src.As16(), dst.As16()
	copy(ip[8:], s16[:])
	copy(ip[24:], d16[:])
	if p.fragFirst || p.fragN {
		ip[6] = 44
		fh := make([]byte, 8)
		fh[0] = p.proto
		if p.fragN {
			binary.BigEndian.PutUint16(fh[2:], 3<<3|1)
		} else {
			binary.BigEndian.PutUint16(fh[2:], 1)
		}
		binary.BigEndian.PutUint32(fh[4:], uint32(p.fragID))
		l4 = append(fh, l4...)
	}
	binary.BigEndian.PutUint16(ip[4:], uint16(len(l4)))
	return append(append(eth, ip...), l4...)
}

// arpFrame is an ARP request from the pod claiming sender address spa.
func arpFrame(spa string) []byte {
	f := make([]byte, 14+28)
	binary.BigEndian.PutUint16(f[12:], 0x0806)
	binary.BigEndian.PutUint16(f[14:], 1)      // Ethernet
	binary.BigEndian.PutUint16(f[16:], 0x0800) // IPv4
	f[18], f[19] = 6, 4
	binary.BigEndian.PutUint16(f[20:], 1) // request
	a := netip.MustParseAddr(spa).As4()
	copy(f[28:], a[:])
	return f
}

// TestInterfaceSpoofing: a pod's interface passes only what the pod sends
// from its own addresses (and ARP that claims them, and neighbour
// discovery), whatever its policy; frames that are neither IP nor ARP are
// dropped; spoofed ones are counted.
func TestInterfaceSpoofing(t *testing.T) {
	d := newIfaceDatapath(t, "10.244.0.5", "fd00:244::5")
	d.endpoint(0) // no policy: only the sources are checked

	for _, tc := range []struct {
		name  string
		frame []byte
		want  uint32
	}{
		{"own IPv4", frame(packet{src: "10.244.0.5", dst: "10.244.0.9", proto: udp, sport: 1000, dport: 53}), tcxNext},
		{"own IPv6", frame(packet{src: "fd00:244::5", dst: "fd00:244::9", proto: tcp, sport: 1000, dport: 80, tcpFlags: synFlag}), tcxNext},
		{"another pod's IPv4", frame(packet{src: "10.244.0.6", dst: "10.244.0.9", proto: udp, sport: 1000, dport: 53}), tcxDrop},
		{"another pod's IPv6", frame(packet{src: "fd00:244::6", dst: "fd00:244::9", proto: udp, sport: 1000, dport: 53}), tcxDrop},
		{"IPv4-mapped own address as IPv6", frame(packet{src: "::ffff:10.244.0.5", dst: "fd00:244::9", proto: udp, sport: 1, dport: 2}), tcxDrop},
		{"ARP for its own address", arpFrame("10.244.0.5"), tcxNext},
		{"ARP probe", arpFrame("0.0.0.0"), tcxNext},
		{"ARP for another address", arpFrame("10.244.0.1"), tcxDrop},
		{"neither IP nor ARP", append(make([]byte, 12), 0x88, 0xb5, 1, 2, 3, 4), tcxDrop},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := d.run(FromPod, tc.frame); got != tc.want {
				t.Errorf("from pod: %#x, want %#x", got, tc.want)
			}
		})
	}
	s := d.ifaceStats()
	if s[bpf.PolicyIfaceStatsSpoofed] != 4 || s[bpf.PolicyIfaceStatsNotIP] != 1 {
		t.Errorf("spoofed %d, not IP %d; want 4 and 1", s[bpf.PolicyIfaceStatsSpoofed], s[bpf.PolicyIfaceStatsNotIP])
	}
}

// TestInterfaceVerdicts: egress and ingress policy on the pod's packets,
// the replies of allowed flows, fragments, and a pod unknown to policy.
func TestInterfaceVerdicts(t *testing.T) {
	const pod, pod6 = "10.244.0.5", "fd00:244::5"
	for _, fam := range []struct{ name, pod, peer, other string }{
		{"IPv4", pod, "10.244.1.7", "10.244.1.8"},
		{"IPv6", pod6, "fd00:244:1::7", "fd00:244:1::8"},
	} {
		t.Run(fam.name, func(t *testing.T) {
			d := newIfaceDatapath(t, pod, pod6)
			d.identity(fam.peer, 1000)
			d.identity(fam.other, 1001)
			d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)
			d.allow(1000, bpf.PolicyEgress, udp, 53)
			d.allow(1000, bpf.PolicyEgress, tcp, 443)
			d.allow(1001, bpf.PolicyIngress, tcp, 8080)

			out := func(p packet) uint32 { p.src, p.dst = fam.pod, cmpOr(p.dst, fam.peer); return d.run(FromPod, frame(p)) }
			in := func(p packet) uint32 { p.src, p.dst = cmpOr(p.src, fam.peer), fam.pod; return d.run(ToPod, frame(p)) }
			steps := []struct {
				name string
				got  func() uint32
				want uint32
			}{
				{"egress allowed", func() uint32 { return out(packet{proto: udp, sport: 4000, dport: 53}) }, tcxNext},
				{"its reply", func() uint32 { return in(packet{proto: udp, sport: 53, dport: 4000}) }, tcxNext},
				{"a datagram from the same peer to another port", func() uint32 { return in(packet{proto: udp, sport: 53, dport: 4001}) }, tcxDrop},
				{"egress denied port", func() uint32 { return out(packet{proto: udp, sport: 4000, dport: 54}) }, tcxDrop},
				{"egress denied peer", func() uint32 { return out(packet{dst: fam.other, proto: udp, sport: 4000, dport: 53}) }, tcxDrop},
				{"ingress allowed SYN", func() uint32 {
					return in(packet{src: fam.other, proto: tcp, sport: 5000, dport: 8080, tcpFlags: synFlag})
				}, tcxNext},
				{"the pod's SYN-ACK", func() uint32 {
					return out(packet{dst: fam.other, proto: tcp, sport: 8080, dport: 5000, tcpFlags: synFlag | ackFlag})
				}, tcxNext},
				{"ingress denied SYN", func() uint32 { return in(packet{proto: tcp, sport: 5000, dport: 8080, tcpFlags: synFlag}) }, tcxDrop},
				// What policy would say of a SYN the other way lets no
				// segment without SYN through: only a connection the
				// flows or the pod's kernel know (TestInterfaceKernelConnection).
				{"ACK of no known connection, its egress would allow", func() uint32 {
					return in(packet{proto: tcp, sport: 443, dport: 6000, tcpFlags: ackFlag})
				}, tcxDrop},
				{"PSH/ACK to a denied peer from a port its ingress allows", func() uint32 {
					return out(packet{dst: fam.other, proto: tcp, sport: 8080, dport: 4444, tcpFlags: ackFlag | 0x08})
				}, tcxDrop},
				{"ACK of no allowed connection", func() uint32 { return in(packet{proto: tcp, sport: 444, dport: 6000, tcpFlags: ackFlag}) }, tcxDrop},
				{"first fragment allowed", func() uint32 { return out(packet{proto: udp, sport: 4002, dport: 53, fragFirst: true, fragID: 77}) }, tcxNext},
				{"its later fragment", func() uint32 { return out(packet{proto: udp, fragN: true, fragID: 77}) }, tcxNext},
				{"a later fragment of nothing", func() uint32 { return out(packet{proto: udp, fragN: true, fragID: 78}) }, tcxDrop},
			}
			for _, s := range steps {
				if got := s.got(); got != s.want {
					t.Errorf("%s: %#x, want %#x", s.name, got, s.want)
				}
			}
		})
	}
}

// TestInterfaceUnclassified: a pod's interface whose cgroup is in no
// endpoint yet passes nothing either way (its own addresses or not).
func TestInterfaceUnclassified(t *testing.T) {
	d := newIfaceDatapath(t, "10.244.0.5")
	p := packet{src: "10.244.0.5", dst: "10.244.0.9", proto: tcp, sport: 1000, dport: 80, tcpFlags: synFlag}
	if got := d.run(FromPod, frame(p)); got != tcxDrop {
		t.Errorf("from an unclassified pod: %#x, want drop", got)
	}
	p.src, p.dst = p.dst, p.src
	if got := d.run(ToPod, frame(p)); got != tcxDrop {
		t.Errorf("to an unclassified pod: %#x, want drop", got)
	}
	d.endpoint(0)
	if got := d.run(ToPod, frame(p)); got != tcxNext {
		t.Errorf("to the pod once registered without policy: %#x, want pass", got)
	}
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
