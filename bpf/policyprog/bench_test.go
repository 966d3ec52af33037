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
// tcp is a whole connection over loopback (dial, accept, close with a
// reset, so that no TIME_WAIT piles up), through every hook; udp is
// socket, connect and close of a UDP socket, which sends nothing: the
// cost of connect4 alone. Beside the wall time, which varies more from run
// to run than the programs cost, the kernel's BPF run-time statistics
// give the time spent in the programs: bpf-ns/op in all of them per
// operation, connect4-ns the average run of connect4.
func BenchmarkConnect(b *testing.B) {
	testenv.RequireRoot(b)
	// Made before the move: the listener stays out of the cgroups.
	l, err := net.Listen("tcp4", "127.0.77.40:0")
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
	sa := &unix.SockaddrInet4{Addr: addr.Addr().As4(), Port: int(addr.Port())}

	plain := testenv.Cgroup(b)
	d := newDatapath(b)
	stopReader := d.drainEvents(b)
	defer stopReader()
	d.identity(addr.Addr().String(), 3000)
	d.rules(
		rule{identity: 3000, dir: bpf.PolicyEgress, proto: tcp, port: addr.Port(), portBits: 16},
		rule{identity: 3000, dir: bpf.PolicyEgress, proto: udp, port: addr.Port(), portBits: 16},
	)
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
		c, err := net.Dial("tcp4", addr.String())
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
		b.Run(phase.name+"/tcp", func(b *testing.B) {
			defer d.reportRuntime(b)()
			defer d.reportEvents(b)()
			for b.Loop() {
				c, err := net.Dial("tcp4", addr.String())
				if err != nil {
					b.Fatal(err)
				}
				c.(*net.TCPConn).SetLinger(0)
				c.Close()
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "conns/s")
		})
		b.Run(phase.name+"/udp", func(b *testing.B) {
			defer d.reportRuntime(b)()
			defer d.reportEvents(b)()
			for b.Loop() {
				fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					b.Fatal(err)
				}
				err = unix.Connect(fd, sa)
				unix.Close(fd)
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	if s := d.stats(); stat(s, bpf.PolicyEgress, bpf.PolicyVerdictAllowed) == 0 || stat(s, bpf.PolicyEgress, bpf.PolicyVerdictDenied) != 0 {
		b.Errorf("the enforced connects were not allowed by policy: stats %v", s)
	}
}

// reportRuntime reads the programs' run-time statistics, and the returned
// function reports what they spent since, per operation of b.
func (d *datapath) reportRuntime(b *testing.B) func() {
	read := func() (all time.Duration, connect4 time.Duration, runs uint64) {
		for name, p := range d.progs {
			st, err := p.Stats()
			if err != nil {
				b.Fatalf("statistics of %s: %s", name, err)
			}
			all += st.Runtime
			if name == policyprogProgPolicyConnect4 {
				connect4, runs = st.Runtime, st.RunCount
			}
		}
		return all, connect4, runs
	}
	all0, c0, n0 := read()
	return func() {
		all, c, n := read()
		b.ReportMetric(float64(all-all0)/float64(b.N), "bpf-ns/op")
		if n > n0 {
			b.ReportMetric(float64(c-c0)/float64(n-n0), "connect4-ns")
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
