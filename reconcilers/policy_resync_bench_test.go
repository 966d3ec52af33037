package reconcilers_test

import (
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// BenchmarkPolicyResync measures one prune of the policy maps holding
// 200,000 entries (100 endpoints of 2,000 entries each) that nothing
// drifted, with the resync and without it.
func BenchmarkPolicyResync(b *testing.B) {
	const endpoints, perEndpoint = 100, 2000
	for _, resync := range []bool{true, false} {
		b.Run(map[bool]string{true: "resync", false: "off"}[resync], func(b *testing.B) {
			f := newPolicyFixture(b, 262144)
			if resync {
				d, err := reconcilers.NewDrift(nil, prometheus.NewRegistry())
				if err != nil {
					b.Fatal(err)
				}
				f.ops.ResyncWith(d)
			}
			for ep := uint32(1); ep <= endpoints; ep++ {
				rows := []any{polEndpoint(ep, uint64(10000+ep), tables.EnforceDefaultDeny, tables.EnforceDefaultDeny)}
				for i := range perEndpoint {
					dir := tables.DirIngress
					if i%2 == 1 {
						dir = tables.DirEgress
					}
					rows = append(rows, polEntry(ep, uint32(256+i/2), dir, uint16(1+i%1000)))
				}
				f.insert(b, rows...)
				if err := f.updateEndpoint(b, fmt.Sprintf("default/ep%d", ep)); err != nil {
					b.Fatal(err)
				}
			}
			if n := f.ops.Entries(); n != endpoints*perEndpoint {
				b.Fatalf("%d entries in the map, want %d", n, endpoints*perEndpoint)
			}
			u0, d0 := f.ops.Writes()
			for b.Loop() {
				f.prune(b)
			}
			u, d := f.ops.Writes()
			b.ReportMetric(float64(u-u0+d-d0)/float64(b.N), "writes/op")
		})
	}
}
