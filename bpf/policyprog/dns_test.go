package policyprog

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
)

// TestDNSRedirect: DNS (port 53) of an endpoint with bpf.PolicyDNS, once
// its policy allows the resolver, reaches the proxy (dns_config) instead,
// over UDP and TCP; the client sees the answer come from the resolver it
// asked (its exchange checks that); dns_origin tells the proxy, by the
// query's source, whom the client asked. Other ports and endpoints without
// the flag are untouched; with interception off such DNS is denied
// (EPERM), reported as dns proxy unavailable; the policy still decides
// first.
func TestDNSRedirect(t *testing.T) {
	d := newDatapath(t)
	const resolver = "127.53.0.1:53"
	proxy := netip.MustParseAddrPort(freePort(t, "127.0.0.1"))
	servers(t, [2]string{"udp", proxy.String()}, [2]string{"tcp", proxy.String()})
	setConfig := func(intercept bool) {
		t.Helper()
		cfg, err := bpf.NewDNSConfig(proxy, netip.AddrPort{}, intercept)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.maps.DNSConfig.Put(uint32(0), cfg); err != nil {
			t.Fatal(err)
		}
	}
	origin := func(proto uint8, local string) string {
		t.Helper()
		ap := netip.MustParseAddrPort(local)
		// The socket was not bound to an address: the route to the
		// proxy chose 127.0.0.1.
		ap = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), ap.Port())
		var o bpf.DNSOrigin
		if err := d.maps.DNSOrigin.Lookup(bpf.NewDNSOriginKey(proto, ap), &o); err != nil {
			return "none: " + err.Error()
		}
		return fmt.Sprintf("%s endpoint %d", o.ResolverAddr(), o.EndpointID)
	}
	c := startChild(t, d.app)
	d.endpoint(bpf.PolicyEnforceEgress | bpf.PolicyDNS)
	d.rules(rule{dir: bpf.PolicyEgress, proto: unix.IPPROTO_UDP, port: 53, portBits: 16},
		rule{dir: bpf.PolicyEgress, proto: unix.IPPROTO_TCP, port: 53, portBits: 16})
	setConfig(true)

	for _, tc := range []struct {
		kind  string
		proto uint8
	}{{"udp", unix.IPPROTO_UDP}, {"udpc", unix.IPPROTO_UDP}, {"tcp", unix.IPPROTO_TCP}} {
		got := c.do("local", tc.kind, resolver)
		ok, local, _ := strings.Cut(got, " ")
		if ok != "ok" {
			t.Fatalf("%s to %s: %s, want ok (answered by the proxy as the resolver)", tc.kind, resolver, got)
		}
		if o := origin(tc.proto, local); o != resolver+" endpoint 7" {
			t.Errorf("%s: dns_origin of %s: %s, want %s endpoint 7", tc.kind, local, o, resolver)
		}
	}
	// Port 53 only: another port of the resolver is not DNS (and not
	// allowed).
	if got := c.do("udp", "127.53.0.1:54"); got != "EPERM" {
		t.Errorf("udp to port 54: %s, want EPERM", got)
	}
	// The policy decides first: a resolver it does not allow is denied.
	d.rules(rule{identity: 0, dir: bpf.PolicyEgress, proto: unix.IPPROTO_TCP, port: 53, portBits: 16, deny: true, cookie: 9})
	if got := c.do("tcp", resolver); got != "EPERM" {
		t.Errorf("tcp to a denied resolver: %s, want EPERM", got)
	}

	// Interception off: denied, not let through.
	setConfig(false)
	if got := c.do("udp", resolver); got != "EPERM" {
		t.Errorf("udp with interception off: %s, want EPERM", got)
	}
	// Its event follows those of the exchanges above.
	for i := 0; ; i++ {
		ev := d.nextEvent()
		if ev.Reason == bpf.PolicyReasonDNSProxy {
			if ev.Verdict != bpf.PolicyVerdictDenied || ev.Remote().String() != resolver {
				t.Errorf("event of the denied query: %s, want denied to %s", fmtEvent(ev), resolver)
			}
			break
		}
		if i == 20 {
			t.Fatalf("no event with reason dns proxy unavailable; last %s", fmtEvent(ev))
		}
	}

	// Without the flag: untouched (nothing listens at the resolver).
	setConfig(true)
	d.endpoint(bpf.PolicyEnforceEgress)
	if got := c.do("udp", resolver); got == "ok" {
		t.Errorf("udp from an endpoint without DNS rules: %s, want it to reach the resolver (nobody there)", got)
	}
}
