package reconcilers

import (
	"context"
	"log/slog"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/nodeport"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// maglevAgent is one agent's load balancer and Maglev reconciler, on maps
// of its own.
type maglevAgent struct {
	db  *statedb.DB
	lb  *LB
	ops *Maglev
	m   *ebpf.Map
}

func newMaglevAgent(t *testing.T, size uint32) *maglevAgent {
	t.Helper()
	db := statedb.New()
	backends, err := tables.NewBackendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	a := &maglevAgent{db: db}
	a.lb = NewLB(slog.New(slog.DiscardHandler), LBConfig{PinDir: testenv.BPFPinDir(t), MaxEntries: 4096, MaxEntriesFlag: "bpf-lb-map-max"}, backends)
	t.Cleanup(func() { a.lb.Close() })
	if a.ops, err = NewMaglev(slog.New(slog.DiscardHandler), size, a.lb.Maps); err != nil {
		t.Fatal(err)
	}
	spec, err := nodeport.MaglevMapSpec(size)
	if err != nil {
		t.Fatal(err)
	}
	if a.m, err = ebpf.NewMap(spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.m.Close(); a.ops.SetMap(nil) })
	if err := a.ops.SetMap(a.m); err != nil {
		t.Fatal(err)
	}
	return a
}

// frontend writes f through the load balancer and its Maglev table
// through the reconciler, and returns the table as backend addresses.
func (a *maglevAgent) frontend(t *testing.T, f *tables.Frontend) []tables.L4Addr {
	t.Helper()
	batch := []reconciler.BatchEntry[*tables.Frontend]{{Object: f}}
	a.lb.UpdateBatch(context.Background(), a.db.ReadTxn(), batch)
	if batch[0].Result != nil {
		t.Fatal(batch[0].Result)
	}
	mg := &tables.Maglev{Frontend: f.Address, ID: f.ID}
	for _, b := range f.Backends {
		mg.Backends = append(mg.Backends, b.Address)
	}
	slices.SortFunc(mg.Backends, tables.L4Addr.Compare)
	if err := a.ops.Update(context.Background(), a.db.ReadTxn(), 0, mg); err != nil {
		t.Fatal(err)
	}
	lut := make([]uint32, a.ops.size)
	if err := a.m.Lookup(nodeport.MaglevKey{RevNat: bpf.NewBe16(f.ID)}, &lut); err != nil {
		t.Fatal(err)
	}
	out := make([]tables.L4Addr, len(lut))
	if err := a.lb.Maps(func(lm LBMaps) error {
		for i, id := range lut {
			var be bpf.LB4BackendValue
			if err := lm.Backends4.Lookup(id, &be); err != nil {
				return err
			}
			out[i] = tables.L4Addr{Addr: netip.AddrFrom4(be.Address), Port: be.Port.Uint16(), Proto: tables.Proto(be.Proto)}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func maglevBackends(n int) []tables.FrontendBackend {
	var out []tables.FrontendBackend
	for i := range n {
		out = append(out, tables.FrontendBackend{Address: tables.L4Addr{Addr: netip.AddrFrom4([4]byte{10, 1, 0, byte(i + 1)}), Port: 8080, Proto: tables.TCP}})
	}
	return out
}

// TestMaglevAgentsAgree: two agents that learnt the backends in another
// order, and so gave them other IDs, write tables that name the same
// backend in every slot; removing one of N backends moves about 1/N of
// the slots, all of them the removed backend's or near enough.
func TestMaglevAgentsAgree(t *testing.T) {
	testenv.RequireRoot(t)
	const n, size = 10, 16381
	bes := maglevBackends(n)
	fe := func(addr string, b []tables.FrontendBackend) *tables.Frontend {
		return &tables.Frontend{Address: tables.L4Addr{Addr: netip.MustParseAddr(addr), Port: 30080, Proto: tables.TCP},
			Type: tables.FrontendNodePort, Backends: b}
	}
	a, b := newMaglevAgent(t, size), newMaglevAgent(t, size)
	// Agent b meets the backends first through another service, in
	// reverse order: its IDs differ from a's.
	rev := slices.Clone(bes)
	slices.Reverse(rev)
	b.frontend(t, fe("10.0.0.9", rev[:3]))

	ta := a.frontend(t, fe("10.0.0.1", bes))
	tb := b.frontend(t, fe("10.0.0.2", bes)) // each node's own address
	if !slices.Equal(ta, tb) {
		for i := range ta {
			if ta[i] != tb[i] {
				t.Fatalf("slot %d: %s on one agent, %s on the other", i, ta[i], tb[i])
			}
		}
	}

	gone := bes[4].Address
	less := slices.Delete(slices.Clone(bes), 4, 5)
	after := a.frontend(t, fe("10.0.0.1", less))
	moved, others := 0, 0
	for i := range ta {
		if after[i] == gone {
			t.Fatalf("slot %d still names the removed backend", i)
		}
		if ta[i] != after[i] {
			moved++
			if ta[i] != gone {
				others++
			}
		}
	}
	frac := float64(moved) / size
	t.Logf("removing 1 of %d backends moved %.4f of the slots (%d of them not the removed backend's)", n, frac, others)
	if frac < 0.5/n || frac > 1.5/n {
		t.Errorf("removing 1 of %d backends moved %.4f of the slots, want about %.4f", n, frac, 1.0/n)
	}
}
