package policyprog

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// childEnv, when set, makes the test binary a child (see childMain) instead
// of running tests: the tests re-execute themselves as processes started
// inside an endpoint's cgroup (or outside it), since a socket belongs to
// the cgroup of the process that creates it.
const childEnv = "POLICYPROG_TEST_CHILD"

// Timeouts of one exchange. A packet the programs drop is not answered:
// the exchange times out, so these bound what a denied case costs; an
// allowed one over loopback takes well under a millisecond.
const (
	dialTimeout = 500 * time.Millisecond
	ioTimeout   = 500 * time.Millisecond
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		os.Exit(childMain(os.Stdin, os.Stdout))
	}
	os.Exit(m.Run())
}

// childMain runs one command per input line and answers each with one
// line, until its input ends:
//
//	tcp|udp|udp2|udpsrc|udpc DST [SRC]
//	                             an exchange (see exchange); answers its
//	                             outcome
//	local tcp|udp|... DST [SRC]  the same, answering the outcome and the
//	                             socket's local address ("-" if none)
//	icmp DST                     an echo request; answers its outcome
//	serve tcp|udp ADDR           serve ADDR (see serve); answers "ok" and
//	                             the address it listens on
//	reuse DST LOCAL              connect from LOCAL to DST and exchange,
//	                             disconnect (AF_UNSPEC) and listen on
//	                             LOCAL with the same socket, serving it
//	hold DST                     connect to DST and keep the connection
//	use                          exchange on the held connection again
//	flood N BASE                 send N datagrams from one socket, each to
//	                             a peer of its own: 127.B.x.y, port 1000+
func childMain(in io.Reader, out io.Writer) int {
	sc := bufio.NewScanner(in)
	var held net.Conn
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		withLocal := len(f) > 0 && f[0] == "local"
		if withLocal {
			f = f[1:]
		}
		var answer string
		switch {
		case len(f) == 3 && f[0] == "sources":
			answer = outcome(floodSources(f[1], f[2]))
		case len(f) == 3 && f[0] == "reuse":
			answer = outcome(reuseAsListener(f[1], f[2]))
		case len(f) == 2 && f[0] == "hold":
			var err error
			held, err = net.DialTimeout("tcp", f[1], dialTimeout)
			if err == nil {
				err = pingPong(held)
			}
			answer = outcome(err)
		case len(f) == 1 && f[0] == "use":
			answer = outcome(pingPong(held))
		case len(f) == 3 && f[0] == "flood":
			answer = outcome(flood(f[1], f[2]))
		case len(f) == 3 && f[0] == "serve":
			addr, err := serve(f[1], f[2])
			answer = outcome(err)
			if err == nil {
				answer += " " + addr
			}
		case len(f) >= 2 && len(f) <= 3:
			src := ""
			if len(f) == 3 {
				src = f[2]
			}
			local, err := exchange(f[0], f[1], src)
			answer = outcome(err)
			if withLocal {
				if local.IsValid() {
					answer += " " + local.String()
				} else {
					answer += " -"
				}
			}
		default:
			answer = fmt.Sprintf("error: bad command %q", sc.Text())
		}
		fmt.Fprintln(out, answer)
	}
	return 0
}

// floodSources sends one datagram to dst from each of n new unconnected
// UDP sockets (each its own source port), waiting for no answer.
func floodSources(n, dst string) error {
	count, err := strconv.Atoi(n)
	if err != nil {
		return err
	}
	raddr, err := netip.ParseAddrPort(dst)
	if err != nil {
		return err
	}
	to := &unix.SockaddrInet4{Addr: raddr.Addr().As4(), Port: int(raddr.Port())}
	for range count {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM, 0)
		if err != nil {
			return err
		}
		err = unix.Sendto(fd, []byte("ping\n"), 0, to)
		unix.Close(fd)
		if err != nil {
			return err
		}
	}
	return nil
}

// outcome says how an exchange ended: ok, EPERM (refused by a program at
// connect or send), timeout (a packet was dropped), refused (nobody
// listens) or the error.
func outcome(err error) string {
	var nerr net.Error
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, syscall.EPERM):
		return "EPERM"
	case errors.Is(err, os.ErrDeadlineExceeded), errors.As(err, &nerr) && nerr.Timeout():
		return "timeout"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	}
	return "error: " + err.Error()
}

// exchange sends "ping" to dst and waits for "pong", from src when given:
// over TCP (kind tcp), an unconnected UDP socket (udp: sendmsg4 sees it;
// udp2: twice from the same socket; udpsrc: with src as IP_PKTINFO, not
// bound), a connected one (udpc: connect4 sees it), or ICMP echo (icmp). src is an address, or an address and port
// (see freePort). It returns the socket's local address.
func exchange(kind, dst, src string) (netip.AddrPort, error) {
	var local netip.AddrPort
	if src != "" {
		ap, err := netip.ParseAddrPort(src)
		if err != nil {
			a, aerr := netip.ParseAddr(src)
			if aerr != nil {
				return local, aerr
			}
			ap = netip.AddrPortFrom(a, 0)
		}
		local = ap
	}
	raddr, err := netip.ParseAddrPort(dst)
	if kind == "icmp" || kind == "icmp6" {
		a, aerr := netip.ParseAddr(dst)
		raddr, err = netip.AddrPortFrom(a, 0), aerr
	}
	if err != nil {
		return local, err
	}
	var c net.Conn
	switch kind {
	case "tcp":
		d := net.Dialer{Timeout: dialTimeout}
		if local.IsValid() {
			d.LocalAddr = net.TCPAddrFromAddrPort(local)
		}
		c, err = d.Dial("tcp4", dst)
	case "tcp6":
		d := net.Dialer{Timeout: dialTimeout}
		if local.IsValid() {
			d.LocalAddr = net.TCPAddrFromAddrPort(local)
		}
		c, err = d.Dial("tcp6", dst)
	case "tcpmapped":
		// An AF_INET6 socket to the IPv4 address as ::ffff:a.b.c.d, as a
		// dual-stack client connects (Go would use AF_INET).
		c, err = dialMapped(raddr)
	case "udp6":
		return udpUnconnected6(raddr)
	case "icmp6":
		return local, ping(raddr.Addr())
	case "udp":
		return udpUnconnected(local, raddr, 1, netip.Addr{})
	case "udp2":
		return udpUnconnected(local, raddr, 2, netip.Addr{})
	case "udpsrc":
		// From an unbound socket, asking for src per datagram.
		return udpUnconnected(netip.AddrPort{}, raddr, 1, local.Addr())
	case "udpc":
		var laddr *net.UDPAddr
		if local.IsValid() {
			laddr = net.UDPAddrFromAddrPort(local)
		}
		c, err = net.DialUDP("udp4", laddr, net.UDPAddrFromAddrPort(raddr))
	case "icmp":
		return local, ping(raddr.Addr())
	default:
		return local, fmt.Errorf("unknown exchange %q", kind)
	}
	if err != nil {
		return local, err
	}
	defer c.Close()
	local = netip.MustParseAddrPort(c.LocalAddr().String())
	c.SetDeadline(time.Now().Add(ioTimeout))
	if _, err := io.WriteString(c, "ping\n"); err != nil {
		return local, err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return local, err
	}
	if line != "pong\n" {
		return local, fmt.Errorf("answer %q, want pong", line)
	}
	return local, nil
}

// freePort returns addr with a TCP port that a client may bind, for an
// exchange whose source port must be known although it fails. The port is
// found as a client finds one: without SO_REUSEADDR, so that it is in no
// TIME_WAIT either.
func freePort(t testing.TB, addr string) string {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: netip.MustParseAddr(addr).As4()}); err != nil {
		t.Fatalf("bind %s: %s", addr, err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return netip.AddrPortFrom(netip.MustParseAddr(addr), uint16(sa.(*unix.SockaddrInet4).Port)).String()
}

// udpUnconnected sends times pings from an unconnected socket bound to
// local (any when invalid), each asking for the source src if valid.
func udpUnconnected(local, raddr netip.AddrPort, times int, src netip.Addr) (netip.AddrPort, error) {
	var laddr *net.UDPAddr
	if local.IsValid() {
		laddr = net.UDPAddrFromAddrPort(local)
	}
	c, err := net.ListenUDP("udp4", laddr)
	if err != nil {
		return local, err
	}
	defer c.Close()
	local = c.LocalAddr().(*net.UDPAddr).AddrPort()
	c.SetDeadline(time.Now().Add(ioTimeout))
	var oob []byte
	if src.IsValid() {
		oob = unix.PktInfo4(&unix.Inet4Pktinfo{Spec_dst: src.As4()})
	}
	for range times {
		if _, _, err := c.WriteMsgUDPAddrPort([]byte("ping\n"), oob, raddr); err != nil {
			return local, err
		}
		buf := make([]byte, 64)
		n, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return local, err
		}
		if string(buf[:n]) != "pong\n" || netip.AddrPortFrom(from.Addr().Unmap(), from.Port()) != raddr {
			return local, fmt.Errorf("answer %q from %s, want pong from %s", buf[:n], from, raddr)
		}
	}
	return local, nil
}

// pingPong sends "ping" on c and waits for "pong".
func pingPong(c net.Conn) error {
	if c == nil {
		return errors.New("no connection held")
	}
	c.SetDeadline(time.Now().Add(ioTimeout))
	if _, err := io.WriteString(c, "ping\n"); err != nil {
		return err
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != "pong\n" {
		return fmt.Errorf("answer %q, want pong", buf)
	}
	return nil
}

// reuseAsListener connects a TCP socket bound to local to dst, exchanges,
// then turns the same socket into a listener on local (connect with
// AF_UNSPEC disconnects it) that answers each connection's ping.
func reuseAsListener(dst, local string) error {
	d, l := netip.MustParseAddrPort(dst), netip.MustParseAddrPort(local)
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: l.Addr().As4(), Port: int(l.Port())}); err != nil {
		unix.Close(fd)
		return err
	}
	if err := unix.Connect(fd, &unix.SockaddrInet4{Addr: d.Addr().As4(), Port: int(d.Port())}); err != nil {
		unix.Close(fd)
		return err
	}
	f := os.NewFile(uintptr(fd), "reuse")
	c, err := net.FileConn(f)
	if err != nil {
		f.Close()
		return err
	}
	if err := pingPong(c); err != nil {
		return err
	}
	c.Close()            // the duplicate; fd stays
	unspec := [16]byte{} // struct sockaddr with sa_family AF_UNSPEC
	if _, _, errno := unix.Syscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&unspec[0])), uintptr(len(unspec))); errno != 0 {
		f.Close()
		return fmt.Errorf("disconnect: %w", errno)
	}
	if err := unix.Listen(fd, 8); err != nil {
		f.Close()
		return err
	}
	ln, err := net.FileListener(f)
	f.Close()
	if err != nil {
		return err
	}
	go answerPings(ln)
	return nil
}

// flood sends n datagrams from one unconnected socket, each to a peer of
// its own (127.base.x.y:1000+i%50000), as fast as it can.
func flood(n, base string) error {
	count, err := strconv.Atoi(n)
	if err != nil {
		return err
	}
	b, err := strconv.Atoi(base)
	if err != nil {
		return err
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	msg := []byte("x")
	for i := range count {
		sa := &unix.SockaddrInet4{Addr: [4]byte{127, byte(b), byte(i >> 8), byte(i)}, Port: 1000 + i%50000}
		if err := unix.Sendto(fd, msg, 0, sa); err != nil && !errors.Is(err, unix.ECONNREFUSED) {
			return fmt.Errorf("datagram %d: %w", i, err)
		}
	}
	return nil
}

// dialMapped connects an AF_INET6 TCP socket to the IPv4 address of dst
// as an IPv4-mapped IPv6 address.
func dialMapped(dst netip.AddrPort) (net.Conn, error) {
	fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	tv := unix.NsecToTimeval(dialTimeout.Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv); err != nil {
		unix.Close(fd)
		return nil, err
	}
	sa := &unix.SockaddrInet6{Port: int(dst.Port()), Addr: netip.AddrFrom16(dst.Addr().As16()).As16()}
	if err := unix.Connect(fd, sa); err != nil {
		unix.Close(fd)
		if errors.Is(err, unix.EINPROGRESS) || errors.Is(err, unix.EAGAIN) {
			return nil, os.ErrDeadlineExceeded
		}
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "mapped")
	defer f.Close()
	return net.FileConn(f)
}

// udpUnconnected6 sends a ping from an unconnected AF_INET6 socket.
func udpUnconnected6(raddr netip.AddrPort) (netip.AddrPort, error) {
	c, err := net.ListenUDP("udp6", nil)
	if err != nil {
		return netip.AddrPort{}, err
	}
	defer c.Close()
	local := c.LocalAddr().(*net.UDPAddr).AddrPort()
	c.SetDeadline(time.Now().Add(ioTimeout))
	if _, err := c.WriteToUDPAddrPort([]byte("ping\n"), raddr); err != nil {
		return local, err
	}
	buf := make([]byte, 64)
	n, _, err := c.ReadFromUDPAddrPort(buf)
	if err != nil {
		return local, err
	}
	if string(buf[:n]) != "pong\n" {
		return local, fmt.Errorf("answer %q, want pong", buf[:n])
	}
	return local, nil
}

// ping sends an ICMP echo request (ICMPv6 to an IPv6 dst) on a raw
// socket and waits for the reply. The kernel computes the checksum of
// ICMPv6 raw sockets, and hands IPv4 raw sockets the IP header.
func ping(dst netip.Addr) error {
	domain, proto, request, reply := unix.AF_INET, unix.IPPROTO_ICMP, byte(8), byte(0)
	var to unix.Sockaddr
	if dst.Is4() {
		to = &unix.SockaddrInet4{Addr: dst.As4()}
	} else {
		domain, proto, request, reply = unix.AF_INET6, unix.IPPROTO_ICMPV6, 128, 129
		to = &unix.SockaddrInet6{Addr: dst.As16()}
	}
	fd, err := unix.Socket(domain, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return fmt.Errorf("raw socket: %w", err)
	}
	defer unix.Close(fd)
	tv := unix.NsecToTimeval(ioTimeout.Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return err
	}
	id, seq := uint16(os.Getpid()), uint16(time.Now().UnixNano())
	req := []byte{request, 0, 0, 0, byte(id >> 8), byte(id), byte(seq >> 8), byte(seq), 'p', 'i', 'n', 'g'}
	if dst.Is4() {
		binary.BigEndian.PutUint16(req[2:], checksum(req))
	}
	if err := unix.Sendto(fd, req, 0, to); err != nil {
		return fmt.Errorf("send echo request: %w", err)
	}
	// A raw socket sees every ICMP packet, the request's copy included.
	deadline := time.Now().Add(ioTimeout)
	buf := make([]byte, 512)
	for time.Now().Before(deadline) {
		n, from, err := unix.Recvfrom(fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("receive echo reply: %w", err)
		}
		var src netip.Addr
		icmp := buf[:n]
		if dst.Is4() {
			ihl := int(buf[0]&0xf) * 4
			if n < ihl+8 {
				continue
			}
			src, icmp = netip.AddrFrom4([4]byte(buf[12:16])), buf[ihl:n]
		} else if sa, ok := from.(*unix.SockaddrInet6); ok {
			src = netip.AddrFrom16(sa.Addr)
		}
		if len(icmp) >= 8 && icmp[0] == reply && src == dst &&
			binary.BigEndian.Uint16(icmp[4:]) == id && binary.BigEndian.Uint16(icmp[6:]) == seq {
			return nil
		}
	}
	return os.ErrDeadlineExceeded
}

func checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

// serve answers every "ping" on addr with "pong": each TCP connection
// once, then closed; every UDP datagram. It returns the address it listens
// on. The "tcp" and "udp" networks take IPv4 and IPv6 alike: ":0" is a
// dual-stack socket, which carries IPv4 as mapped IPv6 addresses.
func serve(proto, addr string) (string, error) {
	c, err := startServer(proto, addr)
	if err != nil {
		return "", err
	}
	if l, ok := c.(net.Listener); ok {
		return l.Addr().String(), nil
	}
	return c.(net.PacketConn).LocalAddr().String(), nil
}

// answerPings answers the "ping" of each connection l accepts with "pong",
// then closes it, until l is closed.
func answerPings(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			c.SetDeadline(time.Now().Add(2 * time.Second))
			if line, err := bufio.NewReader(c).ReadString('\n'); err == nil && line == "ping\n" {
				io.WriteString(c, "pong\n")
			}
		}()
	}
}

func startServer(proto, addr string) (io.Closer, error) {
	switch proto {
	case "tcp":
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, err
		}
		go answerPings(l)
		return l, nil
	case "udp":
		c, err := net.ListenPacket("udp", addr)
		if err != nil {
			return nil, err
		}
		go func() {
			buf := make([]byte, 64)
			for {
				n, from, err := c.ReadFrom(buf)
				if err != nil {
					return
				}
				if string(buf[:n]) == "ping\n" {
					c.WriteTo([]byte("pong\n"), from)
				}
			}
		}()
		return c, nil
	}
	return nil, fmt.Errorf("unknown protocol %q", proto)
}

// child is a process running childMain in a cgroup.
type child struct {
	t     *testing.T
	stdin io.WriteCloser
	out   *bufio.Reader
}

// startChild starts a child in the cgroup directory dir; it ends with the
// test.
func startChild(t *testing.T, dir string) *child {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(self)
	// Under the race detector a process waits a second before it exits,
	// and every test waits for its children.
	gorace := strings.TrimSpace(os.Getenv("GORACE") + " atexit_sleep_ms=0")
	cmd.Env = append(os.Environ(), childEnv+"=1", "GORACE="+gorace)
	cmd.Stderr = os.Stderr
	// Started in the cgroup (clone3 with CLONE_INTO_CGROUP): none of its
	// sockets ever belongs to another.
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd())}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start a child in %s: %s", dir, err)
	}
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	return &child{t: t, stdin: stdin, out: bufio.NewReader(stdout)}
}

// do runs one command in the child and returns its answer.
func (c *child) do(cmd ...string) string {
	c.t.Helper()
	if _, err := fmt.Fprintln(c.stdin, strings.Join(cmd, " ")); err != nil {
		c.t.Fatalf("child: %s", err)
	}
	line, err := c.out.ReadString('\n')
	if err != nil {
		c.t.Fatalf("child: %s", err)
	}
	return strings.TrimSpace(line)
}
