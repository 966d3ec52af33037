package policyprog

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
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
		if err := d.origins(testEndpoint).Lookup(bpf.NewDNSOriginKey(proto, ap), &o); err != nil {
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

// TestDNSOriginPerEndpoint: each endpoint with DNS rules publishes into a
// map of its own in dns_origin. Another endpoint's queries from more
// sources than a map holds, and one from the very source (address and
// port) of the pod's query to a resolver of its choosing, leave the pod's
// entry (its resolver) in place; the other endpoint's entries are in its
// own map, bounded. An endpoint with no map publishes nothing and counts a
// loss.
func TestDNSOriginPerEndpoint(t *testing.T) {
	d := newDatapath(t)
	const resolver, evil = "127.53.0.1:53", "127.53.0.2:53"
	proxy := netip.MustParseAddrPort(freePort(t, "127.0.0.1"))
	servers(t, [2]string{"udp", proxy.String()})
	cfg, err := bpf.NewDNSConfig(proxy, netip.AddrPort{}, true)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.maps.DNSConfig.Put(uint32(0), cfg); err != nil {
		t.Fatal(err)
	}
	d.endpoint(bpf.PolicyDNS)
	const otherID = 8
	other := d.origins(otherID)
	if err := d.putEndpoint(cgroupID(t, d.other), bpf.PolicyEndpointValue{EndpointID: otherID, Flags: bpf.PolicyDNS}); err != nil {
		t.Fatal(err)
	}

	victim := startChild(t, d.app)
	got := victim.do("local", "udp", resolver)
	ok, local, _ := strings.Cut(got, " ")
	if ok != "ok" {
		t.Fatalf("the pod's query: %s, want ok", got)
	}
	// The socket was not bound: the route to the proxy chose 127.0.0.1.
	source := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), netip.MustParseAddrPort(local).Port())
	key := bpf.NewDNSOriginKey(unix.IPPROTO_UDP, source)
	originOf := func(m *ebpf.Map) string {
		var o bpf.DNSOrigin
		if err := m.Lookup(key, &o); err != nil {
			return "none"
		}
		return fmt.Sprintf("%s endpoint %d", o.ResolverAddr(), o.EndpointID)
	}
	want := resolver + " endpoint 7"
	if o := originOf(d.origins(testEndpoint)); o != want {
		t.Fatalf("the pod's origin: %s, want %s", o, want)
	}

	attacker := startChild(t, d.other)
	if got := attacker.do("sources", strconv.Itoa(3*int(bpf.DNSOriginMaxEntries)), evil); got != "ok" {
		t.Fatalf("the other endpoint's flood: %s", got)
	}
	// The pod's socket is closed: the other endpoint binds its source.
	if got := attacker.do("udp", evil, source.String()); got != "ok" {
		t.Fatalf("the other endpoint's query from the pod's source: %s", got)
	}
	if o := originOf(d.origins(testEndpoint)); o != want {
		t.Errorf("the pod's origin after the other endpoint's queries: %s, want %s", o, want)
	}
	if o := originOf(other); o != evil+" endpoint 8" {
		t.Errorf("the other endpoint's origin of the same source: %s, want it in its own map", o)
	}
	n := 0
	var k bpf.DNSOriginKey
	var v bpf.DNSOrigin
	for it := other.Iterate(); it.Next(&k, &v); {
		n++
	}
	if n == 0 || n > int(bpf.DNSOriginMaxEntries) {
		t.Errorf("the other endpoint's map holds %d entries, want 1 to %d", n, bpf.DNSOriginMaxEntries)
	}

	// No map: nothing published, a loss counted.
	if err := d.maps.DNSOrigin.Delete(uint32(otherID)); err != nil {
		t.Fatal(err)
	}
	before := lostOrigins(t, d)
	if got := attacker.do("udp", evil); got != "ok" {
		t.Fatalf("a query of an endpoint without a map: %s", got)
	}
	if after := lostOrigins(t, d); after != before+1 {
		t.Errorf("dns_origin_lost: %d after %d, want one more", after, before)
	}
}

func lostOrigins(t *testing.T, d *datapath) uint64 {
	t.Helper()
	var perCPU []uint64
	if err := d.maps.DNSOriginLost.Lookup(uint32(0), &perCPU); err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, v := range perCPU {
		n += v
	}
	return n
}
