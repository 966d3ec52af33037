package selectors_test

import (
	"fmt"
	"testing"
	"time"
)

// BenchmarkCIDRPolicy times a CiliumNetworkPolicy whose egress names n
// CIDRs (mixed /16–/32, some nested in others), from its creation in the
// fake clientset until every CIDR selector selects its identity and the
// ipcache map holds every prefix (add), and from its deletion until no
// selector, policy prefix, ipcache entry or local identity is left and the
// map entries are gone (remove). Then it adds the policy again (untimed)
// and times an update that drops half its CIDRs, until only the other half
// is left (shrink; the rest is removed untimed). It reports these in wall
// time and in CPU time of the whole process (the machine may be shared),
// and the longest write transaction meanwhile, on any table: how long
// other writers of those tables could have been kept waiting.
func BenchmarkCIDRPolicy(b *testing.B) {
	for _, n := range []int{5_000, 10_000, 20_000} {
		b.Run(fmt.Sprintf("cidrs=%d", n), func(b *testing.B) {
			a := startAgent(b)
			cidrs := policyCIDRs(n)
			p := cidrPolicy("big", cidrs)
			half := cidrPolicy("big", cidrs[:n/2])
			half.ResourceVersion = "2"
			var add, remove, shrink, addCPU, removeCPU, shrinkCPU, addTxn, removeTxn, shrinkTxn time.Duration
			longest := func(what string, d time.Duration) time.Duration {
				txn, tables := a.txns.take()
				b.Logf("%s: longest write transaction %s, on %s", what, txn, tables)
				return max(d, txn)
			}
			b.ResetTimer()
			for range b.N {
				a.txns.take()
				t0, c0 := time.Now(), cpuTime()
				a.addPolicy(b, p)
				a.waitUntil(b, 5*time.Minute, "policy applied", a.policyApplied(n))
				add += time.Since(t0)
				addCPU += cpuTime() - c0
				addTxn = longest("add", addTxn)

				t0, c0 = time.Now(), cpuTime()
				a.deletePolicy(b, p)
				a.waitUntil(b, 5*time.Minute, "policy removed", a.policyGone)
				remove += time.Since(t0)
				removeCPU += cpuTime() - c0
				removeTxn = longest("remove", removeTxn)

				b.StopTimer()
				a.addPolicy(b, p)
				a.waitUntil(b, 5*time.Minute, "policy applied", a.policyApplied(n))
				a.txns.take()
				b.StartTimer()
				t0, c0 = time.Now(), cpuTime()
				a.updatePolicy(b, half)
				a.waitUntil(b, 5*time.Minute, "policy shrunk", a.policyShrunk(n/2))
				shrink += time.Since(t0)
				shrinkCPU += cpuTime() - c0
				shrinkTxn = longest("shrink", shrinkTxn)
				b.StopTimer()
				a.deletePolicy(b, half)
				a.waitUntil(b, 5*time.Minute, "policy removed", a.policyGone)
				b.StartTimer()
			}
			ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 / float64(b.N) }
			b.ReportMetric(ms(add), "add-ms")
			b.ReportMetric(ms(remove), "remove-ms")
			b.ReportMetric(ms(addCPU), "add-cpu-ms")
			b.ReportMetric(ms(removeCPU), "remove-cpu-ms")
			b.ReportMetric(ms(shrink), "shrink-ms")
			b.ReportMetric(ms(shrinkCPU), "shrink-cpu-ms")
			b.ReportMetric(float64(addTxn.Microseconds())/1000, "add-max-txn-ms")
			b.ReportMetric(float64(removeTxn.Microseconds())/1000, "remove-max-txn-ms")
			b.ReportMetric(float64(shrinkTxn.Microseconds())/1000, "shrink-max-txn-ms")
		})
	}
}
