package reconcilers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"sync"
	"testing"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/memmap"
	"github.com/apiary-net/apiary/tables"
)

// faultyPins is a pin directory in memory whose maps can be made to fail,
// by name.
type faultyPins struct {
	*memmap.Pins
	mu     sync.Mutex
	faulty map[string]*memmap.Faulty
}

func newFaultyPins() *faultyPins {
	p := &faultyPins{faulty: map[string]*memmap.Faulty{}}
	p.Pins = memmap.NewPins(func(path string, m *memmap.Map) bpf.Map {
		p.mu.Lock()
		defer p.mu.Unlock()
		f := memmap.NewFaulty(m)
		p.faulty[filepath.Base(path)] = f
		return f
	})
	return p
}

func (p *faultyPins) inject(name string, f memmap.Fault) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faulty[name].Inject(f)
}

// lbFaultFrontends are a few frontends of both families sharing backends.
func lbFaultFrontends() []*tables.Frontend {
	addr := func(s string, port uint16) tables.L4Addr {
		return tables.L4Addr{Addr: netip.MustParseAddr(s), Port: port, Proto: tables.TCP}
	}
	var fes []*tables.Frontend
	for i := range 4 {
		fe := &tables.Frontend{Address: addr(fmt.Sprintf("10.96.0.%d", 10+i), 80), Type: tables.FrontendClusterIP}
		for j := range 3 {
			fe.Backends = append(fe.Backends, tables.FrontendBackend{Address: addr(fmt.Sprintf("10.1.0.%d", i+j), 8080)})
		}
		fes = append(fes, fe)
	}
	fe6 := &tables.Frontend{Address: addr("fd00::10", 80), Type: tables.FrontendClusterIP, SessionAffinity: 60}
	fe6.Backends = []tables.FrontendBackend{{Address: addr("fd01::1", 8080)}, {Address: addr("fd01::2", 8080)}}
	return append(fes, fe6)
}

// lbConsistent fails the test unless every map holds exactly what the
// mirror says it does (a resync finds nothing to repair).
func lbConsistent(t *testing.T, lb *LB, when string) {
	t.Helper()
	d, err := NewDrift(nil, prometheus.NewPedanticRegistry())
	if err != nil {
		t.Fatal(err)
	}
	lb.mu.Lock()
	lb.drift = d
	err = lb.resyncLocked()
	lb.drift = nil
	lb.mu.Unlock()
	if err != nil {
		t.Fatalf("%s: resync: %v", when, err)
	}
	for _, name := range lbMapNames {
		for _, kind := range []string{"missing", "changed", "stray"} {
			if n := counterValue(t, d, name, kind); n != 0 {
				t.Errorf("%s: %s has %v %s entries: the mirror and the map disagree", when, name, n, kind)
			}
		}
	}
}

func counterValue(t *testing.T, d *Drift, mapName, kind string) float64 {
	t.Helper()
	c, err := d.Counter().GetMetricWithLabelValues(mapName, kind)
	if err != nil {
		t.Fatal(err)
	}
	m := new(dto.Metric)
	if err := c.Write(m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// TestLBFaults makes the maps fail in the middle of a round (a batch that
// stops halfway, a full map, EBUSY on a single write or on deletes): the
// failed frontends report an error, the mirror and the maps still agree,
// and the next round, which the reconciler runs for the failed frontends
// only, finishes the job: an agent restarted on the maps then finds
// nothing to write.
func TestLBFaults(t *testing.T) {
	cases := []struct {
		name  string
		del   bool // the fault hits the deletion of two frontends
		mapN  string
		fault memmap.Fault
	}{
		{"service slots batch fails halfway", false, bpf.LB4ServicesMap, memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy, After: 3, Times: 1}},
		{"backends map full", false, bpf.LB4BackendsMap, memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrFull, After: 2, Times: 1}},
		{"reverse NAT fails at once", false, bpf.LB4RevNatMap, memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy, Times: 1}},
		{"IPv6 slots fail", false, bpf.LB6ServicesMap, memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy, After: 1, Times: 1}},
		{"affinity match fails", false, bpf.LBAffinityMatchMap, memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy, Times: 1}},
		{"slot deletes fail halfway", true, bpf.LB4ServicesMap, memmap.Fault{Op: memmap.OpDelete, Err: memmap.ErrBusy, After: 2, Times: 1}},
		{"backend deletes fail", true, bpf.LB4BackendsMap, memmap.Fault{Op: memmap.OpDelete, Err: memmap.ErrBusy, After: 1, Times: 1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			db := statedb.New()
			backends, err := tables.NewBackendsTable(db)
			if err != nil {
				t.Fatal(err)
			}
			pins := newFaultyPins()
			cfg := LBConfig{PinDir: "/test", Maps: pins, MaxEntries: 1024, MaxEntriesFlag: "bpf-lb-map-max"}
			lb := NewLB(slog.New(slog.DiscardHandler), cfg, backends)
			if err := lb.Maps(func(LBMaps) error { return nil }); err != nil {
				t.Fatal(err)
			}
			ctx, txn := context.Background(), db.ReadTxn()
			all := lbFaultFrontends()
			want := all
			// round runs op on the frontends until none fails, as the
			// reconciler retries failed objects.
			round := func(op func(context.Context, statedb.ReadTxn, []reconciler.BatchEntry[*tables.Frontend]), fes []*tables.Frontend) {
				for try := 0; len(fes) > 0; try++ {
					if try == 3 {
						t.Fatalf("still failing after %d rounds", try)
					}
					batch := make([]reconciler.BatchEntry[*tables.Frontend], len(fes))
					for i, f := range fes {
						batch[i].Object = f
					}
					op(ctx, txn, batch)
					fes = fes[:0:0]
					for _, b := range batch {
						if b.Result != nil {
							if tc.fault.Err == memmap.ErrFull && !errors.Is(b.Result, unix.E2BIG) {
								t.Errorf("a full map reported as %v", b.Result)
							}
							fes = append(fes, b.Object)
						}
					}
					lbConsistent(t, lb, fmt.Sprintf("after round %d", try+1))
				}
			}
			if tc.del {
				round(lb.UpdateBatch, all)
				pins.inject(tc.mapN, tc.fault)
				want = all[2:]
				round(lb.DeleteBatch, all[:2])
			} else {
				pins.inject(tc.mapN, tc.fault)
				round(lb.UpdateBatch, all)
			}
			if pins.faulty[tc.mapN].Failed() == 0 {
				t.Fatal("the fault was not hit")
			}
			// Backends whose deletion failed go at the next prune.
			err = lb.Prune(ctx, txn, func(yield func(*tables.Frontend, statedb.Revision) bool) {
				for _, f := range want {
					if !yield(f, 1) {
						return
					}
				}
			})
			if err != nil {
				t.Fatalf("prune: %v", err)
			}
			lbConsistent(t, lb, "after the prune")
			if err := lb.Close(); err != nil {
				t.Fatal(err)
			}

			// A restart on the same maps: nothing left to write or delete.
			again := NewLB(slog.New(slog.DiscardHandler), cfg, backends)
			t.Cleanup(func() { again.Close() })
			batch := make([]reconciler.BatchEntry[*tables.Frontend], len(want))
			for i, f := range want {
				batch[i].Object = f
			}
			again.UpdateBatch(ctx, txn, batch)
			err = again.Prune(ctx, txn, func(yield func(*tables.Frontend, statedb.Revision) bool) {
				for _, f := range want {
					if !yield(f, 1) {
						return
					}
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			if n := opCounts(again); n != 0 {
				t.Errorf("the restarted agent made %d map operations: the maps were not finished", n)
			}
		})
	}
}

// ipcacheConsistent fails the test unless the ipcache map holds exactly
// what the operations' record says.
func ipcacheConsistent(t *testing.T, c *IPCache, when string) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	mirrorConsistent(t, c.m, when)
}

// TestIPCacheFaults: a batch that fails halfway (EBUSY) or a full map
// leaves the map and the record in agreement; the failed entries report
// the error and the next round writes them.
func TestIPCacheFaults(t *testing.T) {
	cases := []struct {
		name   string
		fault  memmap.Fault
		failed int // entries whose result is an error in the first round
	}{
		{"batch fails halfway, written one by one", memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy, After: 3, Times: 1}, 0},
		{"batch and then every write fail", memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy, After: 2, Times: 4}, 3},
		{"map full", memmap.Fault{Op: memmap.OpWrite, Err: unix.ENOSPC, After: 4, Times: 2}, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pins := newFaultyPins()
			c := NewIPCache(nil)
			if _, err := c.OpenWith(pins, "/test", 1024); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			var batch []reconciler.BatchEntry[*tables.IPCacheEntry]
			for i := range 6 {
				batch = append(batch, reconciler.BatchEntry[*tables.IPCacheEntry]{Object: &tables.IPCacheEntry{
					Prefix: netip.MustParsePrefix(fmt.Sprintf("10.0.%d.0/24", i)), Identity: uint32(100 + i),
				}})
			}
			pins.inject(bpf.IPCacheMap, tc.fault)
			c.UpdateBatch(context.Background(), nil, batch)
			var retry []reconciler.BatchEntry[*tables.IPCacheEntry]
			for _, b := range batch {
				if b.Result != nil {
					retry = append(retry, reconciler.BatchEntry[*tables.IPCacheEntry]{Object: b.Object})
				}
			}
			if len(retry) != tc.failed {
				t.Errorf("%d entries failed, want %d", len(retry), tc.failed)
			}
			ipcacheConsistent(t, c, "after the faulty round")
			pins.faulty[bpf.IPCacheMap].Clear()
			c.UpdateBatch(context.Background(), nil, retry)
			for _, b := range retry {
				if b.Result != nil {
					t.Errorf("retry of %s: %v", b.Object.Prefix, b.Result)
				}
			}
			ipcacheConsistent(t, c, "after the retry")
			if n := pins.Get("/test/" + bpf.IPCacheMap).Len(); n != 6 {
				t.Errorf("the map holds %d entries after the retry, want 6", n)
			}
		})
	}
}
