package fqdn

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// fakeResolver answers each datagram on a loopback UDP socket as answer
// says (nil: no answer), and reports where each query came from.
func fakeResolver(t testing.TB, network, addr string, answer func(q *dns.Msg) []*dns.Msg) (netip.AddrPort, <-chan netip.AddrPort) {
	t.Helper()
	pc, err := net.ListenPacket(network, addr)
	if err != nil {
		testenv.Skip(t, fmt.Sprintf("listen on %s %s: %v", network, addr, err))
	}
	t.Cleanup(func() { pc.Close() })
	from := make(chan netip.AddrPort, 1024)
	go func() {
		buf := make([]byte, 512)
		for {
			n, src, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			select {
			case from <- src.(*net.UDPAddr).AddrPort():
			default:
			}
			var q dns.Msg
			if q.Unpack(buf[:n]) != nil {
				continue
			}
			for _, r := range answer(&q) {
				wire, _ := r.Pack()
				pc.WriteTo(wire, src)
			}
		}
	}()
	return pc.LocalAddr().(*net.UDPAddr).AddrPort(), from
}

// reply is q answered with one TXT record holding text, under ID id.
func reply(q *dns.Msg, id uint16, text string) *dns.Msg {
	r := new(dns.Msg).SetReply(q)
	r.Id = id
	r.Answer = append(r.Answer, &dns.TXT{Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeTXT, Class: dns.ClassINET, Ttl: 60}, Txt: []string{text}})
	return r
}

// startUDPProxy starts a proxy on listen (UDP and TCP) forwarding to
// upstream, with no policy and no names to label; adjust changes its
// configuration first.
func startUDPProxy(t testing.TB, listen string, upstream netip.AddrPort, adjust ...func(*Config)) *Proxy {
	t.Helper()
	p := newTestProxy(t, listen, upstream)
	for _, f := range adjust {
		f(&p.cfg)
	}
	startProxy(t, p)
	return p
}

// newTestProxy is a proxy on listen forwarding to upstream, not started.
func newTestProxy(t testing.TB, listen string, upstream netip.AddrPort) *Proxy {
	t.Helper()
	m, err := newFQDNMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return &Proxy{log: hivetest.Logger(t), metrics: m, now: time.Now, cfg: Config{
		DNSProxyAddr: listen, DNSUpstream: upstream.String(),
		DNSUpstreamTimeout: 300 * time.Millisecond, ToFQDNsProxyResponseMaxDelay: 100 * time.Millisecond,
		DNSProxyMaxInflightPerSource: defaultConfig.DNSProxyMaxInflightPerSource,
		DNSProxyMaxTCPPerSource:      defaultConfig.DNSProxyMaxTCPPerSource,
	}}
}

// startProxy starts p and stops it when the test ends.
func startProxy(t testing.TB, p *Proxy) {
	t.Helper()
	listen := p.cfg.DNSProxyAddr
	if err := p.start(); err != nil {
		// Without IPv6 on this machine, the tests on ::1 cannot run;
		// under APIARY_STRICT=1, as any other failure to start, this
		// fails.
		testenv.Skip(t, fmt.Sprintf("start the proxy on %s: %v", listen, err))
	}
	t.Cleanup(func() {
		if err := p.stop(context.Background()); err != nil {
			t.Error(err)
		}
	})
}

// ask sends a TXT query for name from a socket connected to server and
// returns the answer.
func ask(t testing.TB, server string, name string) (*dns.Msg, error) {
	t.Helper()
	c := &dns.Client{Net: "udp", Timeout: 2 * time.Second}
	r, _, err := c.Exchange(new(dns.Msg).SetQuestion(name, dns.TypeTXT), server)
	return r, err
}

func txt(r *dns.Msg) string {
	if r == nil || len(r.Answer) != 1 {
		return fmt.Sprint(r)
	}
	if t, ok := r.Answer[0].(*dns.TXT); ok && len(t.Txt) == 1 {
		return t.Txt[0]
	}
	return r.Answer[0].String()
}

func TestUDPServer(t *testing.T) {
	tests := []struct {
		name    string
		network string
		addr    string
		answer  func(q *dns.Msg) []*dns.Msg
		rcode   int
		want    string // the TXT of the answer taken
		mapped  bool   // the upstream's IPv4 address given mapped to IPv6
	}{
		{"reply", "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg { return []*dns.Msg{reply(q, q.Id, "a")} }, dns.RcodeSuccess, "a", false},
		{"IPv6 upstream", "udp6", "[::1]:0", func(q *dns.Msg) []*dns.Msg { return []*dns.Msg{reply(q, q.Id, "a")} }, dns.RcodeSuccess, "a", false},
		{"IPv4-mapped upstream", "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg { return []*dns.Msg{reply(q, q.Id, "a")} }, dns.RcodeSuccess, "a", true},
		{"another ID first", "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg {
			return []*dns.Msg{reply(q, q.Id+1, "x"), reply(q, q.Id, "a")}
		}, dns.RcodeSuccess, "a", false},
		{"no reply", "udp4", "127.0.0.1:0", func(*dns.Msg) []*dns.Msg { return nil }, dns.RcodeServerFailure, "", false},
		{"only other IDs", "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg { return []*dns.Msg{reply(q, q.Id+1, "x")} }, dns.RcodeServerFailure, "", false},
		{"answer to another question", "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg {
			r := reply(q, q.Id, "x")
			r.Question[0].Name = "other.test."
			return []*dns.Msg{r}
		}, dns.RcodeServerFailure, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up, _ := fakeResolver(t, tt.network, tt.addr, tt.answer)
			if tt.mapped {
				up = netip.AddrPortFrom(netip.AddrFrom16(up.Addr().As16()), up.Port())
			}
			p := startUDPProxy(t, "127.0.0.1:0", up)
			r, err := ask(t, p.Addr(), "www.example.test.")
			if err != nil {
				t.Fatal(err)
			}
			if r.Rcode != tt.rcode {
				t.Fatalf("rcode %s, want %s: %v", dns.RcodeToString[r.Rcode], dns.RcodeToString[tt.rcode], r)
			}
			if tt.want != "" && txt(r) != tt.want {
				t.Fatalf("got %s, want the reply %q", txt(r), tt.want)
			}
		})
	}
}

// A closed port upstream is SERVFAIL at once (the connected socket hears
// the ICMP error), not after the timeout.
func TestUDPServerUpstreamRefused(t *testing.T) {
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	up := pc.LocalAddr().(*net.UDPAddr).AddrPort()
	pc.Close()
	p := startUDPProxy(t, "127.0.0.1:0", up, func(c *Config) { c.DNSUpstreamTimeout = time.Minute })
	r, err := ask(t, p.Addr(), "www.example.test.")
	if err != nil {
		t.Fatal(err)
	}
	if r.Rcode != dns.RcodeServerFailure {
		t.Fatalf("got %v, want SERVFAIL", r)
	}
}

// Queries leave under IDs the proxy picks at random, from sockets that
// each carry at most socketQueries of them: the source port, the kernel's
// random pick, changes at least that often.
func TestUDPServerSourcePortsAndIDs(t *testing.T) {
	ids := make(chan uint16, 1024)
	up, from := fakeResolver(t, "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg {
		ids <- q.Id
		return []*dns.Msg{reply(q, q.Id, "a")}
	})
	p := startUDPProxy(t, "127.0.0.1:0", up)
	perPort := map[uint16]int{}
	sameID := 0
	const n = 3*socketQueries + 1
	for range n {
		q := new(dns.Msg).SetQuestion("www.example.test.", dns.TypeTXT)
		r, err := dns.Exchange(q, p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		if r.Id != q.Id {
			t.Fatalf("answer ID %d, want the query's %d", r.Id, q.Id)
		}
		perPort[(<-from).Port()]++
		if <-ids == q.Id {
			sameID++
		}
	}
	if len(perPort) < 4 {
		t.Errorf("%d queries left from ports %v, want at least 4", n, perPort)
	}
	for port, count := range perPort {
		if count > socketQueries {
			t.Errorf("port %d carried %d queries, more than %d", port, count, socketQueries)
		}
	}
	if sameID > 3 {
		t.Errorf("%d of %d queries went out under the client's ID, want the proxy's own", sameID, n)
	}
}

// Bound to an unspecified address, the proxy answers from the address
// each query came to: a client connected to another of the host's
// addresses takes no answer from elsewhere.
func TestUDPServerReplySource(t *testing.T) {
	up, _ := fakeResolver(t, "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg { return []*dns.Msg{reply(q, q.Id, "a")} })
	for _, tt := range []struct{ listen, ask string }{
		{"0.0.0.0:0", "127.0.0.2"},
		{"[::]:0", "127.0.0.3"},
		{"[::]:0", "::1"},
		{":0", "127.0.0.4"},
	} {
		t.Run(tt.listen+" asked on "+tt.ask, func(t *testing.T) {
			p := startUDPProxy(t, tt.listen, up)
			_, port, _ := net.SplitHostPort(p.Addr())
			r, err := ask(t, net.JoinHostPort(tt.ask, port), "www.example.test.")
			if err != nil {
				t.Fatal(err)
			}
			if txt(r) != "a" {
				t.Fatalf("got %v", r)
			}
		})
	}
}

// Queries that are no DNS message are FORMERR, with their ID.
func TestUDPServerMalformed(t *testing.T) {
	up, _ := fakeResolver(t, "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg { return []*dns.Msg{reply(q, q.Id, "a")} })
	p := startUDPProxy(t, "127.0.0.1:0", up)
	two := new(dns.Msg).SetQuestion("a.test.", dns.TypeA)
	two.Id = 0x4242
	two.Question = append(two.Question, two.Question[0])
	twoWire, err := two.Pack()
	if err != nil {
		t.Fatal(err)
	}
	for name, query := range map[string][]byte{
		"garbage":         {0x42, 0x42, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 0xff, 0xff},
		"two questions":   twoWire,
		"no question yet": {0x42, 0x42, 0x01, 0x00, 0, 0, 0, 0, 0, 0, 0, 0},
	} {
		t.Run(name, func(t *testing.T) {
			conn, err := net.Dial("udp", p.Addr())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(2 * time.Second))
			if _, err := conn.Write(query); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 512)
			n, err := conn.Read(buf)
			if err != nil {
				t.Fatal(err)
			}
			var r dns.Msg
			if err := r.Unpack(buf[:n]); err != nil {
				t.Fatal(err)
			}
			if r.Id != 0x4242 || !r.Response || r.Rcode != dns.RcodeFormatError {
				t.Fatalf("got %v, want FORMERR with ID 0x4242", &r)
			}
		})
	}
}

// Many clients at once: every query gets its own answer (batches of
// reads and writes keep each reply with its client), with one loop or
// several sharing the port.
func TestUDPServerConcurrent(t *testing.T) {
	up, _ := fakeResolver(t, "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg {
		return []*dns.Msg{reply(q, q.Id, q.Question[0].Name)}
	})
	for _, loops := range []int{1, 4} {
		t.Run(fmt.Sprintf("loops=%d", loops), func(t *testing.T) {
			p := startUDPProxy(t, "127.0.0.1:0", up, func(c *Config) { c.DNSProxyUDPLoops = loops })
			if len(p.udp) != loops {
				t.Fatalf("%d loops, want %d", len(p.udp), loops)
			}
			var wg sync.WaitGroup
			for i := range 200 {
				wg.Go(func() {
					name := fmt.Sprintf("q%d.example.test.", i)
					r, err := ask(t, p.Addr(), name)
					if err != nil {
						t.Error(err)
						return
					}
					if txt(r) != name {
						t.Errorf("%s answered %s", name, txt(r))
					}
				})
			}
			wg.Wait()
		})
	}
}

// BenchmarkUDPServer: queries through the proxy's UDP server to a
// resolver on loopback (an in-test one), 8 in flight. cpu-us/op is the
// process's CPU time (clients, proxy and resolver) per query.
//
//	go test -run '^$' -bench UDPServer -benchtime 20000x ./cells/fqdn/
func BenchmarkUDPServer(b *testing.B) {
	up, from := fakeResolver(b, "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg { return []*dns.Msg{reply(q, q.Id, "a")} })
	go func() {
		for range from {
		}
	}()
	p := startUDPProxy(b, "127.0.0.1:0", up)
	before := cpuTime(b)
	b.SetParallelism(4) // 8 clients on 2 CPUs
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := ask(b, p.Addr(), "www.example.test."); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64((cpuTime(b)-before).Microseconds())/float64(b.N), "cpu-us/op")
}

// cpuTime returns the CPU time the process used so far.
func cpuTime(tb testing.TB) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// A socket never sends two queries under the same ID, even once the first
// is given up on: a late reply to it cannot pass for the reply to the
// second.
func TestUpstreamSocketIDsNotReused(t *testing.T) {
	up, _ := fakeResolver(t, "udp4", "127.0.0.1:0", func(*dns.Msg) []*dns.Msg { return nil })
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(epfd)
	u := newUpstreams(epfd)
	defer u.closeAll()
	query, err := new(dns.Msg).SetQuestion("www.example.test.", dns.TypeA).Pack()
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	ids := map[*upstreamSocket]map[uint16]bool{}
	for range 200 * socketQueries {
		q := &udpQuery{req: new(dns.Msg)}
		if err := u.send(q, up, query, now); err != nil {
			t.Fatal(err)
		}
		if ids[q.sock] == nil {
			ids[q.sock] = map[uint16]bool{}
		}
		if ids[q.sock][q.id] {
			t.Fatalf("ID %d sent twice on one socket", q.id)
		}
		ids[q.sock][q.id] = true
		u.forget(q) // given up on
	}
	if len(ids) != 200 {
		t.Fatalf("%d sockets for %d queries, want one per %d", len(ids), 200*socketQueries, socketQueries)
	}
}

// fakeInterceptor sends each client address's queries to the resolver
// resolvers names, with every name allowed.
type fakeInterceptor struct{ resolvers map[netip.Addr]netip.AddrPort }

func (f fakeInterceptor) SetProxy(netip.AddrPort, netip.AddrPort, bool) error { return nil }
func (f fakeInterceptor) Report(QueryVerdict)                                 {}
func (f fakeInterceptor) Origin(_ uint8, client netip.AddrPort) (Origin, bool) {
	r, ok := f.resolvers[client.Addr()]
	return Origin{Resolver: r, Endpoint: "default/" + client.Addr().String(), Rules: []tables.DNSRule{{Pattern: "*", Policy: "p"}}}, ok
}

// askFrom sends a TXT query for name from local (a loopback address) to
// server over network ("udp" or "tcp") and returns the answer.
func askFrom(t testing.TB, network, local, server, name string) (*dns.Msg, error) {
	t.Helper()
	d := &net.Dialer{Timeout: 2 * time.Second}
	if network == "tcp" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(local)}
	} else {
		d.LocalAddr = &net.UDPAddr{IP: net.ParseIP(local)}
	}
	c := &dns.Client{Net: network, Timeout: 2 * time.Second, Dialer: d}
	r, _, err := c.Exchange(new(dns.Msg).SetQuestion(name, dns.TypeTXT), server)
	return r, err
}

// TestUDPServerSourceBudget: one client's queries to a resolver that
// never answers fill its own budget of queries in flight, not the
// proxy's: past it that client is answered SERVFAIL (counted), and
// another client, asking a resolver that answers, still is answered.
// Without the budget the first client's queries take every place and the
// other's query is answered SERVFAIL.
func TestUDPServerSourceBudget(t *testing.T) {
	silent, _ := fakeResolver(t, "udp4", "127.0.0.1:0", func(*dns.Msg) []*dns.Msg { return nil })
	good, _ := fakeResolver(t, "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg { return []*dns.Msg{reply(q, q.Id, "a")} })
	const global, perSource, flood = 64, 16, 100
	attacker, victim := netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.3")
	p := newTestProxy(t, "127.0.0.1:0", silent)
	p.udpMaxInflight, p.cfg.DNSProxyMaxInflightPerSource, p.cfg.DNSUpstreamTimeout = global, perSource, time.Minute
	p.intercept = fakeInterceptor{map[netip.Addr]netip.AddrPort{attacker: silent, victim: good}}
	startProxy(t, p)
	m := p.metrics

	// The attacker sends flood queries and reads the SERVFAILs: once it
	// has flood-global of them, the proxy has read all of its queries.
	conn, err := net.DialUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(attacker, 0)), net.UDPAddrFromAddrPort(addrPortOf(p.listenAddr())))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for i := range flood {
		q := new(dns.Msg).SetQuestion(fmt.Sprintf("q%d.flood.test.", i), dns.TypeTXT)
		wire, _ := q.Pack()
		if _, err := conn.Write(wire); err != nil {
			t.Fatal(err)
		}
	}
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 512)
	servfails := 0
	for servfails < flood-global {
		n, err := conn.Read(buf)
		if err != nil {
			t.Fatalf("after %d SERVFAILs to the flooding client: %v", servfails, err)
		}
		var r dns.Msg
		if r.Unpack(buf[:n]) == nil && r.Rcode == dns.RcodeServerFailure {
			servfails++
		}
	}
	r, err := askFrom(t, "udp", victim.String(), p.Addr(), "www.example.test.")
	if err != nil || r.Rcode != dns.RcodeSuccess || txt(r) != "a" {
		t.Fatalf("another client's query while one floods a silent resolver: %v %v, want the answer", r, err)
	}
	if got := counterValue(t, m.refused.WithLabelValues(refusedSourceBudget)); got < flood-global {
		t.Errorf("refused{%s} = %v, want at least %d", refusedSourceBudget, got, flood-global)
	}
}

// TestProxyServesOnlyLocalSources: the proxy answers this node's pods and
// the node; a query from any other source (another node's pod) is
// REFUSED, over UDP and TCP, never forwarded, and counted.
func TestProxyServesOnlyLocalSources(t *testing.T) {
	up, from := fakeResolver(t, "udp4", "127.0.0.1:0", func(q *dns.Msg) []*dns.Msg { return []*dns.Msg{reply(q, q.Id, "a")} })
	db := statedb.New()
	pods, err := tables.NewEndpointsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	wtxn := db.WriteTxn(pods)
	pods.Insert(wtxn, &tables.Endpoint{Name: "default/pod", IPs: []netip.Addr{netip.MustParseAddr("127.0.0.3")}})
	wtxn.Commit()
	p := newTestProxy(t, "127.0.0.1:0", up)
	// Served: the node (its address 127.0.0.1) and the pod (127.0.0.3);
	// 127.0.0.2 stands for another node's pod.
	p.sources = &sources{db: db, pods: pods, nodeAddrs: func() ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil
	}}
	startProxy(t, p)
	for _, network := range []string{"udp", "tcp"} {
		for _, tt := range []struct {
			src   string
			rcode int
		}{{"127.0.0.1", dns.RcodeSuccess}, {"127.0.0.3", dns.RcodeSuccess}, {"127.0.0.2", dns.RcodeRefused}} {
			r, err := askFrom(t, network, tt.src, p.Addr(), "www.example.test.")
			if network == "tcp" && err == nil && tt.rcode == dns.RcodeSuccess && r.Rcode == dns.RcodeServerFailure {
				continue // served: forwarded to the resolver, which has no TCP
			}
			if err != nil || r.Rcode != tt.rcode {
				t.Errorf("%s query from %s: %v %v, want %s", network, tt.src, r, err, dns.RcodeToString[tt.rcode])
			}
		}
	}
	for len(from) > 0 {
		if src := <-from; src.Addr() != netip.MustParseAddr("127.0.0.1") {
			t.Errorf("a query reached the resolver from %s", src)
		}
	}
	if got := counterValue(t, p.metrics.refused.WithLabelValues(refusedUnknownSource)); got != 2 {
		t.Errorf("refused{%s} = %v, want 2", refusedUnknownSource, got)
	}
}

// TestProxyTCPConnectionBudget: a client holding
// --dns-proxy-max-tcp-per-source connections open gets no more (the new
// one is closed at once, counted); another client still gets its answer.
func TestProxyTCPConnectionBudget(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	up := &dns.Server{Listener: ln, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) { w.WriteMsg(reply(q, q.Id, "a")) })}
	go up.ActivateAndServe()
	t.Cleanup(func() { up.Shutdown() })
	p := startUDPProxy(t, "127.0.0.1:0", addrPortOf(ln.Addr()), func(c *Config) { c.DNSProxyMaxTCPPerSource = 3 })
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
	for range 3 {
		c, err := d.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	if r, err := askFrom(t, "tcp", "127.0.0.2", p.Addr(), "www.example.test."); err == nil {
		t.Errorf("a fourth connection of one client was served: %v", r)
	}
	if r, err := askFrom(t, "tcp", "127.0.0.3", p.Addr(), "www.example.test."); err != nil || r.Rcode != dns.RcodeSuccess {
		t.Errorf("another client's TCP query: %v %v, want an answer", r, err)
	}
	if got := counterValue(t, p.metrics.refused.WithLabelValues(refusedTCPConns)); got != 1 {
		t.Errorf("refused{%s} = %v, want 1", refusedTCPConns, got)
	}
	held[0].Close()
	testenv.Eventually(t, 5*time.Second, "a connection again once one is closed", func() (bool, string) {
		r, err := askFrom(t, "tcp", "127.0.0.2", p.Addr(), "www.example.test.")
		return err == nil && r.Rcode == dns.RcodeSuccess, fmt.Sprint(r, err)
	})
}

// counterValue returns c's value.
func counterValue(t testing.TB, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// TestUpstreamQueryRebuilt: what reaches the resolver is the query
// rebuilt from the question the proxy checked, over UDP and TCP: the
// client's EDNS options (client subnet, cookie), its additional records
// and the bytes after its message are not forwarded; its EDNS UDP size,
// DO, RD and CD bits are.
func TestUpstreamQueryRebuilt(t *testing.T) {
	got := make(chan []byte, 4)
	answer := func(b []byte) []byte {
		got <- bytes.Clone(b)
		var q dns.Msg
		if q.Unpack(b) != nil {
			return nil
		}
		r, _ := reply(&q, q.Id, "a").Pack()
		return r
	}
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	ln, err := net.Listen("tcp", pc.LocalAddr().String())
	if err != nil {
		testenv.Skip(t, fmt.Sprintf("listen on tcp %s: %v", pc.LocalAddr(), err))
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		buf := make([]byte, 4096)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(answer(buf[:n]), from)
		}
	}()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			var n [2]byte
			if _, err := io.ReadFull(c, n[:]); err == nil {
				b := make([]byte, int(n[0])<<8|int(n[1]))
				if _, err := io.ReadFull(c, b); err == nil {
					r := answer(b)
					c.Write(append([]byte{byte(len(r) >> 8), byte(len(r))}, r...))
				}
			}
			c.Close()
		}
	}()
	p := startUDPProxy(t, "127.0.0.1:0", addrPortOf(pc.LocalAddr()))

	q := new(dns.Msg).SetQuestion("www.example.test.", dns.TypeTXT)
	q.CheckingDisabled = true
	q.SetEdns0(1400, true)
	opt := q.IsEdns0()
	opt.Option = append(opt.Option,
		&dns.EDNS0_SUBNET{Code: dns.EDNS0SUBNET, Family: 1, SourceNetmask: 24, Address: net.ParseIP("192.0.2.0").To4()},
		&dns.EDNS0_COOKIE{Code: dns.EDNS0COOKIE, Cookie: "0102030405060708"})
	q.Extra = append(q.Extra, &dns.A{Hdr: dns.RR_Header{Name: "extra.test.", Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: net.ParseIP("192.0.2.9")})
	wire, err := q.Pack()
	if err != nil {
		t.Fatal(err)
	}
	wire = append(wire, "trailing bytes"...)
	for _, network := range []string{"udp", "tcp"} {
		conn, err := net.Dial(network, p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		msg := wire
		if network == "tcp" {
			msg = append([]byte{byte(len(wire) >> 8), byte(len(wire))}, wire...)
		}
		if _, err := conn.Write(msg); err != nil {
			t.Fatal(err)
		}
		var sent []byte
		select {
		case sent = <-got:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the resolver got no query", network)
		}
		conn.Close()
		var m dns.Msg
		if err := m.Unpack(sent); err != nil {
			t.Fatalf("%s: the resolver got %x: %v", network, sent, err)
		}
		again, _ := m.Pack()
		o := m.IsEdns0()
		switch {
		case len(again) != len(sent):
			t.Errorf("%s: the resolver got %d bytes, a message of %d: trailing bytes forwarded", network, len(sent), len(again))
		case len(m.Question) != 1 || m.Question[0] != q.Question[0]:
			t.Errorf("%s: question %v, want %v", network, m.Question, q.Question)
		case len(m.Extra) != 1 || o == nil:
			t.Errorf("%s: additional records %v, want only the OPT record", network, m.Extra)
		case len(o.Option) != 0:
			t.Errorf("%s: EDNS options %v forwarded, want none", network, o.Option)
		case o.UDPSize() != 1400 || !o.Do() || !m.RecursionDesired || !m.CheckingDisabled:
			t.Errorf("%s: UDP size %d DO %t RD %t CD %t, want the client's 1400 true true true", network, o.UDPSize(), o.Do(), m.RecursionDesired, m.CheckingDisabled)
		}
	}
}
