package reconcilers

import (
	"context"
	"log/slog"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// TestLBDriftRepaired corrupts the load-balancing maps through handles of
// their own, as bpftool would (a backend deleted, one rewritten to another
// address, a stray service slot, an IPv6 reverse NAT entry and an affinity
// match deleted): the resync (Prune) restores what the mirror says the
// agent wrote, counts each repair by map and kind, and writes nothing when
// nothing drifted.
func TestLBDriftRepaired(t *testing.T) {
	testenv.RequireRoot(t)
	pinDir := testenv.BPFPinDir(t)
	db := statedb.New()
	backends, err := tables.NewBackendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	lb := NewLB(slog.New(slog.DiscardHandler), LBConfig{PinDir: pinDir, MaxEntries: 1024, MaxEntriesFlag: "bpf-lb-map-max"}, backends)
	t.Cleanup(func() { lb.Close() })
	drift, err := NewDrift(nil, prometheus.NewPedanticRegistry())
	if err != nil {
		t.Fatal(err)
	}
	lb.ResyncWith(drift)

	addr := func(s string, port uint16) tables.L4Addr {
		return tables.L4Addr{Addr: netip.MustParseAddr(s), Port: port, Proto: tables.TCP}
	}
	fe4 := &tables.Frontend{Address: addr("10.96.0.10", 80), Type: tables.FrontendClusterIP}
	for _, b := range []string{"10.1.0.1", "10.1.0.2", "10.1.0.3"} {
		fe4.Backends = append(fe4.Backends, tables.FrontendBackend{Address: addr(b, 8080)})
	}
	fe6 := &tables.Frontend{Address: addr("fd00::10", 80), Type: tables.FrontendClusterIP, SessionAffinity: 60}
	for _, b := range []string{"fd01::1", "fd01::2"} {
		fe6.Backends = append(fe6.Backends, tables.FrontendBackend{Address: addr(b, 8080)})
	}
	frontends := []*tables.Frontend{fe4, fe6}
	batch := []reconciler.BatchEntry[*tables.Frontend]{{Object: fe4}, {Object: fe6}}
	lb.UpdateBatch(context.Background(), db.ReadTxn(), batch)
	for _, b := range batch {
		if b.Result != nil {
			t.Fatal(b.Result)
		}
	}
	dump := func() string {
		t.Helper()
		var out strings.Builder
		if err := lb.Maps(func(m LBMaps) error { return WriteLBMaps(&out, m) }); err != nil {
			t.Fatal(err)
		}
		return out.String()
	}
	prune := func() error {
		return lb.Prune(context.Background(), db.ReadTxn(), func(yield func(*tables.Frontend, statedb.Revision) bool) {
			for _, f := range frontends {
				if !yield(f, 1) {
					return
				}
			}
		})
	}
	want := dump()
	ops := opCounts(lb)
	if err := prune(); err != nil {
		t.Fatal(err)
	}
	if n := opCounts(lb) - ops; n != 0 {
		t.Fatalf("a resync without drift made %d map operations", n)
	}

	open := func(name string) *ebpf.Map {
		m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, name), nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	be4, svc4, rn6, aff := open(bpf.LB4BackendsMap), open(bpf.LB4ServicesMap), open(bpf.LB6RevNatMap), open(bpf.LBAffinityMatchMap)
	id1, id2 := lb.backend(fe4.Backends[0].Address).id, lb.backend(fe4.Backends[1].Address).id
	fe6ID := lb.frontend(fe6.Address).id
	affKey := bpf.LBAffinityMatchKey{BackendID: lb.backend(fe6.Backends[0].Address).id, RevNat: bpf.NewBe16(fe6ID)}
	for _, err := range []error{
		be4.Delete(id1),
		be4.Put(id2, backend4Value(addr("192.0.2.66", 9999), bpf.BackendActive)),
		svc4.Put(serviceKey4(addr("10.96.0.99", 443), 0), masterValue(4242, 1, 0, 0, 0)),
		rn6.Delete(bpf.NewBe16(fe6ID)),
		aff.Delete(affKey),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	if dump() == want {
		t.Fatal("the maps did not change")
	}
	if err := prune(); err != nil {
		t.Fatal(err)
	}
	if got := dump(); got != want {
		t.Fatalf("after the resync the maps hold\n%s\nwant\n%s", got, want)
	}
	for _, c := range []struct {
		m, kind string
		n       float64
	}{
		{bpf.LB4BackendsMap, DriftMissing, 1},
		{bpf.LB4BackendsMap, DriftChanged, 1},
		{bpf.LB4ServicesMap, DriftStray, 1},
		{bpf.LB6RevNatMap, DriftMissing, 1},
		{bpf.LBAffinityMatchMap, DriftMissing, 1},
		{bpf.LB4ServicesMap, DriftMissing, 0},
		{bpf.LB6BackendsMap, DriftChanged, 0},
	} {
		var metric dto.Metric
		if err := drift.Counter().WithLabelValues(c.m, c.kind).Write(&metric); err != nil {
			t.Fatal(err)
		}
		if got := metric.GetCounter().GetValue(); got != c.n {
			t.Errorf("drift %s %s counted %v, want %v", c.m, c.kind, got, c.n)
		}
	}
	ops = opCounts(lb)
	if err := prune(); err != nil {
		t.Fatal(err)
	}
	if n := opCounts(lb) - ops; n != 0 {
		t.Fatalf("a resync after the repair made %d map operations", n)
	}
}

// TestLBLeftoversNotDrift: what the maps held when they were opened and
// the mirror cannot explain (a crash's leftovers) is deleted by the first
// prune, as before, and not counted as drift; a stray added later is.
func TestLBLeftoversNotDrift(t *testing.T) {
	testenv.RequireRoot(t)
	pinDir := testenv.BPFPinDir(t)
	db := statedb.New()
	backends, err := tables.NewBackendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	cfg := LBConfig{PinDir: pinDir, MaxEntries: 1024, MaxEntriesFlag: "bpf-lb-map-max"}
	first := NewLB(slog.New(slog.DiscardHandler), cfg, backends)
	if err := first.Maps(func(LBMaps) error { return nil }); err != nil {
		t.Fatal(err)
	}
	first.Close()
	revNat, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, bpf.LB4RevNatMap), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { revNat.Close() })
	leftover := revNat4Value(tables.L4Addr{Addr: netip.MustParseAddr("10.96.0.77"), Port: 80})
	if err := revNat.Put(bpf.NewBe16(77), leftover); err != nil {
		t.Fatal(err)
	}

	lb := NewLB(slog.New(slog.DiscardHandler), cfg, backends)
	t.Cleanup(func() { lb.Close() })
	drift, err := NewDrift(nil, prometheus.NewPedanticRegistry())
	if err != nil {
		t.Fatal(err)
	}
	lb.ResyncWith(drift)
	prune := func() {
		t.Helper()
		if err := lb.Prune(context.Background(), db.ReadTxn(), func(func(*tables.Frontend, statedb.Revision) bool) {}); err != nil {
			t.Fatal(err)
		}
	}
	strays := func() float64 {
		var metric dto.Metric
		if err := drift.Counter().WithLabelValues(bpf.LB4RevNatMap, DriftStray).Write(&metric); err != nil {
			t.Fatal(err)
		}
		return metric.GetCounter().GetValue()
	}
	prune()
	var v bpf.LB4RevNatValue
	if err := revNat.Lookup(bpf.NewBe16(77), &v); err == nil {
		t.Fatal("the leftover rev-NAT entry is still there after the first prune")
	}
	if n := strays(); n != 0 {
		t.Fatalf("the leftover counted as %v strays of drift", n)
	}
	if err := revNat.Put(bpf.NewBe16(77), leftover); err != nil {
		t.Fatal(err)
	}
	prune()
	if err := revNat.Lookup(bpf.NewBe16(77), &v); err == nil {
		t.Fatal("the stray rev-NAT entry is still there after the second prune")
	}
	if n := strays(); n != 1 {
		t.Fatalf("a stray added later counted %v times, want 1", n)
	}
}
