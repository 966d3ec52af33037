package fqdn

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// udpExchange sends the query out to upstream from a socket of its own and
// reads the reply into buf, returning its length. Every query gets a new
// socket, and with it a port the kernel picks at random, so that an
// answer cannot be spoofed by guessing the ID alone; the socket is
// connected, so the kernel drops datagrams from anywhere but upstream, and
// a datagram with another ID (a late reply to an earlier query, or a
// spoofed one) is skipped, as a resolver does.
//
// It does what net.Dial, Write, Read and Close do for a UDP socket with
// fewer system calls (no SO_BROADCAST, getsockname, getpeername, nor a
// read before the poller says the reply is there): per query they were most of the
// proxy's time.
func udpExchange(upstream netip.AddrPort, out []byte, buf []byte, deadline time.Time) (int, error) {
	if len(out) < 2 {
		return 0, errors.New("query too short")
	}
	id := binary.BigEndian.Uint16(out)
	// An IPv4-mapped address is asked over IPv4, as net.Dial does.
	addr := upstream.Addr().Unmap()
	family, sa := unix.AF_INET6, unix.Sockaddr(&unix.SockaddrInet6{Port: int(upstream.Port()), Addr: addr.As16()})
	if addr.Is4() {
		family, sa = unix.AF_INET, &unix.SockaddrInet4{Port: int(upstream.Port()), Addr: addr.As4()}
	}
	fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, os.NewSyscallError("socket", err)
	}
	// The file registers the socket with the runtime's poller, so that
	// waiting for the reply parks the goroutine, not a thread; closing it
	// closes the socket.
	f := os.NewFile(uintptr(fd), "dns-upstream")
	defer f.Close()
	if err := unix.Connect(fd, sa); err != nil {
		return 0, fmt.Errorf("connect to %s: %w", upstream, os.NewSyscallError("connect", err))
	}
	if err := f.SetReadDeadline(deadline); err != nil {
		return 0, err
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var (
		n       int
		rerr    error
		sent    bool
		skipped int
	)
	err = rc.Read(func(fd uintptr) bool {
		// The query is sent from within the read: the poller forgets a
		// readiness it saw before the read began, and a reply that came
		// in between would wait for the deadline. A first read would
		// catch it, but it finds nothing nearly always.
		if !sent {
			sent = true
			if _, rerr = unix.Write(int(fd), out); rerr != nil {
				rerr = fmt.Errorf("send to %s: %w", upstream, os.NewSyscallError("write", rerr))
				return true
			}
			return false
		}
		for {
			n, rerr = unix.Read(int(fd), buf)
			switch {
			case rerr == unix.EAGAIN:
				return false
			case rerr == unix.EINTR:
				continue
			case rerr != nil:
				rerr = fmt.Errorf("receive from %s: %w", upstream, os.NewSyscallError("read", rerr))
				return true
			case n >= 2 && binary.BigEndian.Uint16(buf) == id:
				return true
			}
			skipped++
		}
	})
	if err != nil {
		if skipped > 0 {
			return 0, fmt.Errorf("%w (%d datagrams with another ID skipped)", err, skipped)
		}
		return 0, err
	}
	if rerr != nil {
		return 0, rerr
	}
	return n, nil
}
