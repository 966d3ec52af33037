package fqdn

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"
)

// udpServer answers the proxy's UDP queries. One goroutine owns an epoll
// set holding the listening socket and the sockets to the resolvers
// (upstreams): it reads queries in batches (recvmmsg), forwards each
// allowed one, and writes the answers back in batches (sendmmsg). A query
// costs a few system calls and wakes no goroutine; a server with a
// goroutine per query waiting in the runtime's poller, and a socket per
// query, spent more than twice the CPU time per query on a virtual
// machine, most of it in system calls and the scheduler
// (docs/benchmarks.md). An answer held until policy allows its addresses
// is finished by a goroutine of its own, as is a query to an upstream
// given by name.
type udpServer struct {
	p     *Proxy
	fd    int // the listening socket, non-blocking
	local *net.UDPAddr
	// pktinfo is true when the socket is bound to an unspecified address:
	// each reply then leaves from the address its query came to.
	pktinfo bool
	epfd    int
	stopfd  int // an eventfd; written to stop the loop
	done    chan struct{}
	ctx     context.Context // cancelled on stop, for side goroutines
	cancel  context.CancelFunc
	side    sync.WaitGroup // side goroutines (held answers, named upstreams)

	// Owned by the loop.
	up        *upstreams
	deadlines []*udpQuery // forwarded, oldest first
	in        *msgBatch   // queries
	replyIn   *msgBatch   // the upstreams' replies
	out       *msgBatch   // answers
	replies   []udpReply
	lastWarn  time.Time
	// maxInflight bounds the queries waiting for resolvers at once.
	maxInflight int
}

// udpQuery is a query the loop forwarded and waits for the reply to.
type udpQuery struct {
	peer   peer
	client netip.AddrPort // peer's address
	dst    netip.Addr     // the address it came to, with pktinfo
	req    *dns.Msg
	size   int // the largest reply the client takes
	v      QueryVerdict
	// upstream is where it went, sock the socket it went out on (nil once
	// answered) under ID id, deadline when the loop stops waiting.
	upstream string
	sock     *upstreamSocket
	id       uint16
	deadline time.Time
}

// udpReply is an answer waiting for the loop's next batch of sends.
type udpReply struct {
	q      *udpQuery
	wire   []byte
	rcode  int
	result string
}

const (
	// udpBatch is the most datagrams read or written by one system call.
	udpBatch = 64
	// maxQueryLen is the longest query read; longer ones are cut and
	// answered FORMERR.
	maxQueryLen = 4096
	// maxInflight bounds the queries of one loop waiting for resolvers
	// at once; more are answered SERVFAIL.
	maxInflight = 8192
)

// newUDPServer serves the proxy's UDP queries on pc's socket, which it
// takes over (pc is closed).
func newUDPServer(p *Proxy, pc net.PacketConn) (*udpServer, error) {
	defer pc.Close()
	conn, ok := pc.(*net.UDPConn)
	if !ok {
		return nil, fmt.Errorf("not a UDP socket: %T", pc)
	}
	s := &udpServer{
		p: p, fd: -1, epfd: -1, stopfd: -1, local: conn.LocalAddr().(*net.UDPAddr),
		done: make(chan struct{}), maxInflight: maxInflight,
	}
	if p.udpMaxInflight > 0 {
		s.maxInflight = p.udpMaxInflight // a test's
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	if err := s.open(conn); err != nil {
		s.close()
		return nil, err
	}
	oob := 0
	if s.pktinfo {
		// An IPv4 query to an IPv6 socket may come with both kinds.
		oob = 2 * pktinfoSpace
	}
	s.in, s.out = newMsgBatch(udpBatch, maxQueryLen, oob), newMsgBatch(udpBatch, 0, oob)
	// A reply may be as long as a datagram can be: the client's size
	// decides what is too long (parseAnswer).
	s.replyIn = newMsgBatch(8, dns.MaxMsgSize, 0)
	s.up = newUpstreams(s.epfd)
	return s, nil
}

// open takes a duplicate of conn's socket (conn stays with the runtime's
// poller until closed) and sets up the epoll set.
func (s *udpServer) open(conn *net.UDPConn) error {
	rc, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	var dupErr error
	if err := rc.Control(func(fd uintptr) {
		s.fd, dupErr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil {
		return err
	}
	if dupErr != nil {
		return fmt.Errorf("duplicate the UDP socket: %w", dupErr)
	}
	// The runtime made the socket non-blocking; the duplicate shares
	// that, but say it: the loop must never block on it.
	if err := unix.SetNonblock(s.fd, true); err != nil {
		return err
	}
	domain, err := unix.GetsockoptInt(s.fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
	if err != nil {
		return fmt.Errorf("socket domain: %w", err)
	}
	v6 := domain == unix.AF_INET6
	if s.local.IP.IsUnspecified() {
		s.pktinfo = true
		// An IPv6 socket bound to :: serves IPv4 too: ask for both.
		errV4 := unix.SetsockoptInt(s.fd, unix.IPPROTO_IP, unix.IP_PKTINFO, 1)
		var errV6 error
		if v6 {
			errV6 = unix.SetsockoptInt(s.fd, unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1)
		}
		if (!v6 && errV4 != nil) || (v6 && errV6 != nil) {
			return fmt.Errorf("ask for each query's destination address: %w", errors.Join(errV4, errV6))
		}
	}
	if s.epfd, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		return fmt.Errorf("epoll_create1: %w", err)
	}
	if s.stopfd, err = unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC); err != nil {
		return fmt.Errorf("eventfd: %w", err)
	}
	for _, fd := range []int{s.fd, s.stopfd} {
		if err := unix.EpollCtl(s.epfd, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
			return fmt.Errorf("epoll_ctl: %w", err)
		}
	}
	return nil
}

// close releases what a server that is not running holds: its upstream
// sockets (the queries waiting get no answer: their clients ask again),
// its own descriptors and its side goroutines' context.
func (s *udpServer) close() {
	s.cancel()
	if s.up != nil {
		s.up.closeAll()
	}
	for _, fd := range []int{s.fd, s.epfd, s.stopfd} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

// run is the loop; it returns once stop is called.
func (s *udpServer) run() {
	defer close(s.done)
	events := make([]unix.EpollEvent, 2*udpBatch)
	for {
		n, err := unix.EpollWait(s.epfd, events, s.timeout())
		if err != nil && !errors.Is(err, unix.EINTR) {
			err = fmt.Errorf("epoll_wait: %w", err)
			s.p.log.Error("DNS proxy: UDP queries are no longer answered", "error", err)
			if s.p.health != nil {
				s.p.health.Degraded("UDP queries are no longer answered", err)
			}
			return
		}
		for _, ev := range events[:max(n, 0)] {
			switch fd := int(ev.Fd); fd {
			case s.stopfd:
				return
			case s.fd:
				s.readQueries()
			default:
				s.readReply(fd)
			}
		}
		s.expire(time.Now())
		s.flush()
	}
}

// stop ends the loop and waits for the side goroutines, then closes the
// sockets (see close).
func (s *udpServer) stop(ctx context.Context) error {
	var one [8]byte
	binary.NativeEndian.PutUint64(one[:], 1)
	if _, err := unix.Write(s.stopfd, one[:]); err != nil {
		return fmt.Errorf("stop the UDP loop: %w", err)
	}
	s.cancel()
	select {
	case <-s.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	s.side.Wait()
	s.close()
	return nil
}

// timeout is how long epoll_wait may wait: until the first deadline of a
// query in flight or the next sweep of the upstream sockets, or for ever
// when there is neither.
func (s *udpServer) timeout() int {
	for len(s.deadlines) > 0 && s.deadlines[0].sock == nil {
		s.deadlines[0] = nil
		s.deadlines = s.deadlines[1:]
	}
	var next time.Time
	if len(s.deadlines) > 0 {
		next = s.deadlines[0].deadline
	}
	if sweep := s.up.lastSweep.Add(socketLifetime); len(s.up.current) > 0 && (next.IsZero() || sweep.Before(next)) {
		next = sweep
	}
	if next.IsZero() {
		return -1
	}
	return int(max(time.Until(next).Milliseconds()+1, 0))
}

// readQueries reads the queries waiting on the listening socket, a batch
// at a time: the socket stays ready while more wait, and the loop comes
// back.
func (s *udpServer) readQueries() {
	n, err := s.in.recv(s.fd)
	if err != nil {
		if !errors.Is(err, unix.EAGAIN) && !errors.Is(err, unix.EINTR) {
			s.p.log.Debug("DNS proxy: reading UDP queries", "error", err)
		}
		return
	}
	for i := range n {
		data, from, dst, truncated := s.in.message(i)
		s.query(data, from, dst, truncated)
	}
}

// query handles one datagram from a client, sent to dst.
func (s *udpServer) query(data []byte, from peer, dst netip.Addr, truncated bool) {
	defer s.recover()
	client := from.addrPort()
	// Too short for a header, or a response: never answered, so that two
	// DNS speakers cannot answer each other for ever.
	if len(data) < 12 || data[2]&0x80 != 0 || !client.IsValid() {
		return
	}
	req := new(dns.Msg)
	if !s.p.served(client) {
		// Answered REFUSED with the question, when it parses: a stub
		// resolver drops an answer to another question and would wait.
		_ = req.Unpack(data)
		wire, err := new(dns.Msg).SetRcode(req, dns.RcodeRefused).Pack()
		if err == nil {
			s.replies = append(s.replies, udpReply{q: &udpQuery{peer: from, client: client, dst: dst}, wire: wire, rcode: dns.RcodeRefused})
		}
		return
	}
	if truncated || req.Unpack(data) != nil || !wellFormed(req) {
		s.replies = append(s.replies, udpReply{q: &udpQuery{peer: from, client: client, dst: dst}, wire: formErr(data), rcode: dns.RcodeFormatError})
		return
	}
	v, upstream, refusal := s.p.admit(req, client, false)
	q := &udpQuery{peer: from, client: client, dst: dst, req: req, size: replySize("udp", req), v: v, upstream: upstream}
	if refusal != nil {
		s.answer(q, refusal, "")
		return
	}
	ap, err := netip.ParseAddrPort(upstream)
	if err != nil || ap.Addr().Zone() != "" {
		// A name or a zoned address: net.Dial's, in a goroutine.
		s.side.Go(func() {
			resp, ans, result, unlabelled := s.p.handle(s.ctx, "udp", req, upstream, q.v.Endpoint)
			q.v.Answers, q.v.Unlabelled = ans.ips, unlabelled
			s.sendNow(q, s.pack(q, resp), resp.Rcode, result)
		})
		return
	}
	if s.up.pending >= s.maxInflight {
		if time.Since(s.lastWarn) > time.Second {
			s.lastWarn = time.Now()
			s.p.log.Warn("DNS proxy: too many queries waiting for the upstream, answering SERVFAIL", "limit", s.maxInflight)
		}
		s.answer(q, new(dns.Msg).SetRcode(req, dns.RcodeServerFailure), resultServFail)
		return
	}
	if s.up.bySource[client.Addr()] >= s.p.cfg.DNSProxyMaxInflightPerSource {
		// One client's queries to a resolver that does not answer must
		// not take the room of every other client's: past its budget,
		// that client alone is answered SERVFAIL.
		s.p.refuse(refusedSourceBudget, client, "DNS proxy: a client has too many queries waiting for resolvers, answering it SERVFAIL")
		s.answer(q, new(dns.Msg).SetRcode(req, dns.RcodeServerFailure), resultServFail)
		return
	}
	out, err := upstreamQuery(req)
	if err != nil {
		s.answer(q, new(dns.Msg).SetRcode(req, dns.RcodeFormatError), "")
		return
	}
	now := time.Now()
	if err := s.up.send(q, ap, out, now); err != nil {
		resp, result := s.p.upstreamFailed(req, upstream, err)
		s.answer(q, resp, result)
		return
	}
	q.deadline = now.Add(s.p.cfg.DNSUpstreamTimeout)
	s.deadlines = append(s.deadlines, q)
}

// readReply reads the replies that came on the upstream socket fd.
func (s *udpServer) readReply(fd int) {
	sock := s.up.byFD[fd]
	if sock == nil {
		return // closed earlier in this round
	}
	n, err := s.replyIn.recv(fd)
	switch {
	case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.EINTR):
		return
	case err != nil:
		for _, q := range s.up.fail(sock) {
			resp, result := s.p.upstreamFailed(q.req, q.upstream, fmt.Errorf("receive from %s: %w", q.upstream, os.NewSyscallError("recvmmsg", err)))
			s.answer(q, resp, result)
		}
		return
	}
	for i := range n {
		data, _, _, _ := s.replyIn.message(i)
		// Not the reply to a query waiting (a late one, or spoofed):
		// the kernel let it through the connected socket, so it came
		// from the resolver's address, but it answers nothing.
		if q := s.up.take(sock, data); q != nil {
			s.passOn(q, bytes.Clone(data))
		}
	}
}

// passOn answers q with wire, the upstream's reply to it. An answer that
// may change what policy knows of its addresses is labelled, and held,
// by a goroutine of its own: the loop never waits for a statedb write or
// for the lock of one in progress.
func (s *udpServer) passOn(q *udpQuery, wire []byte) {
	defer s.recover()
	resp, ans, result := s.p.check(q.req, wire, q.size, q.upstream)
	q.v.Answers = ans.ips
	if result == resultDropped {
		s.answer(q, resp, result)
		return
	}
	if len(ans.ips) == 0 {
		s.replies = append(s.replies, udpReply{q: q, wire: wire, rcode: resp.Rcode, result: result})
		return
	}
	endpoint, unlabelled, ok := s.p.scope(q.upstream, q.v.Endpoint, ans)
	q.v.Unlabelled = unlabelled
	if ok && !s.p.names.settled(ans.name, endpoint, ans.ips, ans.ttl, s.p.now()) {
		s.side.Go(func() {
			result, held, over := s.p.label(ans, endpoint, q.v.Endpoint)
			if over {
				q.v.Unlabelled = unlabelledPodLimit
			}
			if held != nil {
				s.p.hold(s.ctx, held)
			}
			s.sendNow(q, wire, resp.Rcode, result)
		})
		return
	}
	// The upstream's reply as it came: it answers the client's question
	// with the client's ID, and fits what the client takes.
	s.replies = append(s.replies, udpReply{q: q, wire: wire, rcode: resp.Rcode, result: result})
}

// expire answers SERVFAIL to the queries whose upstream did not reply in
// time.
func (s *udpServer) expire(now time.Time) {
	for len(s.deadlines) > 0 {
		q := s.deadlines[0]
		if q.sock != nil && now.Before(q.deadline) {
			break
		}
		s.deadlines[0] = nil
		s.deadlines = s.deadlines[1:]
		if q.sock != nil {
			s.up.forget(q)
			resp, result := s.p.upstreamFailed(q.req, q.upstream, fmt.Errorf("no reply from %s within %s: %w", q.upstream, s.p.cfg.DNSUpstreamTimeout, os.ErrDeadlineExceeded))
			s.answer(q, resp, result)
		}
	}
	s.up.sweep(now)
}

// answer queues resp for q's client.
func (s *udpServer) answer(q *udpQuery, resp *dns.Msg, result string) {
	s.replies = append(s.replies, udpReply{q: q, wire: s.pack(q, resp), rcode: resp.Rcode, result: result})
}

// pack returns resp as q's client gets it: with its ID, truncated to the
// size it takes; an answer that does not pack is SERVFAIL.
func (s *udpServer) pack(q *udpQuery, resp *dns.Msg) []byte {
	resp.Id = q.req.Id
	resp.Truncate(q.size)
	wire, err := resp.Pack()
	if err != nil {
		s.p.log.Debug("DNS proxy: an answer does not pack, answering SERVFAIL", "error", err)
		wire, _ = new(dns.Msg).SetRcode(q.req, dns.RcodeServerFailure).Pack()
	}
	return wire
}

// flush sends the queued replies and records their queries.
func (s *udpServer) flush() {
	for sent := 0; sent < len(s.replies); {
		batch := s.replies[sent:min(len(s.replies), sent+udpBatch)]
		for i, r := range batch {
			s.out.set(i, r.wire, r.q.peer, r.q.dst)
		}
		n, err := s.out.send(s.fd, len(batch))
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			// The first reply could not be sent (the kernel took
			// none): it is lost, the client asks again.
			s.p.log.Debug("DNS proxy: could not answer a UDP client", "client", batch[0].q.client, "error", err)
			n = 1
		}
		for _, r := range batch[:n] {
			if r.q.req != nil {
				s.p.record(&r.q.v, r.rcode, r.result)
			}
		}
		sent += n
	}
	clear(s.replies)
	s.replies = s.replies[:0]
}

// sendNow sends one reply from a side goroutine and records its query.
func (s *udpServer) sendNow(q *udpQuery, wire []byte, rcode int, result string) {
	b := newMsgBatch(1, 0, pktinfoSpace)
	b.set(0, wire, q.peer, q.dst)
	if _, err := b.send(s.fd, 1); err != nil {
		s.p.log.Debug("DNS proxy: could not answer a UDP client", "client", q.client, "error", err)
	}
	s.p.record(&q.v, rcode, result)
}

// recover keeps a panic on one query's input from taking the agent down.
func (s *udpServer) recover() {
	if r := recover(); r != nil {
		s.p.log.Error("DNS proxy: panic while handling a request", "panic", r)
	}
}

// formErr is the FORMERR answer to query, a header of its own: the ID,
// opcode and RD bit of the query, no records.
func formErr(query []byte) []byte {
	r := make([]byte, 12)
	copy(r, query[:2])
	r[2] = 0x80 | query[2]&0x79 // QR; the query's opcode and RD
	r[3] = dns.RcodeFormatError
	return r
}
