package fqdn

import (
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/apiary-net/apiary/cells/fqdn/pattern"
	"github.com/apiary-net/apiary/tables"
)

// Interceptor is the datapath side of transparent DNS interception, which
// policy enforcement provides when it is part of the agent: its programs
// send the DNS (port 53) of endpoints whose egress policy has a DNS rule to
// the proxy, and tell it whom each client asked.
type Interceptor interface {
	// SetProxy tells the datapath where intercepted DNS goes: proxy4 (an
	// IPv4 address) and proxy6 (an IPv6 one), either invalid for none of
	// that family. intercept false stops interception: the DNS of
	// endpoints with a DNS rule is then denied, not let through
	// unfiltered.
	SetProxy(proxy4, proxy6 netip.AddrPort, intercept bool) error
	// Origin returns what the datapath knows of a query that came from
	// client over protocol (6 TCP, 17 UDP); ok is false for a query the
	// datapath did not redirect (sent to the proxy's address directly).
	Origin(protocol uint8, client netip.AddrPort) (o Origin, ok bool)
	// Report hands the verdict on a query to `apiary monitor`.
	Report(q QueryVerdict)
}

// Origin is what the datapath knows of an intercepted query.
type Origin struct {
	// Resolver is the address and port the client asked, after the
	// socket load balancer (a Service's backend).
	Resolver netip.AddrPort
	// Endpoint is the client endpoint's name; empty when the agent does
	// not know it (any more): then no name is allowed.
	Endpoint string
	// Rules are the names the endpoint may look up.
	Rules []tables.DNSRule
}

// QueryVerdict is the proxy's verdict on one query.
type QueryVerdict struct {
	Time time.Time
	// Endpoint is the client endpoint, empty for a query sent to the
	// proxy directly (not intercepted, no DNS rule applies).
	Endpoint string
	// Client is the query's source; Resolver where it was forwarded (or
	// would have been).
	Client, Resolver netip.AddrPort
	// Protocol is "UDP" or "TCP".
	Protocol string
	// Name and Type are the question's ("www.example.com.", "A").
	Name, Type string
	// Allowed is false when no DNS rule of the endpoint allows Name: the
	// query was answered with --dns-reject-response, never forwarded.
	Allowed bool
	// Policy is the policy whose DNS rule allowed the query (or, denied,
	// empty).
	Policy string
	// Answers are the addresses the answer gave the name.
	Answers []netip.Addr
	// Unlabelled says why Answers were not labelled for every pod's FQDN
	// selectors ("untrusted resolver: for this endpoint only", "untrusted
	// resolver", "pod address limit"); empty when they were, or had no
	// need.
	Unlabelled string
	// RCode is the answer's response code ("NOERROR", "REFUSED", …).
	RCode string
	// Latency is the time from the query's arrival to the answer, hold
	// included.
	Latency time.Duration
}

// Values of --dns-reject-response.
const (
	RejectRefused  = "refused"
	RejectNXDomain = "nxdomain"
)

// Verdicts as the queries metric labels them.
const (
	verdictAllowed = "allowed"
	verdictDenied  = "denied"
)

// patterns compiles the DNS rules' patterns once each: the proxy matches
// every intercepted query against them.
type patterns struct {
	mu    sync.Mutex
	cache map[string]*pattern.Pattern
}

// allowedBy returns the rule that allows name, if any; rules whose
// pattern does not parse (the selectors cell validated them) allow
// nothing.
func (p *patterns) allowedBy(rules []tables.DNSRule, name string) (tables.DNSRule, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cache == nil {
		p.cache = map[string]*pattern.Pattern{}
	}
	for _, r := range rules {
		pat, ok := p.cache[r.Pattern]
		if !ok {
			if len(p.cache) > 4096 {
				clear(p.cache) // patterns of policies long gone
			}
			pat, _ = pattern.ParsePattern(r.Pattern)
			p.cache[r.Pattern] = pat
		}
		if pat != nil && pat.Match(name) {
			return r, true
		}
	}
	return tables.DNSRule{}, false
}

// proxyTargets returns where the datapath sends intercepted DNS for a
// proxy listening on listen (its bound address): an unspecified address
// (which Go listens on for both families) is reached on the loopback
// addresses; an IPv4 one serves IPv4 sockets and, mapped, IPv6 ones; an
// IPv6 one only IPv6 sockets.
func proxyTargets(listen net.Addr) (v4, v6 netip.AddrPort) {
	ap := addrPortOf(listen)
	if !ap.IsValid() {
		return
	}
	a, port := ap.Addr(), ap.Port()
	switch {
	case a.IsUnspecified():
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), port), netip.AddrPortFrom(netip.IPv6Loopback(), port)
	case a.Unmap().Is4():
		return netip.AddrPortFrom(a.Unmap(), port), netip.AddrPort{}
	default:
		return netip.AddrPort{}, ap
	}
}

// addrPortOf returns the address and port of a UDP or TCP address, an
// IPv4-mapped one unmapped; invalid for anything else.
func addrPortOf(a net.Addr) netip.AddrPort {
	var ap netip.AddrPort
	switch a := a.(type) {
	case *net.UDPAddr:
		ap = a.AddrPort()
	case *net.TCPAddr:
		ap = a.AddrPort()
	default:
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}
