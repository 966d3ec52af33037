package policyprog

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// BenchmarkConnect measures connect() from a process that moves itself
// into a cgroup: one without programs (nohook); the pod's, with the
// programs attached above it but the pod not an endpoint (noendpoint: the
// ancestor walk finds nothing); the pod as an endpoint that enforces
// nothing (nopolicy: connect4 reports each connect, reason "no policy");
// and the pod as an endpoint enforcing both directions with entries that
// allow the peer (enforced: connect4 decides, reports and remembers the
// flow, the packets are found in it).
//
// Events are on throughout, as in the agent: a goroutine drains
// policy_events (of the default size) as fast as it can; events/op is
// what it read, lost/op what found the ring full at that rate.
//
// Each runs for IPv4 (tcp, udp: 127.0.77.40) and IPv6 (tcp6, udp6: ::1,
// through connect6).
//
// tcp is a whole connection over loopback (dial, accept, close with a
// reset, so that no TIME_WAIT piles up), through every hook; udp is
// socket, connect and close of a UDP socket, which sends nothing: the
// cost of connect4 alone. Beside the wall time, which varies more from run
// to run than the programs cost, the kernel's BPF run-time statistics
// give the time spent in the programs: bpf-ns/op in all of them per
// operation, connect-ns the average run of connect4 or connect6.
func BenchmarkConnect(b *testing.B) {
	testenv.RequireRoot(b)
	type target struct {
		suffix, network string
		addr            netip.AddrPort
		sa              unix.Sockaddr
		domain          int
	}
	var targets []target
	for _, t := range []struct{ suffix, network, listen string }{
		{"", "tcp4", "127.0.77.40:0"},
		{"6", "tcp6", "[::1]:0"},
	} {
		// Made before the move: the listener stays out of the cgroups.
		l, err := net.Listen(t.network, t.listen)
		if err != nil {
			b.Fatal(err)
		}
		defer l.Close()
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		addr := netip.MustParseAddrPort(l.Addr().String())
		tg := target{suffix: t.suffix, network: t.network, addr: addr, domain: unix.AF_INET}
		if addr.Addr().Is4() {
			tg.sa = &unix.SockaddrInet4{Addr: addr.Addr().As4(), Port: int(addr.Port())}
		} else {
			tg.sa, tg.domain = &unix.SockaddrInet6{Addr: addr.Addr().As16(), Port: int(addr.Port())}, unix.AF_INET6
		}
		targets = append(targets, tg)
	}

	plain := testenv.Cgroup(b)
	d := newDatapath(b)
	stopReader := d.drainEvents(b)
	defer stopReader()
	for i, tg := range targets {
		id := uint32(3000 + i)
		d.identity(tg.addr.Addr().String(), id)
		d.rules(
			rule{identity: id, dir: bpf.PolicyEgress, proto: tcp, port: tg.addr.Port(), portBits: 16},
			rule{identity: id, dir: bpf.PolicyEgress, proto: udp, port: tg.addr.Port(), portBits: 16},
		)
	}
	move := cgroupMover(b)
	move(plain)
	// Without them, the bpf metrics read 0.
	if stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME)); err != nil {
		b.Logf("no BPF run-time statistics: %s", err)
	} else {
		defer stats.Close()
	}
	// The wall time of the first phase would otherwise include warming
	// up (connections, page faults).
	for range 1000 {
		c, err := net.Dial("tcp4", targets[0].addr.String())
		if err != nil {
			b.Fatal(err)
		}
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	}

	for _, phase := range []struct {
		name   string
		before func()
	}{
		{"nohook", nil},
		{"noendpoint", func() { move(d.app) }},
		{"nopolicy", func() { d.endpoint(0) }},
		{"enforced", func() { d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress) }},
	} {
		if phase.before != nil {
			phase.before()
		}
		for _, tg := range targets {
			b.Run(phase.name+"/tcp"+tg.suffix, func(b *testing.B) {
				defer d.reportRuntime(b)()
				defer d.reportEvents(b)()
				for b.Loop() {
					c, err := net.Dial(tg.network, tg.addr.String())
					if err != nil {
						b.Fatal(err)
					}
					c.(*net.TCPConn).SetLinger(0)
					c.Close()
				}
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "conns/s")
			})
			b.Run(phase.name+"/udp"+tg.suffix, func(b *testing.B) {
				defer d.reportRuntime(b)()
				defer d.reportEvents(b)()
				for b.Loop() {
					fd, err := unix.Socket(tg.domain, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
					if err != nil {
						b.Fatal(err)
					}
					err = unix.Connect(fd, tg.sa)
					unix.Close(fd)
					if err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
	if s := d.stats(); stat(s, bpf.PolicyEgress, bpf.PolicyVerdictAllowed) == 0 || stat(s, bpf.PolicyEgress, bpf.PolicyVerdictDenied) != 0 {
		b.Errorf("the enforced connects were not allowed by policy: stats %v", s)
	}
}

// reportRuntime reads the programs' run-time statistics, and the returned
// function reports what they spent since, per operation of b.
func (d *datapath) reportRuntime(b *testing.B) func() {
	read := func() (all time.Duration, connect time.Duration, runs uint64) {
		for name, p := range d.progs {
			st, err := p.Stats()
			if err != nil {
				b.Fatalf("statistics of %s: %s", name, err)
			}
			all += st.Runtime
			if name == policyprogProgPolicyConnect4 || name == policyprogProgPolicyConnect6 {
				connect += st.Runtime
				runs += st.RunCount
			}
		}
		return all, connect, runs
	}
	all0, c0, n0 := read()
	return func() {
		all, c, n := read()
		b.ReportMetric(float64(all-all0)/float64(b.N), "bpf-ns/op")
		if n > n0 {
			b.ReportMetric(float64(c-c0)/float64(n-n0), "connect-ns")
		}
	}
}

// drainEvents reads policy_events in a goroutine until the returned
// function is called, counting the events in d.eventsRead: woken by the
// programs when an eighth of the ring waits, else every eventPoll.
func (d *datapath) drainEvents(b *testing.B) (stop func()) {
	r := d.reader()
	done := make(chan struct{})
	go func() {
		defer close(done)
		var rec ringbuf.Record
		for {
			r.SetDeadline(time.Now().Add(eventPoll))
			err := r.ReadInto(&rec)
			switch {
			case err == nil:
				d.eventsRead.Add(1)
			case !errors.Is(err, os.ErrDeadlineExceeded):
				return // closed
			}
		}
	}()
	return func() {
		r.Close()
		<-done
	}
}

// reportEvents reads how many events were read and lost, and the returned
// function reports those since, per operation of b. The reader may still
// be behind when b ends: events/op is a floor.
func (d *datapath) reportEvents(b *testing.B) func() {
	read0, lost0 := d.eventsRead.Load(), d.lost()
	return func() {
		b.ReportMetric(float64(d.eventsRead.Load()-read0)/float64(b.N), "events/op")
		b.ReportMetric(float64(d.lost()-lost0)/float64(b.N), "lost/op")
	}
}

// cgroupMover moves the whole process between cgroup v2 directories, and
// back to where it was at first when the benchmark ends.
func cgroupMover(b *testing.B) (move func(dir string)) {
	return func(dir string) { testenv.EnterCgroup(b, dir) }
}
