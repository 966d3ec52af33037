package e2e

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/apiary-net/apiary/internal/testenv"
)

// dnsPolicy lets app=client pods ask the resolver for names under
// allowed.test only, and connect to what those names resolve to.
const dnsPolicy = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: dns-client, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toCIDR: [%s/32]
    toPorts:
    - ports: [{port: "53", protocol: ANY}]
      rules: {dns: [{matchPattern: "*.allowed.test"}]}
  - toFQDNs: [{matchPattern: "*.allowed.test"}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`

// startResolver runs dnsmasq as a resolver on port 53 of a loopback
// address of its own (127.53.x.1: tests run in parallel) answering
// *.allowed.test with 127.53.x.2 and *.denied.test with 127.53.x.3, and
// returns the three addresses once it answers.
func startResolver(t testing.TB) (resolver, allowed, denied string) {
	t.Helper()
	_, resolver, allowed, denied = startResolverProcess(t)
	return resolver, allowed, denied
}

// startResolverProcess is startResolver, also returning dnsmasq's
// process.
func startResolverProcess(t testing.TB) (p *process, resolver, allowed, denied string) {
	t.Helper()
	bin := testenv.RequireProgram(t, "dnsmasq", "/usr/sbin")
	x := 1 + rand.IntN(250)
	resolver, allowed, denied = fmt.Sprintf("127.53.%d.1", x), fmt.Sprintf("127.53.%d.2", x), fmt.Sprintf("127.53.%d.3", x)
	p = startProcess(t, "dnsmasq", nil, bin,
		"--keep-in-foreground", "--conf-file=/dev/null", "--pid-file",
		"--no-resolv", "--no-hosts", "--listen-address="+resolver, "--bind-interfaces",
		"--port=53", "--log-queries", "--log-facility=-", "--local-ttl=300",
		"--address=/allowed.test/"+allowed, "--address=/denied.test/"+denied)
	digBin := testenv.RequireProgram(t, "dig")
	testenv.Eventually(t, waitTimeout, "dnsmasq to answer on "+resolver, func() (bool, string) {
		out, err := digIn("", digBin, resolver, "www.allowed.test", false)
		return err == nil && strings.Contains(out, allowed), out
	})
	return p, resolver, allowed, denied
}

// digIn asks resolver (port 53) for name's A records from a process in
// the cgroup dir (none: here), over UDP or TCP, and returns dig's whole
// output. dig refuses an answer from another address than the one it
// asked, so an answer shows that the resolver's address was restored.
func digIn(dir, bin, resolver, name string, tcp bool) (string, error) {
	args := []string{"@" + resolver, name, "A", "+time=20", "+tries=1"}
	if tcp {
		args = append(args, "+tcp")
	}
	if dir == "" {
		cmd := exec.Command(bin, args...)
		cmd.Env = cleanEnv()
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	return runInCgroup(dir, bin, args...)
}

// answerOf returns the status and the A records of dig's output.
func answerOf(out string) (status string, ips []string) {
	inAnswer := false
	for line := range strings.Lines(out) {
		line = strings.TrimSpace(line)
		if _, rest, ok := strings.Cut(line, "status: "); ok {
			status, _, _ = strings.Cut(rest, ",")
		}
		switch {
		case strings.HasPrefix(line, ";; ANSWER SECTION"):
			inAnswer = true
		case line == "" || strings.HasPrefix(line, ";"):
			inAnswer = false
		case inAnswer:
			if f := strings.Fields(line); len(f) == 5 && f[3] == "A" {
				ips = append(ips, f[4])
			}
		}
	}
	return status, ips
}

// dnsQueryEnv makes the test binary a helper (see runHelper) that sends
// one query, "NETWORK RESOLVER NAME", and prints where the answer came
// from as the application sees it (see dnsQueryOutcome).
const dnsQueryEnv = "E2E_DNS_QUERY"

// dnsQueryOutcome asks RESOLVER (IP:port) for NAME's A records over
// NETWORK: udp4 from an unconnected AF_INET socket (the source is
// recvfrom's), udp6 the same from an AF_INET6 socket to the resolver's
// IPv4-mapped address, tcp4 (the source is getpeername's). It returns
// "from=ADDR rcode=RCODE ips=IP,…" or the error.
func dnsQueryOutcome(q string) string {
	f := strings.Fields(q)
	if len(f) != 3 {
		return "error: want NETWORK RESOLVER NAME, got " + q
	}
	network, resolver, name := f[0], netip.MustParseAddrPort(f[1]), f[2]
	msg := new(dns.Msg).SetQuestion(dns.Fqdn(name), dns.TypeA)
	wire, err := msg.Pack()
	if err != nil {
		return "error: " + err.Error()
	}
	var from net.Addr
	var reply []byte
	switch network {
	case "udp4", "udp6":
		// "udp" is Go's dual-stack AF_INET6 socket; "udp6" would be
		// IPv6-only, which cannot reach a mapped address.
		listen := map[string]string{"udp4": "udp4", "udp6": "udp"}[network]
		pc, err := net.ListenUDP(listen, nil)
		if err != nil {
			return "error: " + err.Error()
		}
		defer pc.Close()
		to := resolver
		if network == "udp6" {
			to = netip.AddrPortFrom(netip.AddrFrom16(resolver.Addr().As16()), resolver.Port())
		}
		if _, err := pc.WriteToUDPAddrPort(wire, to); err != nil {
			return "error: " + err.Error()
		}
		pc.SetReadDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, dns.MaxMsgSize)
		n, addr, err := pc.ReadFromUDPAddrPort(buf)
		if err != nil {
			return "error: " + err.Error()
		}
		from, reply = net.UDPAddrFromAddrPort(netip.AddrPortFrom(addr.Addr().Unmap(), addr.Port())), buf[:n]
	case "tcp4":
		conn, err := net.DialTimeout(network, resolver.String(), 10*time.Second)
		if err != nil {
			return "error: " + err.Error()
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		dc := &dns.Conn{Conn: conn}
		if err := dc.WriteMsg(msg); err != nil {
			return "error: " + err.Error()
		}
		r, err := dc.ReadMsg()
		if err != nil {
			return "error: " + err.Error()
		}
		if reply, err = r.Pack(); err != nil {
			return "error: " + err.Error()
		}
		from = conn.RemoteAddr()
	default:
		return "error: unknown network " + network
	}
	var r dns.Msg
	if err := r.Unpack(reply); err != nil {
		return "error: " + err.Error()
	}
	var ips []string
	for _, rr := range r.Answer {
		if a, ok := rr.(*dns.A); ok {
			ips = append(ips, a.A.String())
		}
	}
	return fmt.Sprintf("from=%s rcode=%s ips=%s", from, dns.RcodeToString[r.Rcode], strings.Join(ips, ","))
}

// queryFrom runs dnsQueryOutcome in a process of the cgroup dir.
func queryFrom(t *testing.T, dir, network, resolver, name string) string {
	t.Helper()
	out, err := helperIn(t, dir, dnsQueryEnv+"="+network+" "+resolver+" "+name).Output()
	if err != nil {
		t.Fatalf("DNS query helper in %s: %v: %s", dir, err, out)
	}
	return strings.TrimSpace(string(out))
}

// TestDNSInterception: a pod whose policy has a DNS rule asks its own
// resolver (dnsmasq on port 53 of a loopback address) and is answered
// through the agent's DNS proxy without knowing it: a name the rule allows
// is answered (the answer seems to come from the resolver), labelled for
// its toFQDNs rule, and connecting to it then works; another name is
// REFUSED, never forwarded; both over UDP and TCP; `apiary monitor --type
// dns` shows each query with its verdict, and apiary_dns_queries_total
// counts them. Processes outside every pod, and a pod without DNS rules,
// resolve everything as before. With --dns-intercept=false the pod's DNS
// is denied, not let through unfiltered.
func TestDNSInterception(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	digBin := testenv.RequireProgram(t, "dig")
	resolver, allowedIP, deniedIP := startResolver(t)
	root := testenv.Cgroup(t)
	cgA, _, cgC := mkCgroups(t, root)
	listen(t, allowedIP+":8080", deniedIP+":8080")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(t, filepath.Join(configDir, "dns.yaml"), fmt.Sprintf(dnsPolicy, resolver))
	// The cluster DNS Service, backed by the resolver (with the socket LB).
	writeFile(t, filepath.Join(configDir, "svc.yaml"), `apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: kube-dns-1, namespace: default, labels: {kubernetes.io/service-name: kube-dns}}
addressType: IPv4
ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
endpoints: [{addresses: ["`+resolver+`"], conditions: {ready: true}}]
`)
	proxy := net.JoinHostPort("127.0.0.1", fmt.Sprint(freePort(t)))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root,
		// The upstream of queries sent to the proxy itself; intercepted
		// ones go to the resolver their client asked.
		"--dns-proxy-addr=" + proxy, "--dns-upstream=127.0.0.1:1",
		"--tofqdns-proxy-response-max-delay=15s",
		// The resolver is the cluster DNS Service's backend: its answers
		// label addresses (a resolver the node does not trust labels
		// nothing).
		"--dns-cluster-service=default/kube-dns",
	}})
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny", "default/client-c": "off off"})
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")

	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "--type", "dns", "-o", "json", "--server", "http://"+a.addr)

	ask := func(t *testing.T, dir, name string, tcp bool) (string, []string) {
		t.Helper()
		out, err := digIn(dir, digBin, resolver, name, tcp)
		if err != nil {
			t.Fatalf("dig %s (tcp=%t) in %s: %v", name, tcp, dir, err)
		}
		return answerOf(out)
	}

	// The stream is open once a query shows in it: ask until one does.
	testenv.Eventually(t, waitTimeout, "apiary monitor to show a query", func() (bool, string) {
		if status, _ := ask(t, cgA, "probe.denied.test", false); status != "REFUSED" {
			t.Fatalf("dig probe.denied.test from client-a: %s, want REFUSED", status)
		}
		return strings.Contains(mon.log.String(), "probe.denied.test."), mon.log.Tail(5)
	})

	for _, tcp := range []bool{false, true} {
		t.Run(fmt.Sprintf("tcp=%t", tcp), func(t *testing.T) {
			name := "www.allowed.test"
			if tcp {
				name = "tcp.allowed.test"
			}
			if status, ips := ask(t, cgA, name, tcp); status != "NOERROR" || !slices.Equal(ips, []string{allowedIP}) {
				t.Fatalf("dig %s from client-a: %s %v, want NOERROR [%s]", name, status, ips, allowedIP)
			}
			// No waiting: the answer was held until policy allowed it.
			if got := connectFrom(t, cgA, allowedIP+":8080", ""); got != "ok: hello from "+allowedIP+":8080" {
				t.Errorf("connect to %s after resolving %s: %s", allowedIP, name, got)
			}
			if status, ips := ask(t, cgA, "www.denied.test", tcp); status != "REFUSED" || len(ips) != 0 {
				t.Errorf("dig www.denied.test from client-a: %s %v, want REFUSED", status, ips)
			}
			if got := connectFrom(t, cgA, deniedIP+":8080", ""); got != "EPERM" {
				t.Errorf("connect to %s: %s, want EPERM", deniedIP, got)
			}
		})
	}

	// The application sees its resolver, never the proxy: recvfrom() of
	// an AF_INET and of an AF_INET6 socket, getpeername() of TCP.
	for _, network := range []string{"udp4", "udp6", "tcp4"} {
		want := "from=" + resolver + ":53 rcode=NOERROR ips=" + allowedIP
		if got := queryFrom(t, cgA, network, resolver+":53", network+".allowed.test"); got != want {
			t.Errorf("%s query from client-a: %s, want %s", network, got, want)
		}
	}

	var names []fqdnNameRow
	if err := a.showJSON("fqdn-names", &names); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range names {
		got = append(got, r.Name)
	}
	slices.Sort(got)
	if want := []string{"tcp.allowed.test", "tcp4.allowed.test", "udp4.allowed.test", "udp6.allowed.test", "www.allowed.test"}; !slices.Equal(got, want) {
		t.Errorf("fqdn-names: %v, want %v", got, want)
	}

	// Not intercepted: a process outside every pod, and a pod whose
	// policy has no DNS rule.
	for _, dir := range []string{"", cgC} {
		if status, ips := ask(t, dir, "www.denied.test", false); status != "NOERROR" || !slices.Equal(ips, []string{deniedIP}) {
			t.Errorf("dig www.denied.test from %q: %s %v, want the resolver's answer %s", dir, status, ips, deniedIP)
		}
	}

	// The monitor saw client-a's queries, each with its verdict.
	type dnsVerdict struct {
		Type, Endpoint, Src, Dst, Proto, Verdict, Policy, Reason string
		DNS                                                      struct {
			Query, QType, RCode string
			Answers             []string
		}
	}
	want := map[string]string{
		"UDP www.allowed.test.": "allowed cnp/default/dns-client NOERROR [" + allowedIP + "]",
		"TCP tcp.allowed.test.": "allowed cnp/default/dns-client NOERROR [" + allowedIP + "]",
		"UDP www.denied.test.":  "denied  REFUSED []",
		"TCP www.denied.test.":  "denied  REFUSED []",
	}
	testenv.Eventually(t, waitTimeout, "apiary monitor shows the queries", func() (bool, string) {
		seen := map[string]string{}
		for line := range strings.Lines(mon.log.String()) {
			var v dnsVerdict
			if json.Unmarshal([]byte(line), &v) != nil || v.Type != "dns" {
				continue
			}
			if v.Endpoint != "default/client-a" || v.Dst != resolver+":53" {
				t.Errorf("a DNS verdict of another endpoint or resolver: %s", line)
				continue
			}
			seen[v.Proto+" "+v.DNS.Query] = fmt.Sprintf("%s %s %s %v", v.Verdict, v.Policy, v.DNS.RCode, v.DNS.Answers)
		}
		for k, w := range want {
			if seen[k] != w {
				return false, fmt.Sprintf("got %v\nwant %v", seen, want)
			}
		}
		return true, ""
	})
	for _, series := range []string{
		`apiary_dns_queries_total{rcode="NOERROR",verdict="allowed"}`,
		`apiary_dns_queries_total{rcode="REFUSED",verdict="denied"}`,
	} {
		if n, err := a.labelledMetric(series); err != nil || n < 2 {
			t.Errorf("%s: %v %v, want at least 2", series, n, err)
		}
	}

	// A restart keeps intercepting: the first query after it is answered.
	a.restart(t)
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")
	if status, ips := ask(t, cgA, "again.allowed.test", false); status != "NOERROR" || !slices.Equal(ips, []string{allowedIP}) {
		t.Errorf("dig again.allowed.test after a restart: %s %v", status, ips)
	}

	// Interception off: the pod's DNS is denied, not let through
	// unfiltered; the others' is untouched.
	a.restart(t, "--dns-intercept=false")
	a.waitLog(t, "Started hive")
	if out, err := digIn(cgA, digBin, resolver, "www.denied.test", false); err == nil {
		if status, ips := answerOf(out); status == "NOERROR" {
			t.Errorf("with --dns-intercept=false client-a resolved www.denied.test: %v\n%s", ips, out)
		}
	}
	if status, ips := ask(t, cgC, "www.denied.test", false); status != "NOERROR" || !slices.Equal(ips, []string{deniedIP}) {
		t.Errorf("with --dns-intercept=false client-c: %s %v", status, ips)
	}

	// Through the cluster DNS Service: the socket LB sends the query to
	// the resolver, policy sends it to the proxy, which asks the
	// resolver; dig, which asked the Service, is answered by the
	// Service's address.
	a.restart(t, "--enable-socket-lb")
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")
	for _, tcp := range []bool{false, true} {
		testenv.Eventually(t, waitTimeout, fmt.Sprintf("an answer through the DNS Service (tcp=%t)", tcp), func() (bool, string) {
			out, err := digIn(cgA, digBin, "10.96.0.10", "svc.allowed.test", tcp)
			status, ips := answerOf(out)
			return err == nil && status == "NOERROR" && slices.Equal(ips, []string{allowedIP}), out
		})
		out, err := digIn(cgA, digBin, "10.96.0.10", "svc.denied.test", tcp)
		if status, _ := answerOf(out); err != nil || status != "REFUSED" {
			t.Errorf("svc.denied.test through the DNS Service (tcp=%t): %s %v\n%s", tcp, status, err, out)
		}
	}
	for _, network := range []string{"udp4", "udp6", "tcp4"} {
		want := "from=10.96.0.10:53 rcode=NOERROR ips=" + allowedIP
		if got := queryFrom(t, cgA, network, "10.96.0.10:53", "svc-"+network+".allowed.test"); got != want {
			t.Errorf("%s query to the DNS Service from client-a: %s, want %s", network, got, want)
		}
	}
}
