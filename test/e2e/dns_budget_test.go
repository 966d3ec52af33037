package e2e

import (
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Addresses of TestDNSProxySourceBudget: a pod of its own network
// namespace that floods the proxy on the node's side of its veth.
const (
	uidBudget   = "1d1d1d1d-0000-4000-8000-00000000001d"
	budgetGw4   = "10.234.0.1"
	budgetGw6   = "fd00:e5::1"
	budgetPod4  = "10.234.0.11"
	budgetPod6  = "fd00:e5::11"
	dnsFloodEnv = "E2E_DNS_FLOOD"
)

const budgetPods = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: flood, namespace: default, uid: ` + uidBudget + `, labels: {app: flood}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + budgetPod4 + `, podIPs: [{ip: ` + budgetPod4 + `}, {ip: "` + budgetPod6 + `"}]}
`

// dnsFlood sends COUNT queries for names under slow.test to PROXY from
// one UDP socket, about 5,000 a second, reads the answers, and returns
// once MIN of them were SERVFAIL (spec "PROXY COUNT MIN"), printing how
// many answers of each code came.
func dnsFlood(spec string) int {
	var proxy string
	var count, minServfail int
	if _, err := fmt.Sscan(spec, &proxy, &count, &minServfail); err != nil {
		return reportErr(fmt.Errorf("%s=%q: %w", dnsFloodEnv, spec, err))
	}
	conn, err := net.Dial("udp", proxy)
	if err != nil {
		return reportErr(err)
	}
	defer conn.Close()
	go func() {
		for i := range count {
			wire, _ := new(dns.Msg).SetQuestion(fmt.Sprintf("q%d.slow.test.", i), dns.TypeA).Pack()
			conn.Write(wire)
			if i%100 == 99 {
				time.Sleep(20 * time.Millisecond) // pacing, so no query is lost in a full socket buffer
			}
		}
	}()
	rcodes := map[string]int{}
	conn.SetReadDeadline(time.Now().Add(60 * time.Second))
	buf := make([]byte, 512)
	for rcodes["SERVFAIL"] < minServfail {
		n, err := conn.Read(buf)
		if err != nil {
			return reportErr(fmt.Errorf("after %v: %w", rcodes, err))
		}
		var r dns.Msg
		if r.Unpack(buf[:n]) == nil {
			rcodes[dns.RcodeToString[r.Rcode]]++
		}
	}
	fmt.Println(rcodes)
	return 0
}

// TestDNSProxySourceBudget: a pod asks the DNS proxy for names its
// resolver never answers, more than the proxy holds for all clients at
// once (8,192 per UDP loop); the node's own query for a name the
// resolver answers is still answered: the pod met its own budget
// (--dns-proxy-max-inflight-per-source) and got SERVFAIL alone, counted.
// Without the budget the pod's queries took every place and the node's
// query was answered SERVFAIL.
func TestDNSProxySourceBudget(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	root := testenv.Cgroup(t)
	pod := makeIfPodVia(t, root, uidBudget, "ifb", budgetGw4, budgetGw6, budgetPod4, budgetPod6)

	// The resolver answers names under ok.test and never those under
	// slow.test.
	up, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { up.Close() })
	go func() {
		buf := make([]byte, 4096)
		for {
			n, from, err := up.ReadFrom(buf)
			if err != nil {
				return
			}
			var q dns.Msg
			if q.Unpack(buf[:n]) != nil || len(q.Question) != 1 || !strings.HasSuffix(q.Question[0].Name, ".ok.test.") {
				continue
			}
			r := new(dns.Msg).SetReply(&q)
			r.Answer = append(r.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: net.ParseIP("192.0.2.1").To4()})
			wire, _ := r.Pack()
			up.WriteTo(wire, from)
		}
	}()

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), budgetPods)
	proxy := net.JoinHostPort(budgetGw4, strconv.Itoa(freePort(t)))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + budgetGw4,
		"--dns-proxy-addr=" + proxy, "--dns-upstream=" + up.LocalAddr().String(),
		// The pod's queries stay in flight for the whole test.
		"--dns-upstream-timeout=2m",
	}})
	a.waitPodInterfaces(t, map[string]string{"default/flood": pod.hostIf})
	a.waitLog(t, "DNS proxy listening")

	c := &dns.Client{Net: "udp", Timeout: 5 * time.Second}
	ask := func() (*dns.Msg, error) {
		r, _, err := c.Exchange(new(dns.Msg).SetQuestion("www.ok.test.", dns.TypeA), proxy)
		return r, err
	}
	if r, err := ask(); err != nil || r.Rcode != dns.RcodeSuccess {
		t.Fatalf("the node's query before the flood: %v %v", r, err)
	}

	// 12,000 queries: past the proxy's 8,192 places, 3,808 SERVFAIL
	// without budgets; with them, all but 512.
	out := pod.run(t, true, fmt.Sprintf("%s=%s 12000 2000", dnsFloodEnv, proxy))
	t.Logf("the pod's answers: %s", out)
	if r, err := ask(); err != nil || r.Rcode != dns.RcodeSuccess || len(r.Answer) != 1 {
		t.Fatalf("the node's query while a pod's queries wait for a silent resolver: %v %v, want the resolver's answer", r, err)
	}
	if n, err := a.labelledMetric(`apiary_fqdn_proxy_refused_total{reason="source-inflight"}`); err != nil || n < 2000 {
		t.Errorf(`apiary_fqdn_proxy_refused_total{reason="source-inflight"} = %v %v, want at least 2000`, n, err)
	}
}
