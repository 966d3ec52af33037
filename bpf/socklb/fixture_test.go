package socklb

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// Frontends of the tests lie outside every local network, so that a
// connection the programs fail to translate reaches no listener: it times
// out or finds no route, and never passes for a translated one.
var (
	vip4 = netip.MustParseAddr("10.96.0.10")
	vip6 = netip.MustParseAddr("fd00:96::10")
)

const (
	tcp = unix.IPPROTO_TCP
	udp = unix.IPPROTO_UDP
)

// family is a way of reaching a frontend: the frontend as the maps hold
// it, the socket family and address a client uses for it, and where its
// backends listen.
type family struct {
	name     string
	vip      netip.Addr // in the maps
	sockAF   int
	dst      netip.Addr // what the client connects to
	loopback string     // the backends' address
}

var families = []family{
	{name: "ipv4", vip: vip4, sockAF: unix.AF_INET, dst: vip4, loopback: "127.0.0.1"},
	{name: "ipv6", vip: vip6, sockAF: unix.AF_INET6, dst: vip6, loopback: "::1"},
	// An AF_INET6 socket to an IPv4 frontend, through its IPv4-mapped
	// address; the backends are IPv4.
	{name: "v4mapped", vip: vip4, sockAF: unix.AF_INET6, dst: netip.AddrFrom16(vip4.As16()), loopback: "127.0.0.1"},
}

// at is the address the client of f uses for the frontend address vip
// (one of f's frontends) and port.
func (f family) at(vip netip.Addr, port uint16) netip.AddrPort {
	if f.sockAF == unix.AF_INET6 && vip.Is4() {
		vip = netip.AddrFrom16(vip.As16())
	}
	return netip.AddrPortFrom(vip, port)
}

// lb is a set of unpinned maps, all the programs use, with helpers to fill
// them as the agent would.
type lb struct {
	tb testing.TB
	Maps
}

func newLB(tb testing.TB) *lb {
	newMap := func(spec *ebpf.MapSpec, err error) *ebpf.Map {
		tb.Helper()
		if err != nil {
			tb.Fatal(err)
		}
		m, err := ebpf.NewMap(spec)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { m.Close() })
		return m
	}
	testenv.RequireRoot(tb)
	return &lb{tb: tb, Maps: Maps{
		Services4:     newMap(bpf.LBMapSpec(bpf.LB4ServicesMap, 1024)),
		Backends4:     newMap(bpf.LBMapSpec(bpf.LB4BackendsMap, 1024)),
		RevNat4:       newMap(bpf.LBMapSpec(bpf.LB4RevNatMap, 1024)),
		Services6:     newMap(bpf.LBMapSpec(bpf.LB6ServicesMap, 1024)),
		Backends6:     newMap(bpf.LBMapSpec(bpf.LB6BackendsMap, 1024)),
		RevNat6:       newMap(bpf.LBMapSpec(bpf.LB6RevNatMap, 1024)),
		AffinityMatch: newMap(bpf.LBMapSpec(bpf.LBAffinityMatchMap, 1024)),
		SockRevNat4:   newMap(MapSpec(SockRevNat4Map, 1024)),
		SockRevNat6:   newMap(MapSpec(SockRevNat6Map, 1024)),
		Affinity4:     newMap(MapSpec(bpf.LB4AffinityMap, 1024)),
		Affinity6:     newMap(MapSpec(bpf.LB6AffinityMap, 1024)),
	}}
}

func (l *lb) put(m *ebpf.Map, k, v any) {
	l.tb.Helper()
	if err := m.Put(k, v); err != nil {
		l.tb.Fatalf("put %v in %s: %s", k, m, err)
	}
}

// backend adds (or changes) backend id.
func (l *lb) backend(id uint32, addr netip.AddrPort, proto uint8, state bpf.BackendState) {
	l.tb.Helper()
	if addr.Addr().Is4() {
		l.put(l.Backends4, id, bpf.NewLB4BackendValue(addr, proto, state))
	} else {
		l.put(l.Backends6, id, bpf.NewLB6BackendValue(addr, proto, state))
	}
}

// service adds the frontend fe/proto of service revNat with the active
// backends given, then the terminating ones, and affinity (seconds; 0 for
// none), as the agent writes it (with package bpf's builders, which the
// LB reconciler uses): slot 0, a slot per backend, the rev-NAT entry and,
// with affinity, a match entry per active backend.
func (l *lb) service(revNat uint16, fe netip.AddrPort, proto uint8, affinity uint32, active, terminating []uint32) {
	l.tb.Helper()
	var flags bpf.ServiceFlags
	if affinity != 0 {
		flags |= bpf.SvcFlagSessionAffinity
		for _, id := range active {
			l.put(l.AffinityMatch, bpf.LBAffinityMatchKey{BackendID: id, RevNat: bpf.NewBe16(revNat)}, uint8(0))
		}
	}
	values := []bpf.LB4ServiceValue{bpf.NewLBMasterValue(revNat, uint16(len(active)), uint16(len(terminating)), flags, affinity&bpf.AffinityTimeoutMask)}
	for _, id := range append(append([]uint32(nil), active...), terminating...) {
		values = append(values, bpf.NewLBSlotValue(id, revNat, flags))
	}
	for slot, v := range values {
		if fe.Addr().Is4() {
			l.put(l.Services4, bpf.NewLB4ServiceKey(fe, proto, uint16(slot)), v)
		} else {
			l.put(l.Services6, bpf.NewLB6ServiceKey(fe, proto, uint16(slot)), v)
		}
	}
	if fe.Addr().Is4() {
		l.put(l.RevNat4, bpf.NewBe16(revNat), bpf.NewLB4RevNatValue(fe))
	} else {
		l.put(l.RevNat6, bpf.NewBe16(revNat), bpf.NewLB6RevNatValue(fe))
	}
}

// wildcard adds the agent's wildcard entry of a service address: port 0,
// protocol ANY, no backends and no service ID.
func (l *lb) wildcard(addr netip.Addr) {
	l.tb.Helper()
	v := bpf.NewLBMasterValue(0, 0, 0, 0, 0)
	if addr.Is4() {
		l.put(l.Services4, bpf.NewLB4ServiceKey(netip.AddrPortFrom(addr, 0), 0, 0), v)
	} else {
		l.put(l.Services6, bpf.NewLB6ServiceKey(netip.AddrPortFrom(addr, 0), 0, 0), v)
	}
}

// load loads the programs on l's maps.
func (l *lb) load() map[string]*ebpf.Program {
	l.tb.Helper()
	progs, err := Load(l.Maps)
	if err != nil {
		l.tb.Fatal(err)
	}
	l.tb.Cleanup(func() {
		for _, p := range progs {
			p.Close()
		}
	})
	return progs
}

// attach attaches progs to all the hooks of the cgroup cg, until the test
// ends.
func attach(tb testing.TB, cg string, progs map[string]*ebpf.Program) {
	tb.Helper()
	for _, h := range Hooks {
		lk, err := link.AttachCgroup(link.CgroupOptions{Path: cg, Attach: h.Attach, Program: progs[h.Program]})
		if err != nil {
			tb.Fatalf("attach %s: %s", h.Name, err)
		}
		tb.Cleanup(func() { lk.Close() })
	}
}

// start loads the programs on l's maps, attaches them to a new cgroup and
// moves the test process into it, until the test ends.
func (l *lb) start() {
	l.tb.Helper()
	progs := l.load()
	attach(l.tb, enterCgroup(l.tb), progs)
}

// enterCgroup moves the whole process into a new cgroup v2 directory, and
// back where it was when the test ends: the programs are attached to this
// cgroup alone. Tests of this package must therefore not run in parallel.
func enterCgroup(tb testing.TB) string {
	tb.Helper()
	dir := testenv.Cgroup(tb)
	testenv.EnterCgroup(tb, dir)
	return dir
}

// serve starts a TCP or UDP (proto) server on a free port of addr that
// answers every connection, or datagram, with name; it stops when the
// test ends.
func serve(tb testing.TB, proto int, addr, name string) netip.AddrPort {
	tb.Helper()
	hostPort := net.JoinHostPort(addr, "0")
	switch proto {
	case tcp:
		l, err := net.Listen("tcp", hostPort)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				fmt.Fprintln(c, name)
				c.Close()
			}
		}()
		return l.Addr().(*net.TCPAddr).AddrPort()
	case udp:
		c, err := net.ListenPacket("udp", hostPort)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { c.Close() })
		go func() {
			buf := make([]byte, 64)
			for {
				_, from, err := c.ReadFrom(buf)
				if err != nil {
					return
				}
				c.WriteTo([]byte(name), from)
			}
		}()
		return c.LocalAddr().(*net.UDPAddr).AddrPort()
	}
	tb.Fatalf("unknown protocol %d", proto)
	return netip.AddrPort{}
}

// ioTimeout bounds every socket operation of a client: over loopback a
// translated exchange takes well under a millisecond, and the programs
// refuse at once; only what they fail to translate waits this long.
const ioTimeout = time.Second

// socket returns a socket of family af and protocol proto (tcp, udp) with
// send and receive timeouts (connect's included).
func socket(af, proto int) (int, error) {
	typ := unix.SOCK_STREAM
	if proto == udp {
		typ = unix.SOCK_DGRAM
	}
	fd, err := unix.Socket(af, typ|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	tv := unix.NsecToTimeval(ioTimeout.Nanoseconds())
	err1 := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	err2 := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if err := errors.Join(err1, err2); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("socket timeouts: %w", err)
	}
	return fd, nil
}

func sockaddr(af int, ap netip.AddrPort) unix.Sockaddr {
	if af == unix.AF_INET {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
}

func addrPort(sa unix.Sockaddr) netip.AddrPort {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port))
	}
	return netip.AddrPort{}
}

// exchange is the outcome of a client's exchange with a frontend: who
// answered and whom the client believes it talked to.
type exchange struct {
	reply string         // the server's name
	peer  netip.AddrPort // getpeername, or the reply's source
}

// dial connects a socket of family af and protocol proto to dst and, over
// TCP, reads the server's greeting or, over UDP, sends a datagram and
// reads the answer; peer is getpeername. Errors wrap the errno.
func dial(af, proto int, dst netip.AddrPort) (exchange, error) {
	fd, err := socket(af, proto)
	if err != nil {
		return exchange{}, err
	}
	defer unix.Close(fd)
	if err := connect(fd, sockaddr(af, dst)); err != nil {
		return exchange{}, fmt.Errorf("connect %s: %w", dst, err)
	}
	sa, err := unix.Getpeername(fd)
	if err != nil {
		return exchange{}, fmt.Errorf("getpeername: %w", err)
	}
	if proto == udp {
		if _, err := unix.Write(fd, []byte("hello")); err != nil {
			return exchange{}, fmt.Errorf("send to %s: %w", dst, err)
		}
	}
	buf := make([]byte, 64)
	n, err := testenv.IgnoringEINTR(func() (int, error) { return unix.Read(fd, buf) })
	if err != nil {
		return exchange{}, fmt.Errorf("read from %s: %w", dst, err)
	}
	return exchange{reply: strings.TrimSpace(string(buf[:n])), peer: addrPort(sa)}, nil
}

// connect is connect(2) through a signal: the Go runtime's preemption
// signal can interrupt a blocking connect (EINTR), which then goes on in
// the background; it is done once connect says the socket is connected.
func connect(fd int, sa unix.Sockaddr) error {
	err := unix.Connect(fd, sa)
	for errors.Is(err, unix.EINTR) || errors.Is(err, unix.EALREADY) {
		time.Sleep(time.Millisecond)
		err = unix.Connect(fd, sa)
	}
	if errors.Is(err, unix.EISCONN) {
		return nil
	}
	return err
}

// sendTo sends a datagram to dst from an unconnected UDP socket of family
// af and reads the answer; peer is its source, as recvfrom gives it.
func sendTo(af int, dst netip.AddrPort) (exchange, error) {
	fd, err := socket(af, udp)
	if err != nil {
		return exchange{}, err
	}
	defer unix.Close(fd)
	if err := unix.Sendto(fd, []byte("hello"), 0, sockaddr(af, dst)); err != nil {
		return exchange{}, fmt.Errorf("send to %s: %w", dst, err)
	}
	buf := make([]byte, 64)
	var from unix.Sockaddr
	n, err := testenv.IgnoringEINTR(func() (n int, err error) {
		n, from, err = unix.Recvfrom(fd, buf, 0)
		return n, err
	})
	if err != nil {
		return exchange{}, fmt.Errorf("receive from %s: %w", dst, err)
	}
	return exchange{reply: string(buf[:n]), peer: addrPort(from)}, nil
}

// netnsCookie returns the cookie of the process's network namespace, which
// keys the affinity maps.
func netnsCookie(tb testing.TB) uint64 {
	tb.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		tb.Fatal(err)
	}
	defer unix.Close(fd)
	c, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if err != nil {
		tb.Fatalf("SO_NETNS_COOKIE: %s", err)
	}
	return c
}

// monoNow returns CLOCK_MONOTONIC in nanoseconds, the programs' clock
// (bpf_ktime_get_ns).
func monoNow(tb testing.TB) uint64 {
	tb.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		tb.Fatal(err)
	}
	return uint64(ts.Nano())
}
