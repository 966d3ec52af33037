package fqdn_test

import (
	"net/netip"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/internal/testenv"
)

// BenchmarkProxyNewIP measures the latency the proxy adds to answers that
// bring a new address for a known selector (the common case of a name
// with rotating addresses): labelling, the ipcache resolution and the map
// write the answer waits for. Queries are paced at 1000/s, alternating
// through the proxy and directly to the same upstream; it reports p50 and
// p99 of both and of the difference.
func BenchmarkProxyNewIP(b *testing.B) {
	testenv.RequireRoot(b)
	up := startUpstream(b)
	a := startAgent(b, up.addr, "--tofqdns-max-ips-per-name=1000000")
	c := &dns.Client{Timeout: 5 * time.Second}
	query := func(addr, name string) time.Duration {
		start := time.Now()
		resp, _, err := c.Exchange(new(dns.Msg).SetQuestion(name, dns.TypeA), addr)
		if err != nil || len(resp.Answer) != 1 {
			b.Fatalf("query %s at %s: %v", name, addr, err)
		}
		return time.Since(start)
	}
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	var viaProxy, direct []time.Duration
	b.ResetTimer()
	for b.Loop() {
		<-tick.C
		viaProxy = append(viaProxy, query(a.proxy.Addr(), "seq.example.com."))
		direct = append(direct, query(up.addr, "seq.example.org."))
	}
	b.StopTimer()
	if a.counter(b, "apiary_fqdn_proxy_response_delay_exceeded_total") != 0 {
		b.Log("some answers exceeded --tofqdns-proxy-response-max-delay")
	}
	pct := func(d []time.Duration, p float64) float64 {
		s := slices.Clone(d)
		slices.Sort(s)
		return float64(s[int(float64(len(s)-1)*p)].Microseconds()) / 1000
	}
	b.ReportMetric(pct(viaProxy, 0.5), "proxy-p50-ms")
	b.ReportMetric(pct(viaProxy, 0.99), "proxy-p99-ms")
	b.ReportMetric(pct(direct, 0.5), "direct-p50-ms")
	b.ReportMetric(pct(direct, 0.99), "direct-p99-ms")
	b.ReportMetric(pct(viaProxy, 0.5)-pct(direct, 0.5), "added-p50-ms")
	b.ReportMetric(pct(viaProxy, 0.99)-pct(direct, 0.99), "added-p99-ms")
	b.ReportMetric(float64(a.fqdnIdentities()), "fqdn-identities")
	mfs, _ := a.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == "apiary_fqdn_proxy_hold_seconds" {
			h := mf.GetMetric()[0].GetHistogram()
			b.ReportMetric(h.GetSampleSum()/float64(h.GetSampleCount())*1000, "hold-mean-ms")
		}
	}
}

// BenchmarkName10000IPs: a name answering 10,000 distinct addresses over
// ten answers of 1,000 (a DNS message holds at most about 4,000) uses one
// identity; it reports the identities and the heap the cache, prefixes and
// ipcache rows take.
func BenchmarkName10000IPs(b *testing.B) {
	testenv.RequireRoot(b)
	for b.Loop() {
		b.StopTimer()
		up := startUpstream(b)
		a := startAgent(b, up.addr, "--tofqdns-max-ips-per-name=10000")
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		b.StartTimer()
		for i := range 10 {
			up.set(b, "s3.example.com", records(1000, 1+1000*i)...)
			if _, err := fqdn.Query(a.proxy.Addr(), "s3.example.com", dns.TypeA, true, 10*time.Second); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		runtime.GC()
		runtime.ReadMemStats(&after)
		if id, ok := a.mapIdentity(b, netip.MustParseAddr("10.0.39.16")); !ok || id == 0 {
			b.Fatal("the last address is not in the map")
		}
		b.ReportMetric(float64(a.fqdnIdentities()), "fqdn-identities")
		b.ReportMetric(float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/1e6, "heap-MB")
		b.StartTimer()
	}
}
