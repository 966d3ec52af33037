package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/apiary-net/apiary/internal/testenv"
)

// dnsLoadEnv makes the test binary a helper (see runHelper) that sends
// DNS queries, "MODE RESOLVER NAME N", and prints a dnsLoadResult: MODE
// paced sends N queries one per millisecond (1,000 per second), flood
// sends N from dnsFloodWorkers workers, each waiting for its answer. Each
// query is a new UDP socket, connected to the resolver, as the C library's
// resolver does it.
const dnsLoadEnv = "E2E_DNS_LOAD"

// dnsFloodWorkers is how many queries a flood keeps in flight.
const dnsFloodWorkers = 8

// dnsLoadResult is what a load helper measured.
type dnsLoadResult struct {
	P50Ms, P99Ms float64
	QPS          float64
	Errors       int
}

func dnsLoad(q string) int {
	f := strings.Fields(q)
	if len(f) != 4 {
		fmt.Fprintln(os.Stderr, "want MODE RESOLVER NAME N, got", q)
		return 2
	}
	mode, resolver, name := f[0], f[1], dns.Fqdn(f[2])
	n, err := strconv.Atoi(f[3])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	wire, err := new(dns.Msg).SetQuestion(name, dns.TypeA).Pack()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	one := func() (time.Duration, error) {
		start := time.Now()
		conn, err := net.Dial("udp4", resolver)
		if err != nil {
			return 0, err
		}
		defer conn.Close()
		conn.SetDeadline(start.Add(2 * time.Second))
		if _, err := conn.Write(wire); err != nil {
			return 0, err
		}
		buf := make([]byte, 512)
		m, err := conn.Read(buf)
		if err != nil {
			return 0, err
		}
		var r dns.Msg
		if err := r.Unpack(buf[:m]); err != nil || r.Rcode != dns.RcodeSuccess || len(r.Answer) == 0 {
			return 0, fmt.Errorf("answer %v: %v", r.Rcode, err)
		}
		return time.Since(start), nil
	}
	var (
		mu        sync.Mutex
		latencies []time.Duration
		errs      int
		wg        sync.WaitGroup
	)
	record := func(d time.Duration, err error) {
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			errs++
			return
		}
		latencies = append(latencies, d)
	}
	start := time.Now()
	switch mode {
	case "paced":
		tick := time.NewTicker(time.Millisecond)
		for range n {
			<-tick.C
			wg.Go(func() { record(one()) })
		}
		tick.Stop()
	case "flood":
		next := make(chan struct{}, n)
		for range n {
			next <- struct{}{}
		}
		close(next)
		for range dnsFloodWorkers {
			wg.Go(func() {
				for range next {
					record(one())
				}
			})
		}
	default:
		fmt.Fprintln(os.Stderr, "unknown mode", mode)
		return 2
	}
	wg.Wait()
	took := time.Since(start)
	slices.Sort(latencies)
	res := dnsLoadResult{QPS: float64(len(latencies)) / took.Seconds(), Errors: errs}
	if len(latencies) > 0 {
		ms := func(q float64) float64 {
			return float64(latencies[int(q*float64(len(latencies)-1))].Microseconds()) / 1000
		}
		res.P50Ms, res.P99Ms = ms(0.50), ms(0.99)
	}
	json.NewEncoder(os.Stdout).Encode(res)
	return 0
}

// loadFrom runs a load helper in the cgroup dir.
func loadFrom(b *testing.B, dir, mode, resolver, name string, n int) dnsLoadResult {
	b.Helper()
	if !strings.Contains(resolver, ":") {
		resolver += ":53"
	}
	out, err := helperIn(b, dir, fmt.Sprintf("%s=%s %s %s %d", dnsLoadEnv, mode, resolver, name, n)).Output()
	if err != nil {
		b.Fatalf("DNS load helper in %s: %v: %s", dir, err, out)
	}
	var r dnsLoadResult
	if err := json.Unmarshal(out, &r); err != nil {
		b.Fatalf("DNS load helper: %v: %s", err, out)
	}
	if r.Errors > 0 {
		b.Errorf("%s %s from %s: %d queries failed", mode, name, dir, r.Errors)
	}
	return r
}

// BenchmarkDNSInterception: what transparent interception adds to a pod's
// DNS, against the same resolver (dnsmasq on port 53 of a loopback
// address) asked directly by a pod without DNS rules, in the same run:
// latency at 1,000 queries per second (b.N queries each), and throughput
// with 8 queries in flight (b.N queries each), also of the proxy asked
// directly by a process of no pod (proxy-direct-qps: the proxy's own
// bound, without interception). The name is allowed by the
// pod's DNS rule and labelled for its toFQDNs rule; after the first
// answer it brings no new address, so no answer is held (the hold is
// BenchmarkProxyNewIP's, in cells/fqdn).
//
//	go test -run '^$' -bench DNSInterception -benchtime 5000x ./test/e2e/
func BenchmarkDNSInterception(b *testing.B) {
	testenv.RequireRoot(b)
	resolver, _, _ := startResolver(b)
	root := testenv.Cgroup(b)
	cgA, _, cgC := mkCgroups(b, root)
	configDir := b.TempDir()
	writeFile(b, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(b, filepath.Join(configDir, "dns.yaml"), fmt.Sprintf(dnsPolicy, resolver))
	proxy := net.JoinHostPort("127.0.0.1", fmt.Sprint(freePort(b)))
	a := startAgent(b, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root,
		"--dns-proxy-addr=" + proxy, "--dns-upstream=" + resolver + ":53",
	}})
	a.waitEndpointPolicy(b, map[string]string{"default/client-a": "off default-deny", "default/client-c": "off off"})
	a.waitLog(b, "Intercepting the DNS of endpoints with DNS rules")
	// Warm both paths (the first answer is held until policy allows it),
	// and check that client-a's queries are the proxy's.
	loadFrom(b, cgA, "paced", resolver, "bench.allowed.test", 10)
	loadFrom(b, cgC, "paced", resolver, "bench.allowed.test", 10)
	if n, err := a.labelledMetric(`apiary_dns_queries_total{rcode="NOERROR",verdict="allowed"}`); err != nil || n < 10 {
		b.Fatalf("client-a's queries did not go through the proxy: %v %v", n, err)
	}

	b.ResetTimer()
	directPaced := loadFrom(b, cgC, "paced", resolver, "bench.allowed.test", b.N)
	viaPaced := loadFrom(b, cgA, "paced", resolver, "bench.allowed.test", b.N)
	directFlood := loadFrom(b, cgC, "flood", resolver, "bench.allowed.test", b.N)
	viaFlood := loadFrom(b, cgA, "flood", resolver, "bench.allowed.test", b.N)
	proxyFlood := loadFrom(b, root, "flood", proxy, "bench.allowed.test", b.N)
	b.ReportMetric(proxyFlood.QPS, "proxy-direct-qps")
	b.StopTimer()

	b.ReportMetric(directPaced.P50Ms, "direct-p50-ms")
	b.ReportMetric(directPaced.P99Ms, "direct-p99-ms")
	b.ReportMetric(viaPaced.P50Ms, "intercepted-p50-ms")
	b.ReportMetric(viaPaced.P99Ms, "intercepted-p99-ms")
	b.ReportMetric(viaPaced.P50Ms-directPaced.P50Ms, "added-p50-ms")
	b.ReportMetric(viaPaced.P99Ms-directPaced.P99Ms, "added-p99-ms")
	b.ReportMetric(directFlood.QPS, "direct-qps")
	b.ReportMetric(viaFlood.QPS, "intercepted-qps")
	b.ReportMetric(viaFlood.QPS/directFlood.QPS, "qps-ratio")
	b.ReportMetric(0, "ns/op")
}
