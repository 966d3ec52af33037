package fqdn_test

import (
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/miekg/dns"
)

// upstream is a small authoritative DNS server on 127.0.0.1 (UDP and TCP,
// one port) standing in for the resolver the proxy forwards to. Names are
// set with set; a few name prefixes misbehave on purpose:
//
//	timeout.*   never answered
//	servfail.*  SERVFAIL
//	garbage.*   bytes that are no DNS message
//	wrongq.*    an answer to another question
//	big.*       200 A records (oversized for a client without EDNS)
//	seq.*       one A record, a new address on every query
//
// Anything else not set is NXDOMAIN.
type upstream struct {
	addr string

	mu      sync.Mutex
	records map[string][]dns.RR // by lowercase FQDN
	queries int
}

func startUpstream(tb testing.TB) *upstream {
	tb.Helper()
	var (
		pc  net.PacketConn
		ln  net.Listener
		err error
	)
	for range 10 {
		if pc, err = net.ListenPacket("udp", "127.0.0.1:0"); err != nil {
			tb.Fatal(err)
		}
		if ln, err = net.Listen("tcp", pc.LocalAddr().String()); err == nil {
			break
		}
		pc.Close()
	}
	if err != nil {
		tb.Fatal(err)
	}
	u := &upstream{addr: pc.LocalAddr().String(), records: map[string][]dns.RR{}}
	udp := &dns.Server{PacketConn: pc, Handler: u}
	tcp := &dns.Server{Listener: ln, Handler: u}
	for _, s := range []*dns.Server{udp, tcp} {
		go s.ActivateAndServe()
	}
	tb.Cleanup(func() {
		udp.Shutdown()
		tcp.Shutdown()
	})
	return u
}

// set gives name the records (in zone file syntax without the name, e.g.
// "300 IN A 192.0.2.1"); no records removes the name.
func (u *upstream) set(tb testing.TB, name string, records ...string) {
	tb.Helper()
	if err := u.setErr(name, records...); err != nil {
		tb.Fatal(err)
	}
}

func (u *upstream) setErr(name string, records ...string) error {
	var rrs []dns.RR
	for _, r := range records {
		rr, err := dns.NewRR(dns.Fqdn(name) + " " + r)
		if err != nil {
			return err
		}
		rrs = append(rrs, rr)
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	u.records[strings.ToLower(dns.Fqdn(name))] = rrs
	return nil
}

func (u *upstream) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	u.mu.Lock()
	u.queries++
	u.mu.Unlock()
	q := req.Question[0]
	name := strings.ToLower(q.Name)
	resp := new(dns.Msg).SetReply(req)
	resp.Authoritative = true
	switch {
	case strings.HasPrefix(name, "timeout."):
		return
	case strings.HasPrefix(name, "servfail."):
		resp.Rcode = dns.RcodeServerFailure
	case strings.HasPrefix(name, "garbage."):
		// The request's ID, then nonsense: passes the ID check, fails
		// to parse.
		w.Write([]byte{byte(req.Id >> 8), byte(req.Id), 0x81, 0x80, 0, 1, 0, 9, 0xff, 0xff, 0xc0})
		return
	case strings.HasPrefix(name, "wrongq."):
		resp.Question[0].Name = "other.example."
		a, _ := dns.NewRR("other.example. 60 IN A 203.0.113.66")
		resp.Answer = append(resp.Answer, a)
	case strings.HasPrefix(name, "seq."):
		u.mu.Lock()
		n := u.queries
		u.mu.Unlock()
		a := &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 300},
			A: net.IPv4(10, byte(n>>16), byte(n>>8), byte(n))}
		resp.Answer = append(resp.Answer, a)
	case strings.HasPrefix(name, "big."):
		for i := range 200 {
			a := &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60},
				A: net.IPv4(198, 18, byte(i/250), byte(i%250+1))}
			resp.Answer = append(resp.Answer, a)
		}
	default:
		u.mu.Lock()
		rrs, ok := u.records[name]
		u.mu.Unlock()
		if !ok {
			resp.Rcode = dns.RcodeNameError
		}
		for _, rr := range rrs {
			if rr.Header().Rrtype == q.Qtype || rr.Header().Rrtype == dns.TypeCNAME {
				resp.Answer = append(resp.Answer, rr)
			}
		}
		// Follow CNAMEs inside the zone, as a resolver's answer has.
		for i := 0; i < len(resp.Answer); i++ {
			if c, ok := resp.Answer[i].(*dns.CNAME); ok {
				u.mu.Lock()
				for _, rr := range u.records[strings.ToLower(c.Target)] {
					if rr.Header().Rrtype == q.Qtype || rr.Header().Rrtype == dns.TypeCNAME {
						resp.Answer = append(resp.Answer, rr)
					}
				}
				u.mu.Unlock()
			}
		}
	}
	w.WriteMsg(resp)
}
