package fqdn

import (
	"net"
	"testing"

	"github.com/apiary-net/apiary/tables"
)

func TestAllowedBy(t *testing.T) {
	rules := []tables.DNSRule{
		{Pattern: "*.example.com", Policy: "cnp/default/a"},
		{Pattern: "api.example.org", Policy: "cnp/default/b"},
	}
	for _, tc := range []struct {
		rules  []tables.DNSRule
		name   string
		policy string // "" : denied
	}{
		{rules, "www.example.com.", "cnp/default/a"},
		{rules, "WWW.Example.COM.", "cnp/default/a"},
		{rules, "a.b.example.com.", ""}, // * stays in one label
		{rules, "example.com.", ""},
		{rules, "api.example.org.", "cnp/default/b"},
		{rules, "www.example.org.", ""},
		{[]tables.DNSRule{{Pattern: "*", Policy: "p"}}, "anything.at.all.", "p"},
		{nil, "www.example.com.", ""}, // an endpoint the agent does not know
		{[]tables.DNSRule{{Pattern: "a..b", Policy: "p"}}, "a..b.", ""},
	} {
		var p patterns
		r, ok := p.allowedBy(tc.rules, tc.name)
		if ok != (tc.policy != "") || r.Policy != tc.policy {
			t.Errorf("%s against %v: allowed %t by %q, want by %q", tc.name, tc.rules, ok, r.Policy, tc.policy)
		}
	}
}

func TestProxyTargets(t *testing.T) {
	for _, tc := range []struct {
		listen net.Addr
		v4, v6 string
	}{
		{&net.UDPAddr{IP: net.IPv6zero, Port: 53}, "127.0.0.1:53", "[::1]:53"},
		{&net.UDPAddr{IP: net.IPv4zero, Port: 53}, "127.0.0.1:53", "[::1]:53"},
		{&net.UDPAddr{IP: net.ParseIP("10.0.0.1"), Port: 5353}, "10.0.0.1:5353", "invalid AddrPort"},
		{&net.UDPAddr{IP: net.ParseIP("::ffff:10.0.0.1"), Port: 5353}, "10.0.0.1:5353", "invalid AddrPort"},
		{&net.UDPAddr{IP: net.ParseIP("fd00::1"), Port: 53}, "invalid AddrPort", "[fd00::1]:53"},
		{&net.UnixAddr{Name: "x"}, "invalid AddrPort", "invalid AddrPort"},
	} {
		v4, v6 := proxyTargets(tc.listen)
		if v4.String() != tc.v4 || v6.String() != tc.v6 {
			t.Errorf("proxyTargets(%s): %s %s, want %s %s", tc.listen, v4, v6, tc.v4, tc.v6)
		}
	}
}
