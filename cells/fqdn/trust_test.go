package fqdn_test

import (
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/miekg/dns"

	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// chooser is an Interceptor whose client at address pod asked resolver
// (a resolver the pod chose); it keeps the verdicts.
type chooser struct {
	pod      netip.Addr
	resolver netip.AddrPort

	mu       sync.Mutex
	verdicts []fqdn.QueryVerdict
}

func (c *chooser) SetProxy(netip.AddrPort, netip.AddrPort, bool) error { return nil }
func (c *chooser) Report(v fqdn.QueryVerdict) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.verdicts = append(c.verdicts, v)
}
func (c *chooser) Origin(_ uint8, client netip.AddrPort) (fqdn.Origin, bool) {
	if client.Addr() != c.pod {
		return fqdn.Origin{}, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return fqdn.Origin{Resolver: c.resolver, Endpoint: "default/pod", Rules: []tables.DNSRule{{Pattern: "*", Policy: "p"}}}, true
}

// unlabelled returns the Unlabelled of the last verdict on name.
func (c *chooser) unlabelled(name string) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := len(c.verdicts) - 1; i >= 0; i-- {
		if c.verdicts[i].Name == name {
			return c.verdicts[i].Unlabelled, true
		}
	}
	return "", false
}

// askAs asks server for name's A records from the address src.
func askAs(t *testing.T, network, src, server, name string) *dns.Msg {
	t.Helper()
	d := &net.Dialer{Timeout: 5 * time.Second}
	if network == "tcp" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(src)}
	} else {
		d.LocalAddr = &net.UDPAddr{IP: net.ParseIP(src)}
	}
	c := &dns.Client{Net: network, Timeout: 5 * time.Second, Dialer: d}
	r, _, err := c.Exchange(new(dns.Msg).SetQuestion(name, dns.TypeA), server)
	if err != nil {
		t.Fatalf("%s query for %s from %s: %v", network, name, src, err)
	}
	return r
}

// TestUntrustedResolverLabelsTheAskerOnly: a pod asks a resolver it
// chose (not --dns-upstream, not the cluster DNS Service, not in
// --dns-trusted-resolvers) for a name a toFQDNs selector matches; the
// answer reaches the pod, and its address is labelled for that pod alone:
// no trusted fqdn-names row, but one of the pod's, whose label is
// fqdn:*.example.com@default/pod; the address's identity in the ipcache
// map carries that label and not fqdn:*.example.com, which every pod's
// rule selects. The verdict says "untrusted resolver: for this endpoint
// only", apiary_fqdn_untrusted_answers_total counts it. The same name
// from the trusted upstream is labelled for everyone; with the chosen
// resolver in --dns-trusted-resolvers its answers are too.
func TestUntrustedResolverLabelsTheAskerOnly(t *testing.T) {
	testenv.RequireRoot(t)
	trusted, chosen := startUpstream(t), startUpstream(t)
	trusted.set(t, "good.example.com", "300 IN A 192.0.2.10")
	for _, name := range []string{"evil.example.com", "evil-tcp.example.com", "later.example.com"} {
		chosen.set(t, name, "300 IN A 203.0.113.66")
	}
	c := &chooser{pod: netip.MustParseAddr("127.0.0.2"), resolver: netip.MustParseAddrPort(chosen.addr)}
	provide := []cell.Cell{cell.Provide(func() fqdn.Interceptor { return c })}
	a := startAgentWith(t, trusted.addr, provide, nil, "--tofqdns-proxy-response-max-delay=10s")

	row := func(name, endpoint string) (*tables.FQDNName, bool) {
		r, _, ok := a.names.Get(a.db.ReadTxn(), tables.FQDNNameIndex.Query(tables.FQDNKey(name, endpoint)))
		return r, ok
	}
	for _, tt := range []struct{ network, name string }{{"udp", "evil.example.com"}, {"tcp", "evil-tcp.example.com"}} {
		r := askAs(t, tt.network, "127.0.0.2", a.proxy.Addr(), tt.name+".")
		if r.Rcode != dns.RcodeSuccess || len(r.Answer) != 1 {
			t.Fatalf("%s %s from the pod's resolver: %v, want its answer", tt.network, tt.name, r)
		}
		// Labelling happens before the answer is released: by now the
		// rows are there.
		if _, ok := row(tt.name, ""); ok {
			t.Errorf("%s: the answer of a resolver the pod chose was labelled for every pod", tt.name)
		}
		if r, ok := row(tt.name, "default/pod"); !ok || !slices.Equal(r.Selectors, []string{"fqdn:*.example.com@default/pod"}) {
			t.Errorf("%s: the pod's row %+v (found %t), want selectors [fqdn:*.example.com@default/pod]", tt.name, r, ok)
		}
		// The verdict is reported once the answer is sent.
		testenv.Eventually(t, 5*time.Second, "the verdict on "+tt.name, func() (bool, string) {
			why, ok := c.unlabelled(tt.name + ".")
			return ok && why == "untrusted resolver: for this endpoint only", why
		})
	}
	id, ok := a.mapIdentity(t, netip.MustParseAddr("203.0.113.66"))
	if !ok {
		t.Fatalf("203.0.113.66 from the pod's resolver is not in the ipcache map")
	}
	ident, _, found := a.identities.Get(a.db.ReadTxn(), tables.IdentityIDIndex.Query(id))
	if !found || ident.Labels.Has("fqdn:*.example.com") || !ident.Labels.Has("fqdn:*.example.com@default/pod") {
		t.Errorf("203.0.113.66's identity %d: %v, want fqdn:*.example.com@default/pod and not fqdn:*.example.com", id, ident)
	}
	if got := a.counter(t, "apiary_fqdn_untrusted_answers_total"); got != 2 {
		t.Errorf("apiary_fqdn_untrusted_answers_total = %v, want 2", got)
	}

	// The node's upstream is trusted.
	if r := askAs(t, "udp", "127.0.0.1", a.proxy.Addr(), "good.example.com."); len(r.Answer) != 1 {
		t.Errorf("good.example.com from --dns-upstream: %v", r)
	}
	if _, ok := row("good.example.com", ""); !ok {
		t.Errorf("good.example.com from --dns-upstream: not labelled for every pod")
	}

	// Trusted by flag.
	b := startAgentWith(t, trusted.addr, provide, nil, "--tofqdns-proxy-response-max-delay=10s", "--dns-trusted-resolvers="+chosen.addr)
	askAs(t, "udp", "127.0.0.2", b.proxy.Addr(), "later.example.com.")
	if _, _, ok := b.names.Get(b.db.ReadTxn(), tables.FQDNNameIndex.Query("later.example.com")); !ok {
		t.Errorf("with --dns-trusted-resolvers=%s its answer was not labelled", chosen.addr)
	}
}

// TestMaxIPsPerPod: the addresses one pod's answers bring into the DNS
// cache are bounded by --tofqdns-max-ips-per-pod, whichever resolver
// answered and whatever the name; past it the new addresses are not
// labelled, counted in apiary_fqdn_pod_limit_refused_ips_total, and the
// verdict says so. Another pod, and the node, are not held back by it.
func TestMaxIPsPerPod(t *testing.T) {
	testenv.RequireRoot(t)
	trusted, chosen := startUpstream(t), startUpstream(t)
	trusted.set(t, "a.example.com", records(2, 0)...)
	trusted.set(t, "b.example.com", records(2, 2)...)
	trusted.set(t, "node.example.com", records(3, 10)...)
	chosen.set(t, "own.example.com", records(2, 20)...)
	// The pod asks the trusted upstream first, then a resolver of its own.
	c := &chooser{pod: netip.MustParseAddr("127.0.0.2"), resolver: netip.MustParseAddrPort(trusted.addr)}
	provide := []cell.Cell{cell.Provide(func() fqdn.Interceptor { return c })}
	a := startAgentWith(t, trusted.addr, provide, nil, "--tofqdns-proxy-response-max-delay=10s", "--tofqdns-max-ips-per-pod=3")

	count := func(name, endpoint string) int {
		r, _, ok := a.names.Get(a.db.ReadTxn(), tables.FQDNNameIndex.Query(tables.FQDNKey(name, endpoint)))
		if !ok {
			return 0
		}
		return len(r.IPs)
	}
	steps := []struct {
		what, src, name, endpoint string
		resolver                  string // the pod's; empty: unchanged
		wantIPs                   int
		wantRefused               float64
		wantUnlabelled            string
	}{
		{what: "under the bound", src: "127.0.0.2", name: "a.example.com", wantIPs: 2},
		{what: "reaching it", src: "127.0.0.2", name: "b.example.com", wantIPs: 1, wantRefused: 1, wantUnlabelled: "pod address limit"},
		{what: "the node is not a pod", src: "127.0.0.1", name: "node.example.com", wantIPs: 3, wantRefused: 1},
		{what: "untrusted answers count too", src: "127.0.0.2", name: "own.example.com", endpoint: "default/pod", resolver: chosen.addr, wantIPs: 0, wantRefused: 3, wantUnlabelled: "pod address limit"},
	}
	for _, st := range steps {
		if st.resolver != "" {
			c.mu.Lock()
			c.resolver = netip.MustParseAddrPort(st.resolver)
			c.mu.Unlock()
		}
		if r := askAs(t, "udp", st.src, a.proxy.Addr(), st.name+"."); r.Rcode != dns.RcodeSuccess || len(r.Answer) == 0 {
			t.Fatalf("%s: %s: %v, want the answer (the bound never withholds it)", st.what, st.name, r)
		}
		if got := count(st.name, st.endpoint); got != st.wantIPs {
			t.Errorf("%s: %s has %d addresses in fqdn-names, want %d", st.what, st.name, got, st.wantIPs)
		}
		if got := a.counter(t, "apiary_fqdn_pod_limit_refused_ips_total"); got != st.wantRefused {
			t.Errorf("%s: apiary_fqdn_pod_limit_refused_ips_total = %v, want %v", st.what, got, st.wantRefused)
		}
		if st.src == "127.0.0.2" {
			testenv.Eventually(t, 5*time.Second, "the verdict on "+st.name, func() (bool, string) {
				why, ok := c.unlabelled(st.name + ".")
				return ok && why == st.wantUnlabelled, why
			})
		}
	}
}
