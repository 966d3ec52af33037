package fqdn_test

import (
	"net"
	"net/netip"
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

// TestUntrustedResolverLabelsNothing: a pod asks a resolver it chose (not
// --dns-upstream, not the cluster DNS Service, not in
// --dns-trusted-resolvers) for a name a toFQDNs selector matches; the
// answer reaches the pod, but its address is labelled for nobody: no
// fqdn-names row, not in the ipcache map, the verdict says "untrusted
// resolver", apiary_fqdn_untrusted_answers_total counts it. The same
// name from the trusted upstream is labelled; with the chosen resolver
// in --dns-trusted-resolvers its answers label too. Without the rule the
// pod's resolver labelled 203.0.113.66 for every pod's *.example.com.
func TestUntrustedResolverLabelsNothing(t *testing.T) {
	testenv.RequireRoot(t)
	trusted, chosen := startUpstream(t), startUpstream(t)
	trusted.set(t, "good.example.com", "300 IN A 192.0.2.10")
	for _, name := range []string{"evil.example.com", "evil-tcp.example.com", "later.example.com"} {
		chosen.set(t, name, "300 IN A 203.0.113.66")
	}
	c := &chooser{pod: netip.MustParseAddr("127.0.0.2"), resolver: netip.MustParseAddrPort(chosen.addr)}
	provide := []cell.Cell{cell.Provide(func() fqdn.Interceptor { return c })}
	a := startAgentWith(t, trusted.addr, provide, nil, "--tofqdns-proxy-response-max-delay=10s")

	row := func(name string) bool {
		_, _, ok := a.names.Get(a.db.ReadTxn(), tables.FQDNNameIndex.Query(name))
		return ok
	}
	for _, tt := range []struct{ network, name string }{{"udp", "evil.example.com"}, {"tcp", "evil-tcp.example.com"}} {
		r := askAs(t, tt.network, "127.0.0.2", a.proxy.Addr(), tt.name+".")
		if r.Rcode != dns.RcodeSuccess || len(r.Answer) != 1 {
			t.Fatalf("%s %s from the pod's resolver: %v, want its answer", tt.network, tt.name, r)
		}
		// Labelling happens before the answer is released: by now a row
		// would be there.
		if row(tt.name) {
			t.Errorf("%s: the answer of a resolver the pod chose was labelled (fqdn-names has it)", tt.name)
		}
		// The verdict is reported once the answer is sent.
		testenv.Eventually(t, 5*time.Second, "the verdict on "+tt.name, func() (bool, string) {
			why, ok := c.unlabelled(tt.name + ".")
			return ok && why == "untrusted resolver", why
		})
	}
	if _, ok := a.mapIdentity(t, netip.MustParseAddr("203.0.113.66")); ok {
		t.Errorf("203.0.113.66 from the pod's resolver is in the ipcache map")
	}
	if got := a.counter(t, "apiary_fqdn_untrusted_answers_total"); got != 2 {
		t.Errorf("apiary_fqdn_untrusted_answers_total = %v, want 2", got)
	}

	// The node's upstream is trusted.
	if r := askAs(t, "udp", "127.0.0.1", a.proxy.Addr(), "good.example.com."); len(r.Answer) != 1 || !row("good.example.com") {
		t.Errorf("good.example.com from --dns-upstream: %v, labelled %t; want labelled", r, row("good.example.com"))
	}

	// Trusted by flag.
	b := startAgentWith(t, trusted.addr, provide, nil, "--tofqdns-proxy-response-max-delay=10s", "--dns-trusted-resolvers="+chosen.addr)
	askAs(t, "udp", "127.0.0.2", b.proxy.Addr(), "later.example.com.")
	if _, _, ok := b.names.Get(b.db.ReadTxn(), tables.FQDNNameIndex.Query("later.example.com")); !ok {
		t.Errorf("with --dns-trusted-resolvers=%s its answer was not labelled", chosen.addr)
	}
}
