package fqdn

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/cells/ipcache"
)

// Proxy is the DNS proxy: it answers intercepted queries as the client's
// DNS rules say (refused, or forwarded to the resolver the client asked)
// and others by forwarding them to the upstream, and, for answers naming a
// name an FQDN selector matches, labels the addresses and holds the answer
// until the ipcache map has them (bounded by
// --tofqdns-proxy-response-max-delay).
type Proxy struct {
	log      *slog.Logger
	names    *nameManager
	prefixes ipcache.Prefixes
	gate     Gate // nil without policy enforcement
	// intercept is nil without policy enforcement: no query is then
	// intercepted, and none is checked against DNS rules.
	intercept Interceptor
	patterns  patterns
	metrics   *fqdnMetrics
	cfg       Config
	// health is the proxy's health scope; nil in tests.
	health cell.Health
	now    func() time.Time
	// sources are the clients served: this node's pods and the node; nil
	// serves loopback clients only.
	sources  *sources
	warnings throttledWarn
	// trust tells the resolvers whose answers label addresses; nil
	// trusts none.
	trust *trust
	// udpMaxInflight replaces maxInflight in tests; 0 in the agent.
	udpMaxInflight int

	mu   sync.Mutex
	udp  []*udpServer // one per loop, on sockets sharing the port
	tcp  *dns.Server
	addr string // the address it listens on, once started
	// self are the addresses the datapath sends intercepted DNS to, the
	// proxy's own: a query intercepted on its way to one of them goes to
	// the upstream.
	self    []netip.AddrPort
	servers sync.WaitGroup
}

// Addr returns the address the proxy listens on (UDP and TCP), or "" when
// it is disabled or not started.
func (p *Proxy) Addr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.addr
}

// listenAddr returns the address the proxy's UDP socket is bound to, nil
// when it is not started.
func (p *Proxy) listenAddr() net.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.udp) == 0 {
		return nil
	}
	return p.udp[0].local
}

// start listens on cfg.DNSProxyAddr, UDP and TCP on the same port (with
// port 0, the port the kernel picks for UDP).
func (p *Proxy) start() error {
	pcs, ln, err := listenBoth(p.cfg.DNSProxyAddr, max(p.cfg.DNSProxyUDPLoops, 1))
	if err != nil {
		return fmt.Errorf("DNS proxy: %w", err)
	}
	var udp []*udpServer
	for i, pc := range pcs {
		s, err := newUDPServer(p, pc)
		if err != nil {
			for _, pc := range pcs[i+1:] {
				pc.Close()
			}
			for _, s := range udp {
				s.close()
			}
			ln.Close()
			return fmt.Errorf("DNS proxy: %w", err)
		}
		udp = append(udp, s)
	}
	ln = &budgetListener{Listener: ln, p: p, max: max(p.cfg.DNSProxyMaxTCPPerSource, 1), open: map[netip.Addr]int{}}
	tcp := &dns.Server{Listener: ln, Handler: p, ReadTimeout: 5 * time.Second, WriteTimeout: 5 * time.Second}
	local := udp[0].local
	v4, v6 := proxyTargets(local)
	p.mu.Lock()
	p.udp, p.tcp, p.addr = udp, tcp, local.String()
	p.self = []netip.AddrPort{v4, v6, addrPortOf(local)}
	p.mu.Unlock()
	for _, s := range udp {
		p.servers.Go(s.run)
	}
	p.servers.Go(func() {
		if err := tcp.ActivateAndServe(); err != nil {
			p.log.Error("DNS proxy server stopped", "error", err)
		}
	})
	p.log.Info("DNS proxy listening", "addr", p.addr, "upstream", p.cfg.DNSUpstream)
	return nil
}

func (p *Proxy) stop(ctx context.Context) error {
	p.mu.Lock()
	udp, tcp := p.udp, p.tcp
	p.addr = ""
	p.mu.Unlock()
	var errs []error
	for _, s := range udp {
		errs = append(errs, s.stop(ctx))
	}
	if tcp != nil {
		errs = append(errs, tcp.ShutdownContext(ctx))
	}
	p.servers.Wait()
	return errors.Join(errs...)
}

// ServeDNS implements dns.Handler: the TCP server's queries (UDP ones are
// udpServer's).
func (p *Proxy) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	defer func() {
		// The proxy never takes the agent down on input.
		if r := recover(); r != nil {
			p.log.Error("DNS proxy: panic while handling a request", "panic", r)
		}
	}()
	client := addrPortOf(w.RemoteAddr())
	if !p.served(client) {
		p.reply(w, req, new(dns.Msg).SetRcode(req, dns.RcodeRefused))
		return
	}
	if !wellFormed(req) {
		p.reply(w, req, new(dns.Msg).SetRcode(req, dns.RcodeFormatError))
		return
	}
	v, upstream, resp := p.admit(req, client, true)
	result := ""
	if resp == nil {
		var ans answer
		resp, ans, result, v.Unlabelled = p.handle(context.Background(), "tcp", req, upstream, v.Endpoint)
		v.Answers = ans.ips
	}
	p.reply(w, req, resp)
	p.record(&v, resp.Rcode, result)
}

// served tells whether the proxy serves client, a pod of this node or the
// node itself (see sources); another is counted and warned about.
func (p *Proxy) served(client netip.AddrPort) bool {
	if p.sources.local(client.Addr()) {
		return true
	}
	p.refuse(refusedUnknownSource, client, "DNS proxy: refusing a query from a source that is neither a pod of this node nor the node")
	return false
}

// wellFormed tells whether req is a query the proxy answers other than
// with FORMERR: one question, a standard query.
func wellFormed(req *dns.Msg) bool {
	return len(req.Question) == 1 && !req.Response && req.Opcode == dns.OpcodeQuery
}

// admit decides what becomes of query req (well-formed) from client, over
// TCP or UDP. It returns the verdict so far and the resolver to forward
// the query to or, for a query no DNS rule of the client allows, the
// answer to give instead.
func (p *Proxy) admit(req *dns.Msg, client netip.AddrPort, tcp bool) (v QueryVerdict, upstream string, refusal *dns.Msg) {
	v = QueryVerdict{Time: time.Now(), Client: client, Protocol: "UDP", Allowed: true}
	proto := uint8(17)
	if tcp {
		v.Protocol, proto = "TCP", 6
	}
	upstream = p.cfg.DNSUpstream
	q := req.Question[0]
	v.Name, v.Type = q.Name, dns.Type(q.Qtype).String()
	if p.intercept != nil && client.IsValid() {
		if o, ok := p.intercept.Origin(proto, client); ok {
			v.Endpoint = o.Endpoint
			if o.Resolver.IsValid() && !p.isSelf(o.Resolver) {
				v.Resolver, upstream = o.Resolver, o.Resolver.String()
			}
			rule, allowed := p.patterns.allowedBy(o.Rules, q.Name)
			v.Allowed, v.Policy = allowed, rule.Policy
		}
	}
	if !v.Resolver.IsValid() {
		v.Resolver, _ = netip.ParseAddrPort(upstream)
	}
	if !v.Allowed {
		return v, upstream, new(dns.Msg).SetRcode(req, p.rejectRcode())
	}
	return v, upstream, nil
}

// record counts a query answered with rcode and hands its verdict to the
// monitor; result is the requests metric's label for a forwarded query,
// empty for one that was not.
func (p *Proxy) record(v *QueryVerdict, rcode int, result string) {
	if result != "" {
		p.metrics.requests.WithLabelValues(result).Inc()
	}
	v.RCode = dns.RcodeToString[rcode]
	v.Latency = time.Since(v.Time)
	verdict := verdictAllowed
	if !v.Allowed {
		verdict = verdictDenied
	}
	p.metrics.queries.WithLabelValues(verdict, v.RCode).Inc()
	if p.intercept != nil {
		p.intercept.Report(*v)
	}
}

// isSelf tells whether ap is one of the proxy's own addresses.
func (p *Proxy) isSelf(ap netip.AddrPort) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Contains(p.self, ap)
}

// rejectRcode is the answer to a query no DNS rule allows.
func (p *Proxy) rejectRcode() int {
	if p.cfg.DNSRejectResponse == RejectNXDomain {
		return dns.RcodeNameError
	}
	return dns.RcodeRefused
}

// handle forwards req, a query of endpoint ("" for none), over network
// ("udp" or "tcp") to upstream and returns the reply for the client, what
// it answered, the result for the metric and why its addresses were not
// labelled for every pod (QueryVerdict.Unlabelled); an answer with new
// addresses is held (see hold).
func (p *Proxy) handle(ctx context.Context, network string, req *dns.Msg, upstream, endpoint string) (*dns.Msg, answer, string, string) {
	maxSize := replySize(network, req)
	wire, err := p.exchange(ctx, network, req, upstream, maxSize)
	if err != nil {
		resp, result := p.upstreamFailed(req, upstream, err)
		return resp, answer{}, result, ""
	}
	resp, ans, result, held, unlabelled := p.learn(req, wire, maxSize, upstream, endpoint)
	if result == resultUntrusted {
		result = resultForwarded
	}
	if held != nil {
		p.hold(ctx, held)
	}
	return resp, ans, result, unlabelled
}

// replySize is the largest reply to req the client takes over network: the
// UDP size it asked for (at least 512 bytes), or 65,535 bytes over TCP.
func replySize(network string, req *dns.Msg) int {
	if network != "udp" {
		return dns.MaxMsgSize
	}
	if opt := req.IsEdns0(); opt != nil {
		return max(int(opt.UDPSize()), dns.MinMsgSize)
	}
	return dns.MinMsgSize
}

// upstreamFailed is the answer to req when the exchange with upstream
// failed: SERVFAIL.
func (p *Proxy) upstreamFailed(req *dns.Msg, upstream string, err error) (*dns.Msg, string) {
	p.log.Warn("DNS upstream failed, answering SERVFAIL", "name", req.Question[0].Name, "upstream", upstream, "error", err)
	return new(dns.Msg).SetRcode(req, dns.RcodeServerFailure), resultServFail
}

// heldAnswer is an answer whose addresses are new to policy: it waits
// until the ipcache map has them (revision rev) and policy allows them.
type heldAnswer struct {
	ans   answer
	rev   ipcache.Revision
	since time.Time
}

// learn checks wire, upstream's reply to req (a query of endpoint), and
// labels the addresses it gives a name FQDN selectors match: for every
// pod, or for endpoint alone (see scope). It returns the reply for the
// client, what it answered, the result for the metric and why the
// addresses were not labelled for every pod; held is non-nil when the
// answer must wait (see hold) before the client gets it.
func (p *Proxy) learn(req *dns.Msg, wire []byte, maxSize int, upstream, endpoint string) (resp *dns.Msg, ans answer, result string, held *heldAnswer, unlabelled string) {
	resp, ans, result = p.check(req, wire, maxSize, upstream)
	if result == resultDropped || len(ans.ips) == 0 {
		return resp, ans, result, nil, ""
	}
	rowEndpoint, unlabelled, ok := p.scope(upstream, endpoint, ans)
	if !ok {
		return resp, ans, resultUntrusted, nil, unlabelled
	}
	result, held, over := p.label(ans, rowEndpoint, endpoint)
	if over {
		unlabelled = unlabelledPodLimit
	}
	return resp, ans, result, held, unlabelled
}

// check parses wire, upstream's reply to req. A reply that does not
// answer req is dropped: the client gets SERVFAIL, result is
// resultDropped.
func (p *Proxy) check(req *dns.Msg, wire []byte, maxSize int, upstream string) (resp *dns.Msg, ans answer, result string) {
	resp, ans, err := parseAnswer(req, wire, maxSize)
	if err != nil {
		reason := "malformed"
		var de *dropError
		if errors.As(err, &de) {
			reason = de.reason
		}
		p.metrics.dropped.WithLabelValues(reason).Inc()
		p.log.Warn("Dropped the upstream's answer, answering SERVFAIL", "name", req.Question[0].Name, "upstream", upstream, "error", err)
		return new(dns.Msg).SetRcode(req, dns.RcodeServerFailure), answer{}, resultDropped
	}
	return resp, ans, resultForwarded
}

// label records ans's addresses, an answer to a query of by, for the FQDN
// selectors matching its name: for every pod with endpoint empty, for
// endpoint alone otherwise. held is non-nil when that changed what policy
// knows; over is true when by's --tofqdns-max-ips-per-pod left some of
// the addresses out.
func (p *Proxy) label(ans answer, endpoint, by string) (result string, held *heldAnswer, over bool) {
	start := time.Now()
	rev, changed, refused, err := p.names.observe(ans.name, endpoint, by, ans.ips, ans.ttl, p.now())
	if len(refused) > 0 {
		p.warnings.warn(p.log, "pod-limit", "DNS proxy: a pod's answers brought --tofqdns-max-ips-per-pod addresses already; not labelling more",
			"endpoint", by, "name", ans.name, "refused", len(refused), "first", refused[0], "limit", p.cfg.ToFQDNsMaxIPsPerPod)
	}
	if err != nil {
		// The answer is still good; policy just does not know its
		// addresses yet.
		p.log.Error("Could not label the addresses of a DNS answer", "name", ans.name, "error", err)
		return resultForwarded, nil, len(refused) > 0
	}
	if !changed {
		return resultForwarded, nil, len(refused) > 0
	}
	return resultLabelled, &heldAnswer{ans: ans, rev: rev, since: start}, len(refused) > 0
}

// hold waits until the ipcache map has h's addresses and policy allows
// them, or --tofqdns-proxy-response-max-delay has passed.
func (p *Proxy) hold(ctx context.Context, h *heldAnswer) {
	wctx, cancel := context.WithTimeout(ctx, p.cfg.ToFQDNsProxyResponseMaxDelay)
	defer cancel()
	if err := p.prefixes.Wait(wctx, h.rev); err != nil {
		p.metrics.delayExceeded.Inc()
		p.log.Warn("Releasing a DNS answer before the ipcache map has its addresses",
			"name", h.ans.name, "max-delay", p.cfg.ToFQDNsProxyResponseMaxDelay, "error", err)
	} else if p.gate != nil {
		if err := p.gate.Wait(wctx, h.ans.ips); err != nil {
			p.metrics.delayExceeded.Inc()
			p.log.Warn("Releasing a DNS answer before the policy map allows its addresses",
				"name", h.ans.name, "max-delay", p.cfg.ToFQDNsProxyResponseMaxDelay, "error", err)
		}
	}
	p.metrics.holdSeconds.Observe(time.Since(h.since).Seconds())
}

// reply writes resp to the TCP client.
func (p *Proxy) reply(w dns.ResponseWriter, req, resp *dns.Msg) {
	resp.Id = req.Id
	if err := w.WriteMsg(resp); err != nil {
		p.log.Debug("DNS proxy: could not answer the client", "error", err)
		if resp.Rcode != dns.RcodeServerFailure {
			// An answer that parsed but does not pack again: the
			// client gets SERVFAIL rather than silence.
			_ = w.WriteMsg(new(dns.Msg).SetRcode(req, dns.RcodeServerFailure))
		}
	}
}

// exchange sends req to upstream over network and returns the reply's
// bytes, not yet parsed: parseAnswer decides what is malformed. It serves
// TCP, and UDP to an upstream given by name (udpServer forwards UDP to an
// address itself). Over UDP, each query has a socket (and a random source
// port) of its own, and datagrams with another ID are ignored, as a
// resolver does; a reply is read into maxSize+1 bytes (a bigger one is
// cut there, and parseAnswer drops it as oversized), not 64 KiB.
func (p *Proxy) exchange(ctx context.Context, network string, req *dns.Msg, upstream string, maxSize int) ([]byte, error) {
	out, err := upstreamQuery(req)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(p.cfg.DNSUpstreamTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, network, upstream)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	if err := conn.SetDeadline(deadline); err != nil {
		return nil, err
	}
	if network == "tcp" {
		msg := binary.BigEndian.AppendUint16(nil, uint16(len(out)))
		if _, err := conn.Write(append(msg, out...)); err != nil {
			return nil, err
		}
		var n [2]byte
		if _, err := io.ReadFull(conn, n[:]); err != nil {
			return nil, err
		}
		buf := make([]byte, binary.BigEndian.Uint16(n[:]))
		if _, err := io.ReadFull(conn, buf); err != nil {
			return nil, err
		}
		return buf, nil
	}
	if _, err := conn.Write(out); err != nil {
		return nil, err
	}
	buf := make([]byte, min(maxSize+1, dns.MaxMsgSize))
	for {
		n, err := conn.Read(buf)
		if err != nil {
			return nil, err
		}
		// A datagram too short to carry the ID, or with another ID, is
		// not the reply (a late one to an earlier query, or spoofed).
		if n >= 2 && binary.BigEndian.Uint16(buf) == req.Id {
			return buf[:n], nil
		}
	}
}

// upstreamQuery returns the query sent to a resolver for req, the
// client's query: rebuilt from what the proxy checked, never the client's
// bytes. It keeps the ID, the RD, CD and AD bits, the one question and,
// when the client sent EDNS, its UDP size (which bounds the answer the
// client takes) and DO bit (DNSSEC records asked for); it drops every
// EDNS option (client subnet, cookies, padding, anything a resolver or
// the path to it may act on), the answer, authority and additional
// records (TSIG included: a signed query goes out unsigned), and bytes
// after the message. Nothing a pod sends then reaches the resolver beyond
// the question the DNS rules judged.
func upstreamQuery(req *dns.Msg) ([]byte, error) {
	q := &dns.Msg{
		MsgHdr: dns.MsgHdr{
			Id: req.Id, Opcode: dns.OpcodeQuery, RecursionDesired: req.RecursionDesired,
			CheckingDisabled: req.CheckingDisabled, AuthenticatedData: req.AuthenticatedData,
		},
		Question: []dns.Question{req.Question[0]},
	}
	if opt := req.IsEdns0(); opt != nil {
		q.SetEdns0(max(opt.UDPSize(), dns.MinMsgSize), opt.Do())
	}
	out, err := q.Pack()
	if err != nil {
		return nil, fmt.Errorf("pack the query for the resolver: %w", err)
	}
	return out, nil
}

// listenBoth listens on addr over TCP and, with loops sockets sharing
// the port (SO_REUSEPORT: the kernel spreads the clients over them), over
// UDP. With port 0 the kernel picks the UDP port, which may be taken over
// TCP: then it tries again with another.
func listenBoth(addr string, loops int) ([]net.PacketConn, net.Listener, error) {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, nil, fmt.Errorf("--dns-proxy-addr=%q: %w", addr, err)
	}
	lc := net.ListenConfig{}
	if loops > 1 {
		lc.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
			}); err != nil {
				return err
			}
			return serr
		}
	}
	closeAll := func(pcs []net.PacketConn) {
		for _, pc := range pcs {
			pc.Close()
		}
	}
	for attempt := 0; ; attempt++ {
		first, err := lc.ListenPacket(context.Background(), "udp", addr)
		if err != nil {
			return nil, nil, fmt.Errorf("listen on udp %s: %w", addr, err)
		}
		pcs := []net.PacketConn{first}
		for len(pcs) < loops {
			pc, err := lc.ListenPacket(context.Background(), "udp", first.LocalAddr().String())
			if err != nil {
				closeAll(pcs)
				return nil, nil, fmt.Errorf("listen on udp %s again: %w", first.LocalAddr(), err)
			}
			pcs = append(pcs, pc)
		}
		ln, err := net.Listen("tcp", first.LocalAddr().String())
		if err == nil {
			return pcs, ln, nil
		}
		closeAll(pcs)
		if port != "0" || attempt == 10 {
			return nil, nil, fmt.Errorf("listen on tcp %s: %w", first.LocalAddr(), err)
		}
	}
}
