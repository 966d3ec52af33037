package policyprog

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// BenchmarkInterfaceProgram measures one run of the interface programs on
// a packet (BPF_PROG_TEST_RUN, the kernel's own loop): a packet of a flow
// the interface knows (most packets), a new flow judged by the policy map
// (the interface's flow map taken away, so that every run is judged), and
// a packet from a forged source.
func BenchmarkInterfaceProgram(b *testing.B) {
	d := newIfaceDatapath(b, "10.244.0.5")
	d.identity("10.244.1.7", 1000)
	d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)
	d.allow(1000, bpf.PolicyEgress, tcp, 443)
	known := frame(packet{src: "10.244.0.5", dst: "10.244.1.7", proto: tcp, sport: 1000, dport: 443, tcpFlags: ackFlag})
	if got := d.run(FromPod, known); got != tcxNext {
		b.Fatalf("first packet: %#x", got)
	}
	for _, bc := range []struct {
		name  string
		frame []byte
	}{
		{"known-flow", known},
		{"new-flow", frame(packet{src: "10.244.0.5", dst: "10.244.1.7", proto: tcp, sport: 1001, dport: 443, tcpFlags: synFlag})},
		{"spoofed", frame(packet{src: "10.244.0.6", dst: "10.244.1.7", proto: tcp, sport: 1000, dport: 443, tcpFlags: synFlag})},
	} {
		b.Run(bc.name, func(b *testing.B) {
			if bc.name == "new-flow" {
				// Each run finds no flow: the interface has none.
				if err := d.maps.Flows.Delete(uint32(loIfindex)); err != nil {
					b.Fatal(err)
				}
				defer d.maps.Flows.Put(uint32(loIfindex), d.flows)
			}
			ret, per, err := d.progs[FromPod].Benchmark(bc.frame, b.N, nil)
			if err != nil {
				b.Fatal(err)
			}
			if bc.name == "spoofed" && ret != tcxDrop || bc.name != "spoofed" && ret != tcxNext {
				b.Fatalf("verdict %#x", ret)
			}
			b.ReportMetric(float64(per.Nanoseconds()), "prog-ns/op")
		})
	}
}

// vethPod is a network namespace with a veth to the host, addresses and
// routes as a ptp CNI plugin makes them, for the traffic benchmarks.
type vethPod struct {
	ns      string
	hostIf  string
	ifindex int
	nsFile  *os.File
	// progs are the interface programs, once attached.
	progs map[string]*ebpf.Program
}

// reportTC reads the interface programs' run-time statistics, and the
// returned function reports what they spent since: per operation of b
// (tc-ns/op) and per packet (tc-ns/pkt), the kernel's own measure, which
// the other load on the machine does not skew as it does the wall time.
func (p *vethPod) reportTC(b *testing.B) func() {
	if p.progs == nil {
		return func() {}
	}
	read := func() (rt time.Duration, runs uint64) {
		for name, prog := range p.progs {
			st, err := prog.Stats()
			if err != nil {
				b.Fatalf("statistics of %s: %s", name, err)
			}
			rt += st.Runtime
			runs += st.RunCount
		}
		return rt, runs
	}
	rt0, n0 := read()
	return func() {
		rt, n := read()
		b.ReportMetric(float64(rt-rt0)/float64(b.N), "tc-ns/op")
		if n > n0 {
			b.ReportMetric(float64(rt-rt0)/float64(n-n0), "tc-ns/pkt")
			b.ReportMetric(float64(n-n0)/float64(b.N), "pkts/op")
		}
	}
}

const (
	benchGw  = "10.232.0.1"
	benchPod = "10.232.0.11"
)

func newVethPod(b *testing.B) *vethPod {
	b.Helper()
	testenv.RequireRoot(b)
	testenv.RequireProgram(b, "ip")
	p := &vethPod{ns: fmt.Sprintf("apiary-bench-%d", os.Getpid()), hostIf: fmt.Sprintf("bench%d", os.Getpid()%100000)}
	ip := func(args ...string) {
		b.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			b.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	ip("netns", "add", p.ns)
	b.Cleanup(func() { exec.Command("ip", "netns", "del", p.ns).Run() })
	ip("link", "add", p.hostIf, "type", "veth", "peer", "name", "eth0", "netns", p.ns)
	b.Cleanup(func() { exec.Command("ip", "link", "del", p.hostIf).Run() })
	ip("addr", "add", benchGw+"/32", "dev", p.hostIf)
	ip("link", "set", p.hostIf, "up")
	ip("route", "add", benchPod+"/32", "dev", p.hostIf)
	ip("netns", "exec", p.ns, "ip", "link", "set", "lo", "up")
	ip("netns", "exec", p.ns, "ip", "addr", "add", benchPod+"/32", "dev", "eth0")
	ip("netns", "exec", p.ns, "ip", "link", "set", "eth0", "up")
	ip("netns", "exec", p.ns, "ip", "route", "add", "default", "via", benchGw, "dev", "eth0", "onlink")
	ifc, err := net.InterfaceByName(p.hostIf)
	if err != nil {
		b.Fatal(err)
	}
	p.ifindex = ifc.Index
	f, err := os.Open("/run/netns/" + p.ns)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { f.Close() })
	p.nsFile = f
	return p
}

// inPod runs fn on a thread in the pod's network namespace: sockets it
// makes are the pod's.
func (p *vethPod) inPod(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		// The thread ends with the goroutine, never back in the host's
		// namespace by mistake.
		runtime.LockOSThread()
		if err := unix.Setns(int(p.nsFile.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// attach puts the interface programs on the pod's veth, with its flows,
// until the benchmark ends; the pod may reach the host on any TCP or UDP
// port (its entries allow identity 0), and is enforced both ways.
func (p *vethPod) attach(b *testing.B) {
	b.Helper()
	d := newIfaceDatapath(b, benchPod)
	d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)
	k := bpf.NewPolicyKey(testEndpoint, 0, bpf.PolicyEgress, tcp, 0, 0)
	if err := d.maps.Policy.Put(k, bpf.PolicyValue{Cookie: 1}); err != nil {
		b.Fatal(err)
	}
	k = bpf.NewPolicyKey(testEndpoint, 0, bpf.PolicyEgress, udp, 0, 0)
	if err := d.maps.Policy.Put(k, bpf.PolicyValue{Cookie: 1}); err != nil {
		b.Fatal(err)
	}
	v, _ := d.maps.Ifaces.LookupBytes(uint32(loIfindex))
	if err := d.maps.Ifaces.Put(uint32(p.ifindex), v); err != nil {
		b.Fatal(err)
	}
	flows, err := ebpf.NewMap(bpf.PolicyIfaceFlowsInnerSpec(bpf.DefaultPolicyIfaceFlows))
	if err != nil {
		b.Fatal(err)
	}
	defer flows.Close()
	if err := d.maps.Flows.Put(uint32(p.ifindex), flows); err != nil {
		b.Fatal(err)
	}
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Fatalf("enable BPF run-time statistics: %s", err)
	}
	b.Cleanup(func() { stats.Close() })
	p.progs = d.progs
	for prog, at := range map[string]ebpf.AttachType{FromPod: ebpf.AttachTCXIngress, ToPod: ebpf.AttachTCXEgress} {
		l, err := link.AttachTCX(link.TCXOptions{Interface: p.ifindex, Program: d.progs[prog], Attach: at})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { l.Close() })
	}
}

// BenchmarkInterfaceTraffic measures traffic from a pod in a network
// namespace of its own to the host through its veth, without (socket-only:
// no program on the interface) and with the interface programs
// (interface: enforced both ways, every flow allowed): TCP connections
// (dial and close), TCP throughput (64 KiB writes) and UDP datagrams (64
// bytes; datagrams/s counts those received).
func BenchmarkInterfaceTraffic(b *testing.B) {
	for _, mode := range []string{"socket-only", "interface"} {
		b.Run(mode, func(b *testing.B) {
			p := newVethPod(b)
			if mode == "interface" {
				p.attach(b)
			}
			b.Run("tcp-connect", func(b *testing.B) { benchConnect(b, p) })
			b.Run("tcp-stream", func(b *testing.B) { benchStream(b, p) })
			b.Run("udp", func(b *testing.B) { benchUDP(b, p) })
		})
	}
}

func benchConnect(b *testing.B, p *vethPod) {
	l, err := net.Listen("tcp4", benchGw+":0")
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
	addr := l.Addr().String()
	b.ResetTimer()
	defer p.reportTC(b)()
	err = p.inPod(func() error {
		for range b.N {
			c, err := net.Dial("tcp4", addr)
			if err != nil {
				return err
			}
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
}

func benchStream(b *testing.B, p *vethPod) {
	l, err := net.Listen("tcp4", benchGw+":0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	done := make(chan int64)
	go func() {
		c, err := l.Accept()
		if err != nil {
			done <- 0
			return
		}
		n, _ := io.Copy(io.Discard, c)
		c.Close()
		done <- n
	}()
	buf := make([]byte, 64<<10)
	b.SetBytes(int64(len(buf)))
	b.ResetTimer()
	defer p.reportTC(b)()
	err = p.inPod(func() error {
		c, err := net.Dial("tcp4", l.Addr().String())
		if err != nil {
			return err
		}
		defer c.Close()
		for range b.N {
			if _, err := c.Write(buf); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	if n := <-done; n != int64(b.N*len(buf)) {
		b.Fatalf("received %d bytes, sent %d", n, b.N*len(buf))
	}
}

func benchUDP(b *testing.B, p *vethPod) {
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.ParseIP(benchGw)})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	c.SetReadBuffer(8 << 20)
	received := make(chan int)
	go func() {
		n := 0
		buf := make([]byte, 1500)
		for {
			c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			if _, err := c.Read(buf); err != nil {
				received <- n
				return
			}
			n++
		}
	}()
	msg := make([]byte, 64)
	start := time.Now()
	b.ResetTimer()
	defer p.reportTC(b)()
	err = p.inPod(func() error {
		s, err := net.DialUDP("udp4", nil, c.LocalAddr().(*net.UDPAddr))
		if err != nil {
			return err
		}
		defer s.Close()
		for range b.N {
			if _, err := s.Write(msg); err != nil {
				return err
			}
		}
		return nil
	})
	elapsed := time.Since(start)
	if err != nil {
		b.Fatal(err)
	}
	n := <-received
	b.ReportMetric(float64(n)/elapsed.Seconds(), "received/s")
	b.ReportMetric(float64(n)/float64(b.N), "received/op")
}
