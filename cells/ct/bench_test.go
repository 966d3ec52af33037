package ct

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// benchEntries is the number of live connections the benchmarks work on.
const benchEntries = 500_000

// benchKey returns a distinct TCP tuple for each i below 16Mi.
func benchKey(i int) bpf.CTKey4 {
	return bpf.CTKey4{
		DAddr:   [4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)},
		SAddr:   [4]byte{10, 96, 0, 1},
		DPort:   bpf.NewBe16(uint16(32768 + i%28000)),
		SPort:   bpf.NewBe16(443),
		NextHdr: unix.IPPROTO_TCP,
	}
}

// BenchmarkMigrate500k resizes ct4_global holding 500,000 live connections:
//
//	resize  the whole resize as the reconciler runs it at start: create the
//	        new map, copy, swap the pin (512Ki → 1Mi entries)
//	copy    only the copy into an existing empty map (512Ki → 1Mi)
//	shrink  the whole resize to a smaller map that still holds every entry
//	        (1Mi → 512Ki), which reads the whole map before writing
//	raw     the baseline: batch lookups and batch updates one after the
//	        other, nothing else (what docs/reference/bpf-limits.md measured)
func BenchmarkMigrate500k(b *testing.B) {
	now := ctNow(b)
	lifetime := func(i int) int { return 3600 + i%600 }

	b.Run("resize", func(b *testing.B) {
		benchResize(b, 1<<19, 1<<20, now, lifetime)
	})
	b.Run("shrink", func(b *testing.B) {
		benchResize(b, 1<<20, 1<<19, now, lifetime)
	})
	b.Run("copy", func(b *testing.B) {
		testenv.RequireRoot(b)
		old := newCTMap(b, bpf.CT4GlobalMap, 1<<19)
		fill(b, old, benchKey, benchEntries, now, lifetime)
		b.ResetTimer()
		for range b.N {
			b.StopTimer()
			fresh := newCTMap(b, bpf.CT4GlobalMap, 1<<20)
			b.StartTimer()
			res, err := reconcilers.MigrateCT(context.Background(), old, fresh, now)
			b.StopTimer()
			if err != nil || res.Copied != benchEntries {
				b.Fatalf("copied %d, %v", res.Copied, err)
			}
			fresh.Close()
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/benchEntries, "ns/entry")
	})
	b.Run("raw", func(b *testing.B) {
		testenv.RequireRoot(b)
		old := newCTMap(b, bpf.CT4GlobalMap, 1<<19)
		fill(b, old, benchKey, benchEntries, now, lifetime)
		b.ResetTimer()
		for range b.N {
			b.StopTimer()
			fresh := newCTMap(b, bpf.CT4GlobalMap, 1<<20)
			b.StartTimer()
			err := bpf.WalkCT(old, 8192, func(keys []bpf.CTKey4, values []bpf.CTEntry) error {
				_, err := fresh.BatchUpdate(keys, values, nil)
				return err
			})
			b.StopTimer()
			if err != nil {
				b.Fatal(err)
			}
			fresh.Close()
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/benchEntries, "ns/entry")
	})
}

// benchResize pins a map of from entries holding benchEntries live entries
// and times its replacement by one of to entries through the reconciler's
// operations.
func benchResize(b *testing.B, from, to uint32, now uint32, lifetime func(int) int) {
	dir := testenv.BPFPinDir(b)
	spec, err := bpf.CTMapSpec(bpf.CT4GlobalMap, from)
	if err != nil {
		b.Fatal(err)
	}
	pm, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
	if err != nil {
		b.Fatal(err)
	}
	fill(b, pm.Map, benchKey, benchEntries, now, lifetime)
	info, err := pm.Info()
	if err != nil {
		b.Fatal(err)
	}
	oldID, _ := info.ID()
	// Holding the old map keeps it alive once a resize has unpinned it.
	defer pm.Close()
	path := filepath.Join(dir, bpf.CT4GlobalMap)

	b.ResetTimer()
	for i := range b.N {
		b.StopTimer()
		if i > 0 {
			// Put the old map back under the pin the last resize took.
			old, err := ebpf.NewMapFromID(oldID)
			if err != nil {
				b.Fatal(err)
			}
			if err := bpf.RemovePinnedMap(dir, bpf.CT4GlobalMap); err != nil {
				b.Fatal(err)
			}
			if err := old.Pin(path); err != nil {
				b.Fatal(err)
			}
			old.Close()
		}
		ops := reconcilers.NewCTMaps(nil, nil, dir)
		row := &tables.CTMap{Name: bpf.CT4GlobalMap, MaxEntries: to}
		b.StartTimer()
		err := ops.Update(context.Background(), nil, 0, row)
		b.StopTimer()
		if err != nil || row.Pin != "replaced" || row.Copied != benchEntries {
			b.Fatalf("resize: %+v, %v", row, err)
		}
		ops.Close()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/benchEntries, "ns/entry")
}

// BenchmarkGC500k runs a garbage collection over a map (1Mi entries) holding
// 500,000 entries, none or half of them expired.
func BenchmarkGC500k(b *testing.B) {
	for _, c := range []struct {
		name    string
		expired func(i int) bool
	}{
		{"none_expired", func(int) bool { return false }},
		{"half_expired", func(i int) bool { return i%2 == 0 }},
	} {
		b.Run(c.name, func(b *testing.B) {
			testenv.RequireRoot(b)
			now := ctNow(b)
			m := newCTMap(b, bpf.CT4GlobalMap, 1<<20)
			lifetime := func(i int) int {
				if c.expired(i) {
					return -10
				}
				return 3600
			}
			var wantDeleted uint64
			for i := range benchEntries {
				if c.expired(i) {
					wantDeleted++
				}
			}
			fill(b, m, benchKey, benchEntries, now, lifetime)
			b.ResetTimer()
			for i := range b.N {
				if i > 0 {
					b.StopTimer()
					fill(b, m, benchKey, benchEntries, now, lifetime)
					b.StartTimer()
				}
				scanned, deleted, err := CollectExpired(context.Background(), m, now)
				if err != nil || scanned != benchEntries || deleted != wantDeleted {
					b.Fatalf("scanned %d, deleted %d, %v; want %d, %d", scanned, deleted, err, benchEntries, wantDeleted)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/benchEntries, "ns/entry")
		})
	}
}
