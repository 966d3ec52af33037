package fqdn

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

const (
	// socketQueries and socketLifetime bound what one upstream socket
	// carries: at most this many queries, sent within this long of its
	// opening. Then the next query opens a socket of its own, with a new
	// port the kernel picks at random.
	socketQueries  = 64
	socketLifetime = time.Second
)

// upstreams are udpServer's sockets to the resolvers it forwards to. Each
// is connected to one resolver, so the kernel drops datagrams from
// anywhere else, and carries a few queries at once, each under an ID the
// proxy picks at random and gives back to the client's reply. Against a
// spoofed answer, a query is guarded by its socket's random port, its
// random ID and its question (parseAnswer), as in a resolver; the port
// changes every socketQueries queries or socketLifetime. A socket per
// query would change it every time, at the cost of opening, registering
// and closing a socket for each (docs/benchmarks.md).
type upstreams struct {
	epfd int
	// current is the socket new queries to a resolver go out on.
	current map[netip.AddrPort]*upstreamSocket
	// byFD are all open sockets, retired ones waiting for their last
	// replies included.
	byFD map[int]*upstreamSocket
	// pending counts the queries waiting for a reply, bySource those of
	// each client address.
	pending   int
	bySource  map[netip.Addr]int
	lastSweep time.Time
}

// upstreamSocket is one socket to a resolver.
type upstreamSocket struct {
	fd      int
	to      netip.AddrPort
	opened  time.Time
	sent    int
	retired bool // no more queries: closed once the last one is answered
	pending map[uint16]*udpQuery
	// used are the IDs sent on the socket so far: none is used twice, so
	// that a late reply to a query given up on cannot pass for the reply
	// to a later one.
	used map[uint16]struct{}
}

func newUpstreams(epfd int) *upstreams {
	return &upstreams{epfd: epfd, current: map[netip.AddrPort]*upstreamSocket{}, byFD: map[int]*upstreamSocket{}, bySource: map[netip.Addr]int{}}
}

// send forwards query (whose ID it overwrites) to resolver to for q.
func (u *upstreams) send(q *udpQuery, to netip.AddrPort, query []byte, now time.Time) error {
	sock := u.current[to]
	if sock != nil && (sock.sent >= socketQueries || now.Sub(sock.opened) >= socketLifetime) {
		u.retire(sock)
		sock = nil
	}
	if sock == nil {
		var err error
		if sock, err = u.open(to, now); err != nil {
			return err
		}
		u.current[to] = sock
	}
	id := sock.freeID()
	binary.BigEndian.PutUint16(query, id)
	if _, err := unix.Write(sock.fd, query); err != nil {
		// Likely an error the resolver's host sent back for an
		// earlier query (ECONNREFUSED): the socket is not used again.
		u.retire(sock)
		return fmt.Errorf("send to %s: %w", to, os.NewSyscallError("write", err))
	}
	sock.sent++
	sock.pending[id] = q
	q.sock, q.id = sock, id
	u.pending++
	u.bySource[q.client.Addr()]++
	return nil
}

// open opens a socket to resolver to and adds it to the epoll set.
func (u *upstreams) open(to netip.AddrPort, now time.Time) (*upstreamSocket, error) {
	// An IPv4-mapped address is asked over IPv4, as net.Dial does.
	addr := to.Addr().Unmap()
	family, sa := unix.AF_INET6, unix.Sockaddr(&unix.SockaddrInet6{Port: int(to.Port()), Addr: addr.As16()})
	if addr.Is4() {
		family, sa = unix.AF_INET, &unix.SockaddrInet4{Port: int(to.Port()), Addr: addr.As4()}
	}
	fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	if err := unix.Connect(fd, sa); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("connect to %s: %w", to, os.NewSyscallError("connect", err))
	}
	if err := unix.EpollCtl(u.epfd, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("epoll_ctl", err)
	}
	sock := &upstreamSocket{fd: fd, to: to, opened: now, pending: map[uint16]*udpQuery{}, used: map[uint16]struct{}{}}
	u.byFD[fd] = sock
	return sock, nil
}

// freeID returns a random ID not used on s before, and marks it used.
func (s *upstreamSocket) freeID() uint16 {
	for {
		// The runtime's generator (ChaCha8, seeded by the kernel) is
		// not predictable from outside.
		id := uint16(rand.Uint32())
		if _, taken := s.used[id]; !taken {
			s.used[id] = struct{}{}
			return id
		}
	}
}

// take returns the query reply (a datagram that came on sock) answers,
// with the reply's ID set back to the client's; nil for a reply to no
// query waiting (a late one, or spoofed).
func (u *upstreams) take(sock *upstreamSocket, reply []byte) *udpQuery {
	if len(reply) < 2 {
		return nil
	}
	q := sock.pending[binary.BigEndian.Uint16(reply)]
	if q == nil {
		return nil
	}
	u.forget(q)
	binary.BigEndian.PutUint16(reply, q.req.Id)
	return q
}

// forget stops waiting for q's reply.
func (u *upstreams) forget(q *udpQuery) {
	sock := q.sock
	if sock == nil {
		return
	}
	delete(sock.pending, q.id)
	q.sock = nil
	u.pending--
	if u.bySource[q.client.Addr()]--; u.bySource[q.client.Addr()] <= 0 {
		delete(u.bySource, q.client.Addr())
	}
	if sock.retired && len(sock.pending) == 0 {
		u.close(sock)
	}
}

// fail stops waiting on sock, which reported err, and returns the queries
// that waited there: a connected socket's error (the resolver's host
// refused) belongs to no query in particular.
func (u *upstreams) fail(sock *upstreamSocket) []*udpQuery {
	var failed []*udpQuery
	for _, q := range sock.pending {
		failed = append(failed, q)
	}
	u.retire(sock)
	for _, q := range failed {
		u.forget(q)
	}
	return failed
}

// retire sends no more queries on sock, and closes it once none waits.
func (u *upstreams) retire(sock *upstreamSocket) {
	sock.retired = true
	if u.current[sock.to] == sock {
		delete(u.current, sock.to)
	}
	if len(sock.pending) == 0 {
		u.close(sock)
	}
}

func (u *upstreams) close(sock *upstreamSocket) {
	if _, open := u.byFD[sock.fd]; open {
		delete(u.byFD, sock.fd)
		unix.Close(sock.fd) // which takes it out of the epoll set
	}
}

// sweep retires the sockets past their lifetime, at most once a second,
// so that a resolver no longer asked keeps no socket open.
func (u *upstreams) sweep(now time.Time) {
	if now.Sub(u.lastSweep) < socketLifetime {
		return
	}
	u.lastSweep = now
	for _, sock := range u.current {
		if now.Sub(sock.opened) >= socketLifetime {
			u.retire(sock)
		}
	}
}

// closeAll closes every socket; the queries waiting get no reply.
func (u *upstreams) closeAll() {
	for _, sock := range u.byFD {
		u.close(sock)
	}
	clear(u.current)
	clear(u.bySource)
	u.pending = 0
}
