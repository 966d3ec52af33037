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
	"time"

	"github.com/miekg/dns"

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
	now       func() time.Time

	mu       sync.Mutex
	udp, tcp *dns.Server
	addr     string // the address it listens on, once started
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
	if p.udp == nil || p.udp.PacketConn == nil {
		return nil
	}
	return p.udp.PacketConn.LocalAddr()
}

// start listens on cfg.DNSProxyAddr, UDP and TCP on the same port (with
// port 0, the port the kernel picks for UDP).
func (p *Proxy) start() error {
	pc, ln, err := listenBoth(p.cfg.DNSProxyAddr)
	if err != nil {
		return fmt.Errorf("DNS proxy: %w", err)
	}
	udp := &dns.Server{PacketConn: pc, Handler: p, UDPSize: dns.MaxMsgSize}
	tcp := &dns.Server{Listener: ln, Handler: p, ReadTimeout: 5 * time.Second, WriteTimeout: 5 * time.Second}
	v4, v6 := proxyTargets(pc.LocalAddr())
	p.mu.Lock()
	p.udp, p.tcp, p.addr = udp, tcp, pc.LocalAddr().String()
	p.self = []netip.AddrPort{v4, v6, addrPortOf(pc.LocalAddr())}
	p.mu.Unlock()
	for _, s := range []*dns.Server{udp, tcp} {
		p.servers.Add(1)
		go func() {
			defer p.servers.Done()
			if err := s.ActivateAndServe(); err != nil {
				p.log.Error("DNS proxy server stopped", "error", err)
			}
		}()
	}
	p.log.Info("DNS proxy listening", "addr", p.addr, "upstream", p.cfg.DNSUpstream)
	return nil
}

func (p *Proxy) stop(ctx context.Context) error {
	p.mu.Lock()
	udp, tcp := p.udp, p.tcp
	p.addr = ""
	p.mu.Unlock()
	var errs []error
	for _, s := range []*dns.Server{udp, tcp} {
		if s != nil {
			if err := s.ShutdownContext(ctx); err != nil {
				errs = append(errs, err)
			}
		}
	}
	p.servers.Wait()
	return errors.Join(errs...)
}

// ServeDNS implements dns.Handler.
func (p *Proxy) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	defer func() {
		// The proxy never takes the agent down on input.
		if r := recover(); r != nil {
			p.log.Error("DNS proxy: panic while handling a request", "panic", r)
		}
	}()
	start := time.Now()
	if len(req.Question) != 1 || req.Response || req.Opcode != dns.OpcodeQuery {
		p.reply(w, req, new(dns.Msg).SetRcode(req, dns.RcodeFormatError))
		return
	}
	network := w.LocalAddr().Network()
	q := req.Question[0]
	v := QueryVerdict{
		Time: start, Client: addrPortOf(w.RemoteAddr()), Protocol: "UDP",
		Name: q.Name, Type: dns.Type(q.Qtype).String(), Allowed: true,
	}
	proto := uint8(17)
	if network == "tcp" {
		v.Protocol, proto = "TCP", 6
	}
	upstream := p.cfg.DNSUpstream
	if p.intercept != nil && v.Client.IsValid() {
		if o, ok := p.intercept.Origin(proto, v.Client); ok {
			v.Endpoint = o.Endpoint
			if o.Resolver.IsValid() && !p.isSelf(o.Resolver) {
				v.Resolver, upstream = o.Resolver, o.Resolver.String()
			}
			rule, allowed := p.patterns.allowedBy(o.Rules, q.Name)
			v.Allowed, v.Policy = allowed, rule.Policy
		}
	}
	var resp *dns.Msg
	if v.Allowed {
		var ans answer
		var result string
		resp, ans, result = p.handle(context.Background(), network, req, upstream)
		p.metrics.requests.WithLabelValues(result).Inc()
		v.Answers = ans.ips
	} else {
		resp = new(dns.Msg).SetRcode(req, p.rejectRcode())
	}
	if !v.Resolver.IsValid() {
		v.Resolver, _ = netip.ParseAddrPort(upstream)
	}
	p.reply(w, req, resp)
	v.RCode = dns.RcodeToString[resp.Rcode]
	v.Latency = time.Since(start)
	verdict := verdictAllowed
	if !v.Allowed {
		verdict = verdictDenied
	}
	p.metrics.queries.WithLabelValues(verdict, v.RCode).Inc()
	if p.intercept != nil {
		p.intercept.Report(v)
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

// handle forwards req over network ("udp" or "tcp") to upstream and
// returns the reply for the client, what it answered, and the result for
// the metric.
func (p *Proxy) handle(ctx context.Context, network string, req *dns.Msg, upstream string) (*dns.Msg, answer, string) {
	q := req.Question[0]
	maxSize := dns.MaxMsgSize
	if network == "udp" {
		maxSize = dns.MinMsgSize
		if opt := req.IsEdns0(); opt != nil {
			maxSize = max(int(opt.UDPSize()), dns.MinMsgSize)
		}
	}
	wire, err := p.exchange(ctx, network, req, upstream, maxSize)
	if err != nil {
		p.log.Warn("DNS upstream failed, answering SERVFAIL", "name", q.Name, "upstream", upstream, "error", err)
		return new(dns.Msg).SetRcode(req, dns.RcodeServerFailure), answer{}, resultServFail
	}
	resp, ans, err := parseAnswer(req, wire, maxSize)
	if err != nil {
		reason := "malformed"
		var de *dropError
		if errors.As(err, &de) {
			reason = de.reason
		}
		p.metrics.dropped.WithLabelValues(reason).Inc()
		p.log.Warn("Dropped the upstream's answer, answering SERVFAIL", "name", q.Name, "upstream", upstream, "error", err)
		return new(dns.Msg).SetRcode(req, dns.RcodeServerFailure), answer{}, resultDropped
	}
	if len(ans.ips) == 0 {
		return resp, ans, resultForwarded
	}
	start := time.Now()
	rev, changed, err := p.names.observe(ans.name, ans.ips, ans.ttl, p.now())
	if err != nil {
		// The answer is still good; policy just does not know its
		// addresses yet.
		p.log.Error("Could not label the addresses of a DNS answer", "name", ans.name, "error", err)
		return resp, ans, resultForwarded
	}
	if !changed {
		return resp, ans, resultForwarded
	}
	wctx, cancel := context.WithTimeout(ctx, p.cfg.ToFQDNsProxyResponseMaxDelay)
	defer cancel()
	if err := p.prefixes.Wait(wctx, rev); err != nil {
		p.metrics.delayExceeded.Inc()
		p.log.Warn("Releasing a DNS answer before the ipcache map has its addresses",
			"name", ans.name, "max-delay", p.cfg.ToFQDNsProxyResponseMaxDelay, "error", err)
	} else if p.gate != nil {
		if err := p.gate.Wait(wctx, ans.ips); err != nil {
			p.metrics.delayExceeded.Inc()
			p.log.Warn("Releasing a DNS answer before the policy map allows its addresses",
				"name", ans.name, "max-delay", p.cfg.ToFQDNsProxyResponseMaxDelay, "error", err)
		}
	}
	p.metrics.holdSeconds.Observe(time.Since(start).Seconds())
	return resp, ans, resultLabelled
}

// reply writes resp to the client, truncated to what a UDP client takes.
func (p *Proxy) reply(w dns.ResponseWriter, req, resp *dns.Msg) {
	resp.Id = req.Id
	if w.LocalAddr().Network() == "udp" {
		size := dns.MinMsgSize
		if opt := req.IsEdns0(); opt != nil {
			size = max(int(opt.UDPSize()), dns.MinMsgSize)
		}
		resp.Truncate(size)
	}
	if err := w.WriteMsg(resp); err != nil {
		p.log.Debug("DNS proxy: could not answer the client", "error", err)
		if resp.Rcode != dns.RcodeServerFailure {
			// An answer that parsed but does not pack again: the
			// client gets SERVFAIL rather than silence.
			_ = w.WriteMsg(new(dns.Msg).SetRcode(req, dns.RcodeServerFailure))
		}
	}
}

// exchange sends req to upstream and returns the reply's bytes, not yet
// parsed: parseAnswer decides what is malformed. Over UDP, each query has
// a socket (and a random source port) of its own, and datagrams from
// elsewhere or with another ID are ignored, as a resolver does (see
// udpExchange for an upstream given as an address); a reply is
// read into maxSize+1 bytes (a bigger one is cut there, and parseAnswer
// drops it as oversized), not 64 KiB: a buffer per query is most of the
// garbage the proxy makes.
func (p *Proxy) exchange(ctx context.Context, network string, req *dns.Msg, upstream string, maxSize int) ([]byte, error) {
	out, err := req.Pack()
	if err != nil {
		return nil, fmt.Errorf("pack the request: %w", err)
	}
	deadline := time.Now().Add(p.cfg.DNSUpstreamTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	if network == "udp" {
		// A name or a zoned address (link-local) is left to net.Dial.
		if ap, err := netip.ParseAddrPort(upstream); err == nil && ap.Addr().Zone() == "" {
			buf := make([]byte, min(maxSize+1, dns.MaxMsgSize))
			n, err := udpExchange(ap, out, buf, deadline)
			if err != nil {
				return nil, err
			}
			return buf[:n], nil
		}
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

// listenBoth listens on addr over UDP and TCP, on the same port. With port
// 0 the kernel picks the UDP port, which may be taken over TCP: then it
// tries again with another.
func listenBoth(addr string) (net.PacketConn, net.Listener, error) {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, nil, fmt.Errorf("--dns-proxy-addr=%q: %w", addr, err)
	}
	for attempt := 0; ; attempt++ {
		pc, err := net.ListenPacket("udp", addr)
		if err != nil {
			return nil, nil, fmt.Errorf("listen on udp %s: %w", addr, err)
		}
		ln, err := net.Listen("tcp", pc.LocalAddr().String())
		if err == nil {
			return pc, ln, nil
		}
		pc.Close()
		if port != "0" || attempt == 10 {
			return nil, nil, fmt.Errorf("listen on tcp %s: %w", pc.LocalAddr(), err)
		}
	}
}
