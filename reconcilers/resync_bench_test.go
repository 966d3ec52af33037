package reconcilers

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"testing"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// BenchmarkIPCacheResync measures one prune of an ipcache map of 100,000
// prefixes that nothing drifted, with the resync (read the map, compare)
// and without it.
func BenchmarkIPCacheResync(b *testing.B) {
	const n = 100_000
	for _, resync := range []bool{true, false} {
		b.Run(map[bool]string{true: "resync", false: "off"}[resync], func(b *testing.B) {
			c := NewIPCache(nil)
			if _, err := c.Open(testenv.BPFPinDir(b), 131072); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { c.Close() })
			if resync {
				d, err := NewDrift(nil, prometheus.NewRegistry())
				if err != nil {
					b.Fatal(err)
				}
				c.ResyncWith(d)
			}
			rows := make([]*tables.IPCacheEntry, n)
			batch := make([]reconciler.BatchEntry[*tables.IPCacheEntry], n)
			for i := range rows {
				rows[i] = &tables.IPCacheEntry{Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32), Identity: uint32(256 + i%1000)}
				batch[i].Object = rows[i]
			}
			c.UpdateBatch(context.Background(), nil, batch)
			all := func(yield func(*tables.IPCacheEntry, statedb.Revision) bool) {
				for _, e := range rows {
					if !yield(e, 1) {
						return
					}
				}
			}
			u0, d0 := c.Writes()
			for b.Loop() {
				if err := c.Prune(context.Background(), nil, all); err != nil {
					b.Fatal(err)
				}
			}
			u, d := c.Writes()
			b.ReportMetric(float64(u-u0+d-d0)/float64(b.N), "writes/op")
		})
	}
}

// BenchmarkLBResync measures one prune of the load-balancing maps holding
// 10,000 or 50,000 ClusterIP frontends of 3 backends each (3 backends and
// 5 service entries per frontend, with the wildcards), nothing drifted,
// with the resync and without it.
func BenchmarkLBResync(b *testing.B) {
	for _, n := range []int{10_000, 50_000} {
		for _, resync := range []bool{true, false} {
			b.Run(fmt.Sprintf("%d/%s", n, map[bool]string{true: "resync", false: "off"}[resync]), func(b *testing.B) {
				benchLBResync(b, n, resync)
			})
		}
	}
}

func benchLBResync(b *testing.B, n int, resync bool) {
	{
		{
			db := statedb.New()
			backends, err := tables.NewBackendsTable(db)
			if err != nil {
				b.Fatal(err)
			}
			lb := NewLB(slog.New(slog.DiscardHandler), LBConfig{PinDir: testenv.BPFPinDir(b), MaxEntries: 524288, MaxEntriesFlag: "bpf-lb-map-max"}, backends)
			b.Cleanup(func() { lb.Close() })
			if resync {
				d, err := NewDrift(nil, prometheus.NewRegistry())
				if err != nil {
					b.Fatal(err)
				}
				lb.ResyncWith(d)
			}
			frontends := make([]*tables.Frontend, n)
			for i := range frontends {
				f := &tables.Frontend{
					Address: tables.L4Addr{Addr: netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)}), Port: 80, Proto: tables.TCP},
					Type:    tables.FrontendClusterIP,
				}
				for j := range 3 {
					f.Backends = append(f.Backends, tables.FrontendBackend{Address: tables.L4Addr{
						Addr: netip.AddrFrom4([4]byte{10, byte(1+j) + 4*byte(i>>16), byte(i >> 8), byte(i)}), Port: 8080, Proto: tables.TCP}})
				}
				frontends[i] = f
			}
			for start := 0; start < n; start += 5000 {
				batch := make([]reconciler.BatchEntry[*tables.Frontend], 0, 5000)
				for _, f := range frontends[start:min(start+5000, n)] {
					batch = append(batch, reconciler.BatchEntry[*tables.Frontend]{Object: f})
				}
				lb.UpdateBatch(context.Background(), db.ReadTxn(), batch)
				for _, e := range batch {
					if e.Result != nil {
						b.Fatal(e.Result)
					}
				}
			}
			all := func(yield func(*tables.Frontend, statedb.Revision) bool) {
				for _, f := range frontends {
					if !yield(f, 1) {
						return
					}
				}
			}
			ops := opCounts(lb)
			for b.Loop() {
				if err := lb.Prune(context.Background(), db.ReadTxn(), all); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(opCounts(lb)-ops)/float64(b.N), "writes/op")
		}
	}
}
