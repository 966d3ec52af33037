package reconcilers

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

func TestPlanSlots(t *testing.T) {
	tests := []struct {
		name                    string
		cur, active, term, want []uint32
	}{
		{"create", nil, []uint32{1, 2, 3}, nil, []uint32{1, 2, 3}},
		{"append", []uint32{1, 2}, []uint32{1, 2, 3}, nil, []uint32{1, 2, 3}},
		{"remove last", []uint32{1, 2, 3}, []uint32{1, 2}, nil, []uint32{1, 2}},
		{"remove middle: last moves into the hole", []uint32{1, 2, 3, 4}, []uint32{1, 3, 4}, nil, []uint32{1, 4, 3}},
		{"remove first", []uint32{1, 2, 3}, []uint32{2, 3}, nil, []uint32{3, 2}},
		{"remove two", []uint32{1, 2, 3, 4, 5}, []uint32{1, 3, 5}, nil, []uint32{1, 5, 3}},
		{"replace", []uint32{1, 2}, []uint32{1, 7}, nil, []uint32{1, 7}},
		{"active to terminating swaps with the last active", []uint32{1, 2, 3}, []uint32{2, 3}, []uint32{1}, []uint32{3, 2, 1}},
		{"terminating kept after the active ones", []uint32{1, 2, 9}, []uint32{1, 2}, []uint32{9}, []uint32{1, 2, 9}},
		{"add active before terminating", []uint32{1, 9}, []uint32{1, 2}, []uint32{9}, []uint32{1, 2, 9}},
		{"all terminating keep their slots", []uint32{1, 2, 3}, nil, []uint32{1, 2, 3}, []uint32{1, 2, 3}},
		{"holes from a crash are filled", []uint32{1, 0, 3}, []uint32{1, 2, 3}, nil, []uint32{1, 2, 3}},
		{"duplicates placed once", []uint32{1, 1, 2}, []uint32{1, 2}, nil, []uint32{1, 2}},
		{"empty", []uint32{1, 2}, nil, nil, []uint32{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := planSlots(tt.cur, tt.active, tt.term)
			if !slices.Equal(got, tt.want) {
				t.Fatalf("planSlots(%v, %v, %v) = %v, want %v", tt.cur, tt.active, tt.term, got, tt.want)
			}
		})
	}
}

func TestPlanSlotsLarge(t *testing.T) {
	// Past smallClassSet the lookups go through a map; the result must not
	// change.
	var cur, active []uint32
	for i := uint32(1); i <= 1000; i++ {
		cur = append(cur, i)
		if i != 500 {
			active = append(active, i)
		}
	}
	got := planSlots(cur, active, nil)
	if len(got) != 999 || got[499] != 1000 || got[498] != 499 || got[500] != 501 {
		t.Fatalf("slot 500 should hold 1000, the rest stay: got ...%v...", got[497:502])
	}
}

// TestRemoveOneOf1000 removes one backend from a frontend of 1000 in real
// maps and counts the map operations: the design's bound is four.
func TestRemoveOneOf1000(t *testing.T) {
	testenv.RequireRoot(t)
	pinDir := testenv.BPFPinDir(t)
	db := statedb.New()
	backends, err := tables.NewBackendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	lb := NewLB(slog.New(slog.DiscardHandler), LBConfig{PinDir: pinDir, MaxEntries: 4096, MaxEntriesFlag: "bpf-lb-map-max"}, backends)
	t.Cleanup(func() { lb.Close() })

	fe := &tables.Frontend{
		Address: tables.L4Addr{Addr: netip.MustParseAddr("10.96.0.1"), Port: 80, Proto: tables.TCP},
		Type:    tables.FrontendClusterIP,
	}
	for i := range 1000 {
		fe.Backends = append(fe.Backends, tables.FrontendBackend{
			Address: tables.L4Addr{Addr: netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), Port: 8080, Proto: tables.TCP},
		})
	}
	update := func(f *tables.Frontend) {
		t.Helper()
		batch := []reconciler.BatchEntry[*tables.Frontend]{{Object: f}}
		lb.UpdateBatch(context.Background(), db.ReadTxn(), batch)
		if batch[0].Result != nil {
			t.Fatal(batch[0].Result)
		}
	}
	update(fe)
	before := opCounts(lb)

	smaller := fe.Clone()
	smaller.Backends = slices.Delete(slices.Clone(fe.Backends), 400, 401)
	update(smaller)
	after := opCounts(lb)
	if got := after - before; got > 4 {
		t.Fatalf("removing one backend of 1000 took %d map operations, want at most 4", got)
	}
	var dump strings.Builder
	if err := lb.Maps(func(m LBMaps) error {
		return WriteLBMaps(&dump, m)
	}); err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{
		"SVC 10.96.0.1:80/TCP SLOT=0 ID=1 COUNT=999 QCOUNT=0 FLAGS=ClusterIP\n",
		"SVC 10.96.0.1:80/TCP SLOT=401 ID=1 BEID=1000\n",
	} {
		if !strings.Contains(dump.String(), line) {
			t.Errorf("missing %q", line)
		}
	}
	if strings.Contains(dump.String(), "SLOT=1000 ") || strings.Contains(dump.String(), "BE ID=401 ") {
		t.Error("slot 1000 and backend 401 should be gone")
	}
}

func opCounts(lb *LB) uint64 {
	var n uint64
	for _, name := range lbMapNames {
		n += lb.Ops.Get(name, false) + lb.Ops.Get(name, true)
	}
	return n
}

// TestReopenKeepsEntries reopens the maps with another size or allocation:
// the entries are copied into the new maps, and the frontend needs no write.
func TestReopenKeepsEntries(t *testing.T) {
	testenv.RequireRoot(t)
	fe := &tables.Frontend{
		Address: tables.L4Addr{Addr: netip.MustParseAddr("10.96.0.1"), Port: 53, Proto: tables.UDP},
		Type:    tables.FrontendClusterIP,
		Backends: []tables.FrontendBackend{
			{Address: tables.L4Addr{Addr: netip.MustParseAddr("10.1.0.1"), Port: 5353, Proto: tables.UDP}},
			{Address: tables.L4Addr{Addr: netip.MustParseAddr("10.1.0.2"), Port: 5353, Proto: tables.UDP}},
		},
	}
	for _, tc := range []struct {
		name          string
		before, after LBConfig
	}{
		{"grow", LBConfig{MaxEntries: 64}, LBConfig{MaxEntries: 128}},
		{"shrink", LBConfig{MaxEntries: 128}, LBConfig{MaxEntries: 64}},
		{"preallocate", LBConfig{MaxEntries: 64}, LBConfig{MaxEntries: 64, Preallocate: true}},
		{"stop preallocating", LBConfig{MaxEntries: 64, Preallocate: true}, LBConfig{MaxEntries: 64}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pinDir := testenv.BPFPinDir(t)
			db := statedb.New()
			backends, err := tables.NewBackendsTable(db)
			if err != nil {
				t.Fatal(err)
			}
			open := func(cfg LBConfig) (*LB, string) {
				cfg.PinDir, cfg.MaxEntriesFlag = pinDir, "bpf-lb-map-max"
				lb := NewLB(slog.New(slog.DiscardHandler), cfg, backends)
				if err := lb.Update(context.Background(), db.ReadTxn(), 0, fe); err != nil {
					t.Fatal(err)
				}
				var dump strings.Builder
				if err := lb.Maps(func(maps LBMaps) error {
					for _, bm := range maps.All() {
						m := bm.(*ebpf.Map)
						if m.MaxEntries() != cfg.MaxEntries {
							t.Errorf("map has %d entries, want %d", m.MaxEntries(), cfg.MaxEntries)
						}
						if prealloc := m.Flags()&unix.BPF_F_NO_PREALLOC == 0; prealloc != cfg.Preallocate {
							t.Errorf("map preallocated: %v, want %v", prealloc, cfg.Preallocate)
						}
					}
					return WriteLBMaps(&dump, maps)
				}); err != nil {
					t.Fatal(err)
				}
				return lb, dump.String()
			}
			first, before := open(tc.before)
			first.Close()
			second, after := open(tc.after)
			defer second.Close()
			if before != after {
				t.Fatalf("entries changed:\n%s\nvs\n%s", before, after)
			}
			if n := opCounts(second); n != 0 {
				t.Fatalf("%d map operations after reopening, want 0", n)
			}
		})
	}
}

// TestOtherLayoutRefused pins an lb4_services of another key size, as an
// agent of another version may leave: opening the maps fails with the
// layout, on one line, rather than with the "buffer too small" of a copy
// that can never succeed, and the pin is left for the operator to remove.
func TestOtherLayoutRefused(t *testing.T) {
	testenv.RequireRoot(t)
	pinDir := testenv.BPFPinDir(t)
	path := filepath.Join(pinDir, bpf.LB4ServicesMap)
	stale, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 8, MaxEntries: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer stale.Close()
	if err := stale.Pin(path); err != nil {
		t.Fatal(err)
	}
	db := statedb.New()
	backends, err := tables.NewBackendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	lb := NewLB(slog.New(slog.DiscardHandler), LBConfig{PinDir: pinDir, MaxEntries: 64, MaxEntriesFlag: "bpf-lb-map-max"}, backends)
	defer lb.Close()
	err = lb.Maps(func(LBMaps) error { return nil })
	want := "open load-balancing maps: pinned map lb4_services has key size 8, want 12; value size 8, want 12: " +
		"its entries cannot be converted; remove it (rm " + path + ") to have an empty one created, or use another pin directory"
	if err == nil || err.Error() != want {
		t.Fatalf("got  %v\nwant %s", err, want)
	}
	var layoutErr *bpf.LayoutError
	if !errors.As(err, &layoutErr) {
		t.Errorf("%v is no LayoutError", err)
	}
	if err := lb.Maps(func(LBMaps) error { return nil }); err == nil || err.Error() != want {
		t.Errorf("second try: %v", err)
	}

	// `apiary bpf lb list` says the same.
	err = WritePinnedLB(io.Discard, pinDir)
	if !errors.As(err, &layoutErr) || layoutErr.Name != bpf.LB4ServicesMap {
		t.Errorf("WritePinnedLB: %v, want the layout of lb4_services", err)
	}

	// Once the operator removed the pin, the maps open.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := lb.Maps(func(LBMaps) error { return nil }); err != nil {
		t.Fatalf("after removing the stale pin: %v", err)
	}
}
