package fqdn

import (
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/miekg/dns"
)

func mustRR(t testing.TB, s string) dns.RR {
	t.Helper()
	rr, err := dns.NewRR(s)
	if err != nil {
		t.Fatal(err)
	}
	return rr
}

func TestParseAnswer(t *testing.T) {
	req := new(dns.Msg).SetQuestion("WWW.Example.com.", dns.TypeA)
	reply := func(mod func(*dns.Msg), rrs ...string) []byte {
		m := new(dns.Msg).SetReply(req)
		for _, s := range rrs {
			m.Answer = append(m.Answer, mustRR(t, s))
		}
		if mod != nil {
			mod(m)
		}
		wire, err := m.Pack()
		if err != nil {
			t.Fatal(err)
		}
		return wire
	}
	tests := []struct {
		name    string
		wire    []byte
		maxSize int
		ips     string
		ttl     time.Duration
		drop    string
	}{
		{"addresses and min TTL", reply(nil, "www.example.com. 300 IN A 192.0.2.1", "www.example.com. 60 IN A 192.0.2.2"), 512, "[192.0.2.1 192.0.2.2]", time.Minute, ""},
		{"CNAME chain", reply(nil, "www.example.com. 30 IN CNAME a.cdn.net.", "a.cdn.net. 300 IN CNAME b.cdn.net.", "b.cdn.net. 300 IN A 192.0.2.3"), 512, "[192.0.2.3]", 30 * time.Second, ""},
		{"records of other names ignored", reply(nil, "evil.example.org. 300 IN A 192.0.2.66", "www.example.com. 300 IN A 192.0.2.1"), 512, "[192.0.2.1]", 300 * time.Second, ""},
		{"duplicates once", reply(nil, "www.example.com. 300 IN A 192.0.2.1", "www.example.com. 300 IN A 192.0.2.1"), 512, "[192.0.2.1]", 300 * time.Second, ""},
		{"NXDOMAIN", reply(func(m *dns.Msg) { m.Rcode = dns.RcodeNameError }), 512, "[]", 0, ""},
		{"not a response", reply(func(m *dns.Msg) { m.Response = false }), 512, "", 0, "malformed"},
		{"other ID", reply(func(m *dns.Msg) { m.Id++ }), 512, "", 0, "malformed"},
		{"other question", reply(func(m *dns.Msg) { m.Question[0].Name = "x.example.com." }), 512, "", 0, "malformed"},
		{"other type", reply(func(m *dns.Msg) { m.Question[0].Qtype = dns.TypeAAAA }), 512, "", 0, "malformed"},
		{"no question", reply(func(m *dns.Msg) { m.Question = nil }), 512, "", 0, "malformed"},
		{"garbage", []byte{1, 2, 3}, 512, "", 0, "malformed"},
		{"oversized", reply(nil, "www.example.com. 300 IN TXT \""+string(make([]byte, 200))+"\""), 100, "", 0, "oversized"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, a, err := parseAnswer(req, tt.wire, tt.maxSize)
			if tt.drop != "" {
				var de *dropError
				if !errors.As(err, &de) || de.reason != tt.drop || !errors.Is(err, errDrop) {
					t.Fatalf("error %v, want a %s drop", err, tt.drop)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if a.name != "www.example.com" {
				t.Errorf("name %q", a.name)
			}
			ips := fmt.Sprint(a.ips)
			if a.ips == nil {
				ips = "[]"
			}
			if ips != tt.ips || a.ttl != tt.ttl {
				t.Errorf("ips %s ttl %s, want %s %s", ips, a.ttl, tt.ips, tt.ttl)
			}
		})
	}
}

// FuzzParseAnswer feeds arbitrary upstream replies to the answer handling:
// it never panics, and what it accepts is a reply to the question whose
// addresses are valid and unique.
func FuzzParseAnswer(f *testing.F) {
	req := new(dns.Msg).SetQuestion("www.example.com.", dns.TypeA)
	ok := new(dns.Msg).SetReply(req)
	ok.Answer = append(ok.Answer, mustRR(f, "www.example.com. 30 IN CNAME a.example.net."), mustRR(f, "a.example.net. 60 IN A 192.0.2.1"))
	wire, _ := ok.Pack()
	f.Add(wire)
	f.Add([]byte{})
	f.Add(wire[:len(wire)-3])
	f.Fuzz(func(t *testing.T, wire []byte) {
		for _, size := range []int{512, dns.MaxMsgSize} {
			resp, a, err := parseAnswer(req, wire, size)
			if err != nil {
				if !errors.Is(err, errDrop) {
					t.Fatalf("error %v is not a drop", err)
				}
				continue
			}
			if resp.Id != req.Id || len(resp.Question) != 1 {
				t.Fatalf("accepted a reply to another request")
			}
			seen := map[netip.Addr]bool{}
			for _, ip := range a.ips {
				if !ip.IsValid() || seen[ip] {
					t.Fatalf("address list %v", a.ips)
				}
				seen[ip] = true
			}
		}
	})
}
