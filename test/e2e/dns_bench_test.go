package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

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
	Answered     int
	Errors       int
	// CPUUs is the helper's own CPU time per answered query, in µs.
	CPUUs float64
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
	res := dnsLoadResult{QPS: float64(len(latencies)) / took.Seconds(), Answered: len(latencies), Errors: errs}
	if len(latencies) > 0 {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err == nil {
			cpu := time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
			res.CPUUs = float64(cpu.Microseconds()) / float64(len(latencies))
		}
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
// with 8 queries in flight (floodRounds floods of b.N queries each,
// direct and intercepted taking turns), also of the proxy asked
// directly by a process of no pod (proxy-direct-qps: the proxy's own
// bound, without interception); and, for the floods, the CPU time per
// query of the client, dnsmasq and the agent. The name is allowed by the
// pod's DNS rule and labelled for its toFQDNs rule; after the first
// answer it brings no new address, so no answer is held (the hold is
// BenchmarkProxyNewIP's, in cells/fqdn).
//
// It runs twice: shared-cpus, where clients, dnsmasq and the agent share
// every CPU, and agent-own-cpu, where the agent runs on the last CPU and
// everything else on the others, as on a node where the agent has a core
// of its own (the direct figures change little between the two: the
// clients and dnsmasq get the same CPUs as when intercepted).
//
//	go test -run '^$' -bench DNSInterception -benchtime 5000x ./test/e2e/
func BenchmarkDNSInterception(b *testing.B) {
	b.Run("shared-cpus", func(b *testing.B) { benchDNSInterception(b, false) })
	b.Run("agent-own-cpu", func(b *testing.B) { benchDNSInterception(b, true) })
}

func benchDNSInterception(b *testing.B, pin bool) {
	testenv.RequireRoot(b)
	if pin && runtime.NumCPU() < 2 {
		b.Skip("the agent's own CPU needs at least 2")
	}
	dnsmasq, resolver, _, _ := startResolverProcess(b)
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
	if pin {
		pinAgent(b, a.pid(), dnsmasq.cmd.Process.Pid)
	}
	// Warm both paths (the first answer is held until policy allows it),
	// and check that client-a's queries are the proxy's.
	loadFrom(b, cgA, "paced", resolver, "bench.allowed.test", 10)
	loadFrom(b, cgC, "paced", resolver, "bench.allowed.test", 10)
	if n, err := a.labelledMetric(`apiary_dns_queries_total{rcode="NOERROR",verdict="allowed"}`); err != nil || n < 10 {
		b.Fatalf("client-a's queries did not go through the proxy: %v %v", n, err)
	}

	// flood runs one flood from dir and adds it to t, with the CPU time
	// the agent and dnsmasq spent meanwhile.
	flood := func(t *floodTotal, dir string) {
		agent0, resolver0 := procCPU(b, a.pid()), procCPU(b, dnsmasq.cmd.Process.Pid)
		r := loadFrom(b, dir, "flood", resolver, "bench.allowed.test", b.N)
		t.add(r, procCPU(b, a.pid())-agent0, procCPU(b, dnsmasq.cmd.Process.Pid)-resolver0)
	}

	b.ResetTimer()
	directPaced := loadFrom(b, cgC, "paced", resolver, "bench.allowed.test", b.N)
	viaPaced := loadFrom(b, cgA, "paced", resolver, "bench.allowed.test", b.N)
	// The floods alternate, in rounds whose order alternates too, so that
	// a slow spell of the machine falls on both sides rather than on
	// whichever ran then.
	var direct, via floodTotal
	for round := range floodRounds {
		if round%2 == 0 {
			flood(&direct, cgC)
			flood(&via, cgA)
		} else {
			flood(&via, cgA)
			flood(&direct, cgC)
		}
	}
	proxyFlood := loadFrom(b, root, "flood", proxy, "bench.allowed.test", b.N)
	b.ReportMetric(proxyFlood.QPS, "proxy-direct-qps")
	b.StopTimer()

	// Where the CPU goes per query in the floods: the client (the load
	// helper), dnsmasq and the agent (none of it for a pod without DNS
	// rules). On a machine whose cores all three share, the throughput
	// ratio cannot pass the ratio of these sums.
	b.ReportMetric(direct.perQuery(direct.client), "direct-client-cpu-us/q")
	b.ReportMetric(direct.perQuery(direct.resolver), "direct-resolver-cpu-us/q")
	b.ReportMetric(direct.perQuery(direct.agent), "direct-agent-cpu-us/q")
	b.ReportMetric(via.perQuery(via.client), "intercepted-client-cpu-us/q")
	b.ReportMetric(via.perQuery(via.resolver), "intercepted-resolver-cpu-us/q")
	b.ReportMetric(via.perQuery(via.agent), "intercepted-agent-cpu-us/q")

	b.ReportMetric(directPaced.P50Ms, "direct-p50-ms")
	b.ReportMetric(directPaced.P99Ms, "direct-p99-ms")
	b.ReportMetric(viaPaced.P50Ms, "intercepted-p50-ms")
	b.ReportMetric(viaPaced.P99Ms, "intercepted-p99-ms")
	b.ReportMetric(viaPaced.P50Ms-directPaced.P50Ms, "added-p50-ms")
	b.ReportMetric(viaPaced.P99Ms-directPaced.P99Ms, "added-p99-ms")
	b.ReportMetric(direct.qps(), "direct-qps")
	b.ReportMetric(via.qps(), "intercepted-qps")
	b.ReportMetric(via.qps()/direct.qps(), "qps-ratio")
	b.ReportMetric(0, "ns/op")
}

// floodRounds is how many floods of b.N queries each side of
// BenchmarkDNSInterception runs.
const floodRounds = 3

// floodTotal adds up the floods of one side of BenchmarkDNSInterception.
type floodTotal struct {
	queries                 float64
	took                    time.Duration // the floods' own time, summed
	client, agent, resolver time.Duration // CPU time
}

func (t *floodTotal) add(r dnsLoadResult, agent, resolver time.Duration) {
	n := float64(r.Answered)
	t.queries += n
	if n > 0 {
		t.took += time.Duration(n / r.QPS * float64(time.Second))
	}
	t.client += time.Duration(r.CPUUs * n * float64(time.Microsecond))
	t.agent += agent
	t.resolver += resolver
}

// qps is the answered queries per second over all the floods.
func (t *floodTotal) qps() float64 { return t.queries / t.took.Seconds() }

// perQuery is cpu per answered query, in µs.
func (t *floodTotal) perQuery(cpu time.Duration) float64 {
	return float64(cpu.Microseconds()) / t.queries
}

// pinAgent runs every thread of the agent (pid) on the last CPU, and
// those of this process (whose helpers inherit it) and of the others on
// the rest, until the benchmark ends.
func pinAgent(b *testing.B, agent int, others ...int) {
	var mine unix.CPUSet
	if err := unix.SchedGetaffinity(0, &mine); err != nil {
		b.Fatal(err)
	}
	n := runtime.NumCPU()
	var agentSet, rest unix.CPUSet
	agentSet.Set(n - 1)
	for cpu := range n - 1 {
		rest.Set(cpu)
	}
	pin := func(pid int, set *unix.CPUSet) {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			b.Fatal(err)
		}
		for _, task := range tasks {
			tid, _ := strconv.Atoi(task.Name())
			// A thread may have exited since the listing.
			if err := unix.SchedSetaffinity(tid, set); err != nil && err != unix.ESRCH {
				b.Fatalf("pin thread %d of %d: %v", tid, pid, err)
			}
		}
	}
	pin(agent, &agentSet)
	for _, pid := range append(others, os.Getpid()) {
		pin(pid, &rest)
	}
	b.Cleanup(func() { pin(os.Getpid(), &mine) })
}

// procCPU returns the CPU time process pid used so far (all its threads),
// to the kernel's clock tick (10 ms).
func procCPU(tb testing.TB, pid int) time.Duration {
	tb.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		tb.Fatal(err)
	}
	// The command name, in parentheses, may hold spaces: the fields
	// counted are those after it (utime and stime are fields 14 and 15).
	_, rest, ok := strings.Cut(string(data), ") ")
	f := strings.Fields(rest)
	if !ok || len(f) < 13 {
		tb.Fatalf("/proc/%d/stat: %q", pid, data)
	}
	var ticks int64
	for _, s := range f[11:13] {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			tb.Fatalf("/proc/%d/stat: %v", pid, err)
		}
		ticks += n
	}
	const userHZ = 100 // sysconf(_SC_CLK_TCK) on Linux
	return time.Duration(ticks) * time.Second / userHZ
}
