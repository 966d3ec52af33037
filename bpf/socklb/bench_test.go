package socklb

import (
	"net"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
)

// BenchmarkConnect measures a TCP connect (dial, accept, close) over
// loopback, IPv4 and IPv6 alike, from a cgroup the benchmark process moves
// itself into: without programs (nohook), with the programs attached to a
// non-service address (direct: the exact and the wildcard lookups miss),
// to a service frontend whose only backend is the listener (vip), and to
// one with session affinity (affinity: the entry is found and followed).
// conns/s is connections per second; hook-ns/op is the time the connect
// program itself takes per connection (from the kernel's BPF statistics,
// on for the benchmark), which the noise of the handshakes hides.
func BenchmarkConnect(b *testing.B) {
	l := newLB(b)
	type target struct {
		network         string
		backend         netip.AddrPort
		vip, affinityIP netip.AddrPort
	}
	var targets []target
	for i, fam := range []struct{ network, loopback, vip, affinity string }{
		{"tcp4", "127.0.0.1", "10.96.0.99:80", "10.96.0.98:80"},
		{"tcp6", "::1", "[fd00:96::99]:80", "[fd00:96::98]:80"},
	} {
		backend := serveDiscard(b, fam.network, fam.loopback)
		vip, aff := netip.MustParseAddrPort(fam.vip), netip.MustParseAddrPort(fam.affinity)
		id := uint32(10 * i)
		l.backend(id+1, backend, tcp, bpf.BackendActive)
		l.service(uint16(id+1), vip, tcp, 0, []uint32{id + 1}, nil)
		l.service(uint16(id+2), aff, tcp, 3600, []uint32{id + 1}, nil)
		targets = append(targets, target{fam.network, backend, vip, aff})
	}
	progs := l.load()
	cg := enterCgroup(b)
	stats, err := ebpf.EnableStats(unix.BPF_STATS_RUN_TIME)
	if err != nil {
		b.Fatalf("enable BPF statistics: %s", err)
	}
	defer stats.Close()
	connectProg := map[string]*ebpf.Program{"tcp4": progs[socklbProgSock4Connect], "tcp6": progs[socklbProgSock6Connect]}

	for _, tc := range []struct {
		name   string
		addr   func(target) netip.AddrPort
		before func()
	}{
		// Without programs; then a non-service address, which costs
		// the hook its lookups; then the frontends.
		{"nohook", func(tg target) netip.AddrPort { return tg.backend }, nil},
		{"direct", func(tg target) netip.AddrPort { return tg.backend }, func() { attach(b, cg, progs) }},
		{"vip", func(tg target) netip.AddrPort { return tg.vip }, nil},
		{"affinity", func(tg target) netip.AddrPort { return tg.affinityIP }, nil},
	} {
		if tc.before != nil {
			tc.before()
		}
		for _, tg := range targets {
			addr := tc.addr(tg)
			name := map[string]string{"tcp4": "ipv4", "tcp6": "ipv6"}[tg.network]
			b.Run(tc.name+"/"+name, func(b *testing.B) {
				before := progStats(b, connectProg[tg.network])
				for b.Loop() {
					c, err := net.Dial(tg.network, addr.String())
					if err != nil {
						b.Fatal(err)
					}
					if got := c.RemoteAddr().(*net.TCPAddr).AddrPort(); got != addr {
						b.Fatalf("peer %s, want %s", got, addr)
					}
					c.Close()
				}
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "conns/s")
				if after := progStats(b, connectProg[tg.network]); after.RunCount > before.RunCount {
					b.ReportMetric(float64(after.Runtime-before.Runtime)/float64(after.RunCount-before.RunCount), "hook-ns/op")
				}
			})
		}
	}
}

func progStats(b *testing.B, p *ebpf.Program) *ebpf.ProgramStats {
	st, err := p.Stats()
	if err != nil {
		b.Fatalf("program statistics: %s", err)
	}
	return st
}

// serveDiscard accepts and closes connections on a free port of addr until
// the benchmark ends.
func serveDiscard(b *testing.B, network, addr string) netip.AddrPort {
	l, err := net.Listen(network, net.JoinHostPort(addr, "0"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	return l.Addr().(*net.TCPAddr).AddrPort()
}

// BenchmarkConnectTraced is BenchmarkConnect's vip/ipv4 with the
// translation events on (the agent serving Hubble) and a reader draining
// them as the agent does: hook-ns/op against BenchmarkConnect's is what a
// report costs a connection.
func BenchmarkConnectTraced(b *testing.B) {
	l := newLB(b)
	evSpec, lostSpec, err := XlateMapSpecs()
	if err != nil {
		b.Fatal(err)
	}
	if l.XlateEvents, err = ebpf.NewMap(evSpec); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { l.XlateEvents.Close() })
	if l.XlateLost, err = ebpf.NewMap(lostSpec); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { l.XlateLost.Close() })
	rd, err := ringbuf.NewReader(l.XlateEvents)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { rd.Close() })
	go func() {
		for {
			if _, err := rd.Read(); err != nil {
				return
			}
		}
	}()
	backend := serveDiscard(b, "tcp4", "127.0.0.1")
	vip := netip.MustParseAddrPort("10.96.0.99:80")
	l.backend(1, backend, tcp, bpf.BackendActive)
	l.service(1, vip, tcp, 0, []uint32{1}, nil)
	progs := l.load()
	attach(b, enterCgroup(b), progs)
	stats, err := ebpf.EnableStats(unix.BPF_STATS_RUN_TIME)
	if err != nil {
		b.Fatalf("enable BPF statistics: %s", err)
	}
	defer stats.Close()
	prog := progs[socklbProgSock4Connect]
	before := progStats(b, prog)
	for b.Loop() {
		c, err := net.Dial("tcp4", vip.String())
		if err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "conns/s")
	if after := progStats(b, prog); after.RunCount > before.RunCount {
		b.ReportMetric(float64(after.Runtime-before.Runtime)/float64(after.RunCount-before.RunCount), "hook-ns/op")
	}
}
