package ipcache_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// benchAgent is a started hive with the identity and ipcache cells, on real
// pinned maps.
type benchAgent struct {
	h        *hive.Hive
	db       *statedb.DB
	prefixes ipcache.Prefixes
	ipcache  statedb.Table[*tables.IPCacheEntry]
}

func startBenchAgent(b *testing.B) *benchAgent {
	b.Helper()
	testenv.RequireRoot(b)
	a := &benchAgent{}
	log := hivetest.Logger(b, hivetest.LogLevel(slog.LevelWarn))
	a.h = hive.NewWithOptions(core.HiveOptions(),
		statedb.Cell, health.Cell, job.Cell, metrics.Cell, bpffs.Cell, node.Cell,
		identity.Cell, ipcache.Cell,
		cell.Invoke(func(db *statedb.DB, p ipcache.Prefixes, t statedb.Table[*tables.IPCacheEntry]) {
			a.db, a.prefixes, a.ipcache = db, p, t
		}),
	)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	a.h.RegisterFlags(fs)
	if err := fs.Parse([]string{
		"--bpf-pin-dir=" + testenv.BPFPinDir(b), "--state-dir=" + b.TempDir(),
		"--node-name=bench", "--node-ips=192.168.1.10",
	}); err != nil {
		b.Fatal(err)
	}
	if err := a.h.Start(log, context.Background()); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { a.h.Stop(log, context.Background()) })
	return a
}

// update applies changes and waits until the map holds them.
func (a *benchAgent) update(b *testing.B, changes []ipcache.Change) {
	rev, err := a.prefixes.Update(changes...)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := a.prefixes.Wait(ctx, rev); err != nil {
		b.Fatal(err)
	}
}

// mixedPrefixes returns n distinct IPv4 prefixes of lengths /16 to /32,
// some nested in others.
func mixedPrefixes(n int) []netip.Prefix {
	seen := map[netip.Prefix]struct{}{}
	out := make([]netip.Prefix, 0, n)
	for i := 0; len(out) < n; i++ {
		base := uint32(0x0B000000) + uint32(i)<<8 // 11.0.0.0 + i*256
		bits := 24 + i%9
		if i%100 == 0 {
			bits = 16 + (i/100)%8
		}
		addr := netip.AddrFrom4([4]byte{byte(base >> 24), byte(base >> 16), byte(base >> 8), byte(i % 7)})
		p := netip.PrefixFrom(addr, bits).Masked()
		if _, ok := seen[p]; ok {
			continue
		}
		seen[p] = struct{}{}
		out = append(out, p)
	}
	return out
}

func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkPrefixesToMap times prefixes from their owner to the ipcache map:
// one Update with every prefix, resolution (labels of shorter prefixes
// containing each one), identity allocation, the ipcache table and the map
// writes, until Wait returns. Each iteration then deletes them again
// (untimed).
//
//	policy-cidrs-60k  60,000 policy CIDRs of mixed lengths, each its own
//	                  cidr: label, so each its own local identity (the local
//	                  range holds 65,535)
//	shared-100k       100,000 prefixes of mixed lengths sharing 1,000 label
//	                  sets (as FQDN selectors do): 1,000 identities
func BenchmarkPrefixesToMap(b *testing.B) {
	for _, tc := range []struct {
		name   string
		n      int
		labels func(i int, p netip.Prefix) []string
	}{
		{"policy-cidrs-60k", 60_000, func(_ int, p netip.Prefix) []string {
			return []string{tables.CIDRLabel(p), tables.LabelWorld}
		}},
		{"shared-100k", 100_000, func(i int, _ netip.Prefix) []string {
			return []string{fmt.Sprintf("fqdn:name-%d.example.com", i%1000)}
		}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			a := startBenchAgent(b)
			pfx := mixedPrefixes(tc.n)
			add := make([]ipcache.Change, len(pfx))
			del := make([]ipcache.Change, len(pfx))
			for i, p := range pfx {
				add[i] = ipcache.Upsert(p, "policy", tc.labels(i, p)...)
				del[i] = ipcache.Delete(p, "policy")
			}
			var bytesPerPrefix float64
			b.ResetTimer()
			for i := range b.N {
				b.StopTimer()
				before := heapInUse()
				b.StartTimer()
				a.update(b, add)
				b.StopTimer()
				if i == 0 {
					bytesPerPrefix = float64(heapInUse()-before) / float64(len(pfx))
				}
				if got := a.ipcache.NumObjects(a.db.ReadTxn()); got != len(pfx)+1 {
					b.Fatalf("%d ipcache entries, want %d", got, len(pfx)+1)
				}
				a.update(b, del)
				b.StartTimer()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(pfx)), "ns/prefix")
			b.ReportMetric(bytesPerPrefix, "heap-B/prefix")
		})
	}
}

// BenchmarkRelabelParent times adding and then removing the labels of a
// /8 over 10,000 /32 children labelled by 100 FQDN selectors: each change
// relabels every child (100 new identities, 10,000 map writes), applied in
// chunks of --ipcache-chunk-size.
func BenchmarkRelabelParent(b *testing.B) {
	a := startBenchAgent(b)
	const n = 10_000
	children := make([]ipcache.Change, n)
	for i := range n {
		addr := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		children[i] = ipcache.Upsert(tables.HostPrefix(addr), fmt.Sprintf("fqdn/%d", i),
			fmt.Sprintf("fqdn:name-%d.example.com", i%100))
	}
	a.update(b, children)
	parent := netip.MustParsePrefix("10.0.0.0/8")
	b.ResetTimer()
	for range b.N {
		a.update(b, []ipcache.Change{ipcache.Upsert(parent, "policy", tables.CIDRLabel(parent))})
		a.update(b, []ipcache.Change{ipcache.Delete(parent, "policy")})
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/2/n, "ns/child")
}
