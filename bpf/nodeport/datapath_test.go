package nodeport

import (
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

const (
	tcxNext = 0xffffffff // -1
	tcxDrop = 2
	// tcRedirect is TC_ACT_REDIRECT (TCX_REDIRECT).
	tcRedirect = 7
	tcp        = 6
	udp        = 17
)

// datapath is the programs loaded on maps of their own, in memory.
type datapath struct {
	maps  Maps
	progs map[string]*ebpf.Program
}

func newDatapath(tb testing.TB) *datapath {
	tb.Helper()
	testenv.RequireRoot(tb)
	spec, err := Spec()
	if err != nil {
		tb.Fatal(err)
	}
	mk := func(name string) *ebpf.Map {
		m, err := ebpf.NewMap(spec.Maps[name].Copy())
		if err != nil {
			tb.Fatalf("map %s: %v", name, err)
		}
		tb.Cleanup(func() { m.Close() })
		return m
	}
	d := &datapath{maps: Maps{
		Services4: mk(bpf.LB4ServicesMap), Backends4: mk(bpf.LB4BackendsMap),
		Devices: mk(DevicesMap), NAT4: mk(NAT4Map), Stats: mk(StatsMap), SourceRange4: mk(SourceRange4Map),
		AffinityMatch: mk(bpf.LBAffinityMatchMap), Affinity4: mk(Affinity4Map),
		Services6: mk(bpf.LB6ServicesMap), Backends6: mk(bpf.LB6BackendsMap),
		NAT6: mk(NAT6Map), SourceRange6: mk(SourceRange6Map), Affinity6: mk(Affinity6Map),
	}}
	mg, err := MaglevMapSpec(0)
	if err != nil {
		tb.Fatal(err)
	}
	if d.maps.Maglev, err = ebpf.NewMap(mg); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { d.maps.Maglev.Close() })
	d.progs, err = Load(Config{TCPTimeout: time.Hour, UDPTimeout: time.Minute}, d.maps)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		for _, p := range d.progs {
			p.Close()
		}
	})
	return d
}

// service writes a frontend with flags and the backends, IDs from 1.
func (d *datapath) service(tb testing.TB, fe netip.AddrPort, proto uint8, flags bpf.ServiceFlags, backends ...netip.AddrPort) {
	tb.Helper()
	d.serviceAffinity(tb, fe, proto, flags, 0, backends...)
}

// serviceAffinity is service with a session affinity timeout (seconds),
// the backends in lb_affinity_match as the agent writes them.
func (d *datapath) serviceAffinity(tb testing.TB, fe netip.AddrPort, proto uint8, flags bpf.ServiceFlags, timeout uint32, backends ...netip.AddrPort) {
	tb.Helper()
	key := bpf.LB4ServiceKey{Address: fe.Addr().As4(), Port: bpf.NewBe16(fe.Port()), Proto: proto}
	if timeout != 0 {
		flags |= bpf.SvcFlagSessionAffinity
		for i := range backends {
			if err := d.maps.AffinityMatch.Put(bpf.LBAffinityMatchKey{BackendID: uint32(i + 1), RevNat: bpf.NewBe16(1)}, uint8(0)); err != nil {
				tb.Fatal(err)
			}
		}
	}
	if err := d.maps.Services4.Put(key, bpf.LB4ServiceValue{BackendID: timeout, Count: uint16(len(backends)), RevNat: bpf.NewBe16(1), Flags: flags}); err != nil {
		tb.Fatal(err)
	}
	for i, be := range backends {
		id := uint32(i + 1)
		key.Slot = uint16(i + 1)
		if err := d.maps.Services4.Put(key, bpf.LB4ServiceValue{BackendID: id, RevNat: bpf.NewBe16(1), Flags: flags}); err != nil {
			tb.Fatal(err)
		}
		if err := d.maps.Backends4.Put(id, bpf.LB4BackendValue{Address: be.Addr().As4(), Port: bpf.NewBe16(be.Port()), Proto: proto}); err != nil {
			tb.Fatal(err)
		}
	}
}

func (d *datapath) run(tb testing.TB, prog string, frame []byte) (uint32, []byte) {
	tb.Helper()
	out := make([]byte, len(frame)+256)
	ret, err := d.progs[prog].Run(&ebpf.RunOptions{Data: frame, DataOut: out})
	if err != nil {
		tb.Fatal(err)
	}
	return ret, out[:len(frame)]
}

func (d *datapath) stat(tb testing.TB, s Stat) uint64 {
	tb.Helper()
	st, err := Stats(d.maps.Stats)
	if err != nil {
		tb.Fatal(err)
	}
	return st[StatNames[s]]
}

// frame builds an Ethernet frame of an IPv4 TCP SYN or UDP datagram with
// correct checksums.
func frame(proto uint8, src, dst netip.AddrPort) []byte {
	l4len := 20
	if proto == udp {
		l4len = 8 + 4
	}
	b := make([]byte, 14+20+l4len)
	binary.BigEndian.PutUint16(b[12:], 0x0800)
	ip := b[14:34]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(20+l4len))
	ip[8] = 64
	ip[9] = proto
	s4, d4 := src.Addr().As4(), dst.Addr().As4()
	copy(ip[12:], s4[:])
	copy(ip[16:], d4[:])
	binary.BigEndian.PutUint16(ip[10:], csum(ip, 0))
	l4 := b[34:]
	binary.BigEndian.PutUint16(l4[0:], src.Port())
	binary.BigEndian.PutUint16(l4[2:], dst.Port())
	if proto == tcp {
		l4[12] = 5 << 4
		l4[13] = 0x02 // SYN
		binary.BigEndian.PutUint16(l4[14:], 65535)
		binary.BigEndian.PutUint16(l4[16:], csum(l4, pseudo(ip, proto, len(l4))))
	} else {
		binary.BigEndian.PutUint16(l4[4:], uint16(l4len))
		copy(l4[8:], "ping")
		binary.BigEndian.PutUint16(l4[6:], csum(l4, pseudo(ip, proto, len(l4))))
	}
	return b
}

func pseudo(ip []byte, proto uint8, n int) uint32 {
	var s uint32
	for i := 12; i < 20; i += 2 {
		s += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	return s + uint32(proto) + uint32(n)
}

// csum is the Internet checksum of b plus the partial sum s; over a
// packet with its checksum in place it is 0.
func csum(b []byte, s uint32) uint16 {
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

// parsed reads the addresses of a frame and checks its checksums.
func parsed(tb testing.TB, b []byte) (src, dst netip.AddrPort) {
	tb.Helper()
	ip, l4 := b[14:34], b[34:]
	if c := csum(ip, 0); c != 0 {
		tb.Errorf("IP checksum off by %#x", c)
	}
	if c := csum(l4, pseudo(ip, ip[9], len(l4))); c != 0 {
		tb.Errorf("L4 checksum off by %#x", c)
	}
	src = netip.AddrPortFrom(netip.AddrFrom4([4]byte(ip[12:16])), binary.BigEndian.Uint16(l4[0:]))
	dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(ip[16:20])), binary.BigEndian.Uint16(l4[2:]))
	return src, dst
}

var (
	client   = netip.MustParseAddrPort("192.0.2.7:40000")
	nodePort = netip.MustParseAddrPort("10.0.0.1:30080")
	backend  = netip.MustParseAddrPort("10.244.0.5:8080")
)

// TestTranslate: a new flow from outside to a NodePort frontend goes to
// the backend (local: the client's address kept), with checksums right;
// its next packet takes the same way as a known flow; the backend's reply
// leaving through the device gets the frontend back. TCP and UDP.
func TestTranslate(t *testing.T) {
	for _, proto := range []uint8{tcp, udp} {
		t.Run(map[uint8]string{tcp: "TCP", udp: "UDP"}[proto], func(t *testing.T) {
			d := newDatapath(t)
			d.service(t, nodePort, proto, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable, backend)
			for i := range 2 {
				ret, out := d.run(t, IngressProg, frame(proto, client, nodePort))
				src, dst := parsed(t, out)
				if ret != tcxNext || src != client || dst != backend {
					t.Fatalf("packet %d: verdict %#x, %s -> %s; want %s -> %s", i, ret, src, dst, client, backend)
				}
			}
			if n := d.stat(t, StatNewLocal); n != 1 {
				t.Errorf("new_local %d, want 1", n)
			}
			if n := d.stat(t, StatForward); n != 1 {
				t.Errorf("forward %d, want 1", n)
			}
			ret, out := d.run(t, EgressProg, frame(proto, backend, client))
			src, dst := parsed(t, out)
			if ret != tcxNext || src != nodePort || dst != client {
				t.Fatalf("reply: verdict %#x, %s -> %s; want %s -> %s", ret, src, dst, nodePort, client)
			}
			flows, err := Flows(d.maps.NAT4)
			if err != nil || len(flows) != 1 || flows[0].Backend != backend || flows[0].NAT.IsValid() {
				t.Errorf("flows %+v %v", flows, err)
			}
		})
	}
}

// TestNotTranslated: a ClusterIP frontend (not routable) and an address
// that is no frontend pass untouched; a frontend without backends answers
// TCP with a reset and UDP with an ICMP port unreachable, sent back out
// of the device; counted.
func TestNotTranslated(t *testing.T) {
	d := newDatapath(t)
	clusterIP := netip.MustParseAddrPort("10.96.0.10:80")
	empty := netip.MustParseAddrPort("10.0.0.1:30099")
	d.service(t, clusterIP, tcp, 0, backend)
	d.service(t, empty, tcp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable)
	for _, dst := range []netip.AddrPort{clusterIP, netip.MustParseAddrPort("10.0.0.1:22")} {
		in := frame(tcp, client, dst)
		ret, out := d.run(t, IngressProg, in)
		if ret != tcxNext || string(out) != string(in) {
			t.Errorf("to %s: verdict %#x, changed %v", dst, ret, string(out) != string(in))
		}
	}
	// TCP is answered with a reset from the frontend, sent back out.
	syn := frame(tcp, client, empty)
	binary.BigEndian.PutUint32(syn[34+4:], 1000) // seq
	binary.BigEndian.PutUint16(syn[34+16:], 0)
	binary.BigEndian.PutUint16(syn[34+16:], csum(syn[34:], pseudo(syn[14:34], tcp, 20)))
	out := make([]byte, len(syn)+64)
	ret, err := d.progs[IngressProg].Run(&ebpf.RunOptions{Data: syn, DataOut: out})
	if err != nil {
		t.Fatal(err)
	}
	if ret != tcRedirect {
		t.Fatalf("TCP to a frontend without backends: verdict %#x, want redirect", ret)
	}
	src, dst := parsed(t, out[:54])
	l4 := out[34:54]
	if src != empty || dst != client || l4[13] != 0x14 /* RST|ACK */ || binary.BigEndian.Uint32(l4[8:]) != 1001 {
		t.Errorf("reset %s -> %s flags %#x ack %d; want %s -> %s RST|ACK ack 1001",
			src, dst, l4[13], binary.BigEndian.Uint32(l4[8:]), empty, client)
	}
	if n := d.stat(t, StatReset); n != 1 {
		t.Errorf("reset_sent %d, want 1", n)
	}
	// UDP is answered with an ICMP port unreachable from the frontend,
	// carrying the datagram's IP and UDP headers.
	d.service(t, empty, udp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable)
	dgram := frame(udp, client, empty)
	out = make([]byte, len(dgram)+64)
	ret, err = d.progs[IngressProg].Run(&ebpf.RunOptions{Data: dgram, DataOut: out})
	if err != nil {
		t.Fatal(err)
	}
	if ret != tcRedirect {
		t.Fatalf("UDP to a frontend without backends: verdict %#x, want redirect", ret)
	}
	const icmpLen = 20 + 8 + 20 + 8
	out = out[:14+icmpLen]
	ip, icmp := out[14:34], out[34:]
	if c := csum(ip, 0); c != 0 || csum(icmp, 0) != 0 {
		t.Errorf("checksums off: IP %#x ICMP %#x", c, csum(icmp, 0))
	}
	if got, want := netip.AddrFrom4([4]byte(ip[12:16])), empty.Addr(); got != want || ip[9] != 1 ||
		netip.AddrFrom4([4]byte(ip[16:20])) != client.Addr() || icmp[0] != 3 || icmp[1] != 3 ||
		string(icmp[8:8+28]) != string(dgram[14:14+28]) || binary.BigEndian.Uint16(ip[2:]) != icmpLen {
		t.Errorf("ICMP answer % x; want port unreachable from %s to %s quoting the datagram", out, empty.Addr(), client.Addr())
	}
	if n := d.stat(t, StatUnreach); n != 1 {
		t.Errorf("unreachable_sent %d, want 1", n)
	}
	if n := d.stat(t, StatNoBackend); n != 2 {
		t.Errorf("drop_no_backend %d, want 2", n)
	}
	// An unknown reply leaving passes untouched.
	if ret, _ := d.run(t, EgressProg, frame(tcp, backend, client)); ret != tcxNext {
		t.Errorf("unknown reply: verdict %#x", ret)
	}
}

// TestNATFull: with the NAT map full, a new flow is dropped and counted,
// not translated half-way.
func TestNATFull(t *testing.T) {
	d := newDatapath(t)
	spec, err := MapSpec(NAT4Map, 2)
	if err != nil {
		t.Fatal(err)
	}
	small, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	d.maps.NAT4 = small
	d.progs, err = Load(Config{TCPTimeout: time.Hour, UDPTimeout: time.Minute}, d.maps)
	if err != nil {
		t.Fatal(err)
	}
	d.service(t, nodePort, tcp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable, backend)
	if ret, _ := d.run(t, IngressProg, frame(tcp, client, nodePort)); ret != tcxNext {
		t.Fatalf("first flow: verdict %#x", ret)
	}
	other := netip.AddrPortFrom(client.Addr(), client.Port()+1)
	if ret, _ := d.run(t, IngressProg, frame(tcp, other, nodePort)); ret != tcxDrop {
		t.Fatalf("second flow, map full: verdict %#x, want drop", ret)
	}
	if n := d.stat(t, StatNATFull); n != 1 {
		t.Errorf("drop_nat_full %d, want 1", n)
	}
}

// TestExpire: idle flows go with both entries; fresh ones stay.
func TestExpire(t *testing.T) {
	d := newDatapath(t)
	d.service(t, nodePort, udp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable, backend)
	d.run(t, IngressProg, frame(udp, client, nodePort))
	cfg := Config{TCPTimeout: time.Hour, UDPTimeout: time.Minute}
	flows, _ := Flows(d.maps.NAT4)
	if len(flows) != 1 {
		t.Fatalf("flows %+v", flows)
	}
	seen := flows[0].LastSeen
	if del, kept, err := Expire(d.maps.NAT4, seen+30*time.Second, cfg); err != nil || del != 0 || kept != 2 {
		t.Errorf("within the timeout: deleted %d kept %d %v", del, kept, err)
	}
	if del, kept, err := Expire(d.maps.NAT4, seen+2*time.Minute, cfg); err != nil || del != 2 || kept != 0 {
		t.Errorf("past the timeout: deleted %d kept %d %v", del, kept, err)
	}
}

// BenchmarkPacket measures one run of the ingress program
// (BPF_PROG_TEST_RUN) on a packet of a known flow and on one to no
// frontend, in the kernel's own loop, and on a new flow (local backend).
func BenchmarkPacket(b *testing.B) {
	d := newDatapath(b)
	d.service(b, nodePort, tcp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable, backend)
	known := frame(tcp, client, nodePort)
	if ret, _ := d.run(b, IngressProg, known); ret != tcxNext {
		b.Fatalf("first packet: %#x", ret)
	}
	b.Run("known-flow", func(b *testing.B) {
		ret, per, err := d.progs[IngressProg].Benchmark(known, b.N, nil)
		if err != nil || ret != tcxNext {
			b.Fatal(ret, err)
		}
		b.ReportMetric(float64(per.Nanoseconds()), "prog-ns/op")
	})
	b.Run("not-frontend", func(b *testing.B) {
		// What every other packet on the device pays: three misses.
		other := frame(tcp, client, netip.MustParseAddrPort("10.0.0.1:22"))
		ret, per, err := d.progs[IngressProg].Benchmark(other, b.N, nil)
		if err != nil || ret != tcxNext {
			b.Fatal(ret, err)
		}
		b.ReportMetric(float64(per.Nanoseconds()), "prog-ns/op")
	})
	b.Run("new-flow", func(b *testing.B) {
		// One run per call, the NAT map emptied before each, so that
		// every run is a new flow (a backend chosen, two entries made).
		newFlow := frame(tcp, netip.AddrPortFrom(client.Addr(), 50000), nodePort)
		var total time.Duration
		for i := 0; i < b.N; i++ {
			clearNAT(b, d.maps.NAT4)
			_, per, err := d.progs[IngressProg].Benchmark(newFlow, 1, nil)
			if err != nil {
				b.Fatal(err)
			}
			total += per
		}
		b.ReportMetric(float64(total.Nanoseconds())/float64(b.N), "prog-ns/op")
	})
}

func clearNAT(tb testing.TB, m *ebpf.Map) {
	var k NATKey
	var keys []NATKey
	var v NATEntry
	for it := m.Iterate(); it.Next(&k, &v); {
		keys = append(keys, k)
	}
	for _, k := range keys {
		if err := m.Delete(&k); err != nil {
			tb.Fatal(err)
		}
	}
}

// TestSourceRanges: a LoadBalancer frontend with source ranges takes new
// flows from clients inside them only, the others dropped and counted; a
// NodePort frontend of the same rev-NAT index is not bound by them.
func TestSourceRanges(t *testing.T) {
	d := newDatapath(t)
	lbIP := netip.MustParseAddrPort("203.0.113.10:80")
	d.service(t, lbIP, tcp, bpf.SvcFlagLoadBalancer|bpf.SvcFlagRoutable, backend)
	for k, v := range SourceRangeKeys(1, []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}) {
		if err := d.maps.SourceRange4.Put(k, v); err != nil {
			t.Fatal(err)
		}
	}
	if ret, out := d.run(t, IngressProg, frame(tcp, client, lbIP)); ret != tcxNext {
		t.Errorf("client in range: verdict %#x", ret)
	} else if _, dst := parsed(t, out); dst != backend {
		t.Errorf("client in range: to %s, want %s", dst, backend)
	}
	outside := netip.MustParseAddrPort("198.51.100.1:40000")
	if ret, _ := d.run(t, IngressProg, frame(tcp, outside, lbIP)); ret != tcxDrop {
		t.Errorf("client outside the ranges: verdict %#x, want drop", ret)
	}
	if n := d.stat(t, StatSourceRange); n != 1 {
		t.Errorf("drop_source_range %d, want 1", n)
	}
	d.service(t, nodePort, tcp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable, backend)
	if ret, _ := d.run(t, IngressProg, frame(tcp, outside, nodePort)); ret != tcxNext {
		t.Errorf("NodePort from outside the ranges: verdict %#x", ret)
	}
}

// TestSessionAffinity: with ClientIP affinity, every new flow of a client
// goes to the backend its first went to; without, flows spread.
func TestSessionAffinity(t *testing.T) {
	other := netip.MustParseAddrPort("10.244.0.6:8080")
	for _, tt := range []struct {
		name    string
		timeout uint32
		want    int // distinct backends over 32 flows
	}{
		{"ClientIP", 60, 1},
		{"None", 0, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d := newDatapath(t)
			d.serviceAffinity(t, nodePort, tcp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable, tt.timeout, backend, other)
			seen := map[netip.AddrPort]bool{}
			for i := range 32 {
				src := netip.AddrPortFrom(client.Addr(), client.Port()+uint16(i))
				ret, out := d.run(t, IngressProg, frame(tcp, src, nodePort))
				if ret != tcxNext {
					t.Fatalf("flow %d: verdict %#x", i, ret)
				}
				_, dst := parsed(t, out)
				seen[dst] = true
			}
			if len(seen) != tt.want {
				t.Errorf("backends used %v, want %d of them", seen, tt.want)
			}
		})
	}
}

// service6 writes an IPv6 frontend with the backends, IDs from 101.
func (d *datapath) service6(tb testing.TB, fe netip.AddrPort, proto uint8, flags bpf.ServiceFlags, backends ...netip.AddrPort) {
	tb.Helper()
	d.service6Affinity(tb, fe, proto, flags, 0, backends...)
}

// service6Affinity is service6 with a session affinity timeout.
func (d *datapath) service6Affinity(tb testing.TB, fe netip.AddrPort, proto uint8, flags bpf.ServiceFlags, timeout uint32, backends ...netip.AddrPort) {
	tb.Helper()
	key := bpf.LB6ServiceKey{Address: fe.Addr().As16(), Port: bpf.NewBe16(fe.Port()), Proto: proto}
	if timeout != 0 {
		flags |= bpf.SvcFlagSessionAffinity
		for i := range backends {
			if err := d.maps.AffinityMatch.Put(bpf.LBAffinityMatchKey{BackendID: uint32(101 + i), RevNat: bpf.NewBe16(2)}, uint8(0)); err != nil {
				tb.Fatal(err)
			}
		}
	}
	if err := d.maps.Services6.Put(key, bpf.LB6ServiceValue{BackendID: timeout, Count: uint16(len(backends)), RevNat: bpf.NewBe16(2), Flags: flags}); err != nil {
		tb.Fatal(err)
	}
	for i, be := range backends {
		id := uint32(101 + i)
		key.Slot = uint16(i + 1)
		if err := d.maps.Services6.Put(key, bpf.LB6ServiceValue{BackendID: id, RevNat: bpf.NewBe16(2), Flags: flags}); err != nil {
			tb.Fatal(err)
		}
		if err := d.maps.Backends6.Put(id, bpf.LB6BackendValue{Address: be.Addr().As16(), Port: bpf.NewBe16(be.Port()), Proto: proto}); err != nil {
			tb.Fatal(err)
		}
	}
}

// frame6 is frame for IPv6.
func frame6(proto uint8, src, dst netip.AddrPort) []byte {
	l4len := 20
	if proto == udp {
		l4len = 8 + 4
	}
	b := make([]byte, 14+40+l4len)
	binary.BigEndian.PutUint16(b[12:], 0x86dd)
	ip := b[14:54]
	ip[0] = 0x60
	binary.BigEndian.PutUint16(ip[4:], uint16(l4len))
	ip[6] = proto
	ip[7] = 64
	s16, d16 := src.Addr().As16(), dst.Addr().As16()
	copy(ip[8:], s16[:])
	copy(ip[24:], d16[:])
	l4 := b[54:]
	binary.BigEndian.PutUint16(l4[0:], src.Port())
	binary.BigEndian.PutUint16(l4[2:], dst.Port())
	if proto == tcp {
		l4[12] = 5 << 4
		l4[13] = 0x02
		binary.BigEndian.PutUint16(l4[14:], 65535)
		binary.BigEndian.PutUint16(l4[16:], csum(l4, pseudo6(ip, proto, len(l4))))
	} else {
		binary.BigEndian.PutUint16(l4[4:], uint16(l4len))
		copy(l4[8:], "ping")
		binary.BigEndian.PutUint16(l4[6:], csum(l4, pseudo6(ip, proto, len(l4))))
	}
	return b
}

func pseudo6(ip []byte, proto uint8, n int) uint32 {
	var s uint32
	for i := 8; i < 40; i += 2 {
		s += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	return s + uint32(proto) + uint32(n)
}

func parsed6(tb testing.TB, b []byte) (src, dst netip.AddrPort) {
	tb.Helper()
	ip, l4 := b[14:54], b[54:]
	if c := csum(l4, pseudo6(ip, ip[6], len(l4))); c != 0 {
		tb.Errorf("L4 checksum off by %#x", c)
	}
	src = netip.AddrPortFrom(netip.AddrFrom16([16]byte(ip[8:24])), binary.BigEndian.Uint16(l4[0:]))
	dst = netip.AddrPortFrom(netip.AddrFrom16([16]byte(ip[24:40])), binary.BigEndian.Uint16(l4[2:]))
	return src, dst
}

// TestTranslate6: TestTranslate for IPv6, and IPv6 source ranges.
func TestTranslate6(t *testing.T) {
	client6 := netip.MustParseAddrPort("[2001:db8::7]:40000")
	front6 := netip.MustParseAddrPort("[fd00::1]:30080")
	backend6 := netip.MustParseAddrPort("[fd00:244::5]:8080")
	for _, proto := range []uint8{tcp, udp} {
		t.Run(map[uint8]string{tcp: "TCP", udp: "UDP"}[proto], func(t *testing.T) {
			d := newDatapath(t)
			d.service6(t, front6, proto, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable, backend6)
			for i := range 2 {
				ret, out := d.run(t, IngressProg, frame6(proto, client6, front6))
				src, dst := parsed6(t, out)
				if ret != tcxNext || src != client6 || dst != backend6 {
					t.Fatalf("packet %d: verdict %#x, %s -> %s; want %s -> %s", i, ret, src, dst, client6, backend6)
				}
			}
			ret, out := d.run(t, EgressProg, frame6(proto, backend6, client6))
			src, dst := parsed6(t, out)
			if ret != tcxNext || src != front6 || dst != client6 {
				t.Fatalf("reply: verdict %#x, %s -> %s; want %s -> %s", ret, src, dst, front6, client6)
			}
			flows, err := Flows6(d.maps.NAT6)
			if err != nil || len(flows) != 1 || flows[0].Backend != backend6 {
				t.Errorf("flows %+v %v", flows, err)
			}
		})
	}
	t.Run("session affinity", func(t *testing.T) {
		for _, tt := range []struct {
			timeout uint32
			want    int
		}{{60, 1}, {0, 2}} {
			d := newDatapath(t)
			other6 := netip.MustParseAddrPort("[fd00:244::6]:8080")
			d.service6Affinity(t, front6, tcp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable, tt.timeout, backend6, other6)
			seen := map[netip.AddrPort]bool{}
			for i := range 32 {
				src := netip.AddrPortFrom(client6.Addr(), client6.Port()+uint16(i))
				ret, out := d.run(t, IngressProg, frame6(tcp, src, front6))
				if ret != tcxNext {
					t.Fatalf("flow %d: verdict %#x", i, ret)
				}
				_, dst := parsed6(t, out)
				seen[dst] = true
			}
			if len(seen) != tt.want {
				t.Errorf("timeout %d: backends used %v, want %d of them", tt.timeout, seen, tt.want)
			}
		}
	})
	t.Run("source ranges", func(t *testing.T) {
		d := newDatapath(t)
		d.service6(t, front6, tcp, bpf.SvcFlagLoadBalancer|bpf.SvcFlagRoutable, backend6)
		for k, v := range SourceRange6Keys(2, []netip.Prefix{netip.MustParsePrefix("2001:db8::/64")}) {
			if err := d.maps.SourceRange6.Put(k, v); err != nil {
				t.Fatal(err)
			}
		}
		if ret, _ := d.run(t, IngressProg, frame6(tcp, client6, front6)); ret != tcxNext {
			t.Errorf("client in range: verdict %#x", ret)
		}
		if ret, _ := d.run(t, IngressProg, frame6(tcp, netip.MustParseAddrPort("[2001:db9::1]:1000"), front6)); ret != tcxDrop {
			t.Errorf("client outside: verdict %#x, want drop", ret)
		}
	})
}

// TestRefused6: an IPv6 frontend without backends answers TCP with a
// reset and UDP with an ICMPv6 port unreachable, from the frontend to the
// client, with the checksums right.
func TestRefused6(t *testing.T) {
	client6 := netip.MustParseAddrPort("[2001:db8::7]:40000")
	front6 := netip.MustParseAddrPort("[fd00::1]:30099")
	d := newDatapath(t)
	d.service6(t, front6, tcp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable)
	d.service6(t, front6, udp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable)

	syn := frame6(tcp, client6, front6)
	l4 := syn[54:]
	binary.BigEndian.PutUint32(l4[4:], 1000) // seq
	binary.BigEndian.PutUint16(l4[16:], 0)
	binary.BigEndian.PutUint16(l4[16:], csum(l4, pseudo6(syn[14:54], tcp, len(l4))))
	out := make([]byte, len(syn)+128)
	ret, err := d.progs[IngressProg].Run(&ebpf.RunOptions{Data: syn, DataOut: out})
	if err != nil {
		t.Fatal(err)
	}
	if ret != tcRedirect {
		t.Fatalf("TCP: verdict %#x, want redirect", ret)
	}
	src, dst := parsed6(t, out[:14+40+20])
	rst := out[54:74]
	if src != front6 || dst != client6 || rst[13] != 0x14 || binary.BigEndian.Uint32(rst[8:]) != 1001 {
		t.Errorf("reset %s -> %s flags %#x ack %d; want %s -> %s RST|ACK ack 1001",
			src, dst, rst[13], binary.BigEndian.Uint32(rst[8:]), front6, client6)
	}

	dgram := frame6(udp, client6, front6)
	out = make([]byte, len(dgram)+128)
	ret, err = d.progs[IngressProg].Run(&ebpf.RunOptions{Data: dgram, DataOut: out})
	if err != nil {
		t.Fatal(err)
	}
	if ret != tcRedirect {
		t.Fatalf("UDP: verdict %#x, want redirect", ret)
	}
	const icmpLen = 8 + 40 + 8
	ip, icmp := out[14:54], out[54:54+icmpLen]
	if c := csum(icmp, pseudo6(ip, 58, icmpLen)); c != 0 {
		t.Errorf("ICMPv6 checksum off by %#x", c)
	}
	if netip.AddrFrom16([16]byte(ip[8:24])) != front6.Addr() || netip.AddrFrom16([16]byte(ip[24:40])) != client6.Addr() ||
		ip[6] != 58 || binary.BigEndian.Uint16(ip[4:]) != icmpLen || icmp[0] != 1 || icmp[1] != 4 ||
		string(icmp[8:8+48]) != string(dgram[14:14+48]) {
		t.Errorf("ICMPv6 answer % x; want port unreachable from %s to %s quoting the datagram", out[:14+40+icmpLen], front6.Addr(), client6.Addr())
	}
	for s, want := range map[Stat]uint64{StatReset: 1, StatUnreach: 1, StatNoBackend: 2} {
		if n := d.stat(t, s); n != want {
			t.Errorf("%s %d, want %d", StatNames[s], n, want)
		}
	}
}

// TestMaglev: with Maglev tables (Config.MaglevSize), a new flow's backend
// is the one its frontend's table names for the flow's hash; a table that
// names a backend no longer there, or no table, falls back to a random
// active one.
func TestMaglev(t *testing.T) {
	const size = 251
	d := newDatapath(t)
	mg, err := MaglevMapSpec(size)
	if err != nil {
		t.Fatal(err)
	}
	if d.maps.Maglev, err = ebpf.NewMap(mg); err != nil {
		t.Fatal(err)
	}
	defer d.maps.Maglev.Close()
	if d.progs, err = Load(Config{TCPTimeout: time.Hour, UDPTimeout: time.Minute, MaglevSize: size}, d.maps); err != nil {
		t.Fatal(err)
	}
	other := netip.MustParseAddrPort("10.244.0.6:8080")
	d.service(t, nodePort, tcp, bpf.SvcFlagNodePort|bpf.SvcFlagRoutable, backend, other)
	flows := func() map[netip.AddrPort]int {
		seen := map[netip.AddrPort]int{}
		for i := range 64 {
			src := netip.AddrPortFrom(client.Addr(), client.Port()+uint16(i))
			ret, out := d.run(t, IngressProg, frame(tcp, src, nodePort))
			if ret != tcxNext {
				t.Fatalf("flow %d: verdict %#x", i, ret)
			}
			_, dst := parsed(t, out)
			seen[dst]++
		}
		return seen
	}
	table := func(id uint32) {
		lut := make([]uint32, size)
		for i := range lut {
			lut[i] = id
		}
		if err := d.maps.Maglev.Put(MaglevKey{RevNat: bpf.NewBe16(1)}, lut); err != nil {
			t.Fatal(err)
		}
	}
	table(2)
	if seen := flows(); seen[other] != 64 {
		t.Errorf("a table naming backend 2 everywhere: %v, want all to %s", seen, other)
	}
	d.maps.NAT4 = mustClear(t, d.maps.NAT4)
	table(99) // no such backend
	if seen := flows(); len(seen) != 2 {
		t.Errorf("a table naming a backend that is gone: %v, want both backends (random)", seen)
	}
}

// mustClear empties a hash map and returns it.
func mustClear(tb testing.TB, m *ebpf.Map) *ebpf.Map {
	tb.Helper()
	var k NATKey
	var keys []NATKey
	it := m.Iterate()
	var v NATEntry
	for it.Next(&k, &v) {
		keys = append(keys, k)
	}
	for _, k := range keys {
		m.Delete(k)
	}
	return m
}
