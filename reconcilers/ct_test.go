package reconcilers_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// ctEntrySet holds conntrack entries as a test writes them, the way the
// datapath would: keyed by tuple, lifetime relative to the CT clock.
type ctEntrySet[K bpf.CTKey] map[K]bpf.CTEntry

// ctKey4 returns a distinct TCP tuple for each i.
func ctKey4(i int) bpf.CTKey4 {
	return bpf.CTKey4{
		DAddr:   [4]byte{10, 1, byte(i >> 16), byte(i >> 8)},
		SAddr:   [4]byte{10, 2, 0, byte(i)},
		DPort:   bpf.NewBe16(uint16(40000 + i%20000)),
		SPort:   bpf.NewBe16(80),
		NextHdr: unix.IPPROTO_TCP,
	}
}

// ctKey6 returns a distinct UDP tuple for each i.
func ctKey6(i int) bpf.CTKey6 {
	d := netip.MustParseAddr("fd00::").As16()
	d[13], d[14], d[15] = byte(i>>16), byte(i>>8), byte(i)
	return bpf.CTKey6{
		DAddr:   d,
		SAddr:   netip.MustParseAddr("fd00::53").As16(),
		DPort:   bpf.NewBe16(uint16(40000 + i%20000)),
		SPort:   bpf.NewBe16(53),
		NextHdr: unix.IPPROTO_UDP,
		Flags:   bpf.CTIngress,
	}
}

// ctNow returns the CT clock.
func ctNow(t testing.TB) uint32 {
	t.Helper()
	now, err := bpf.CTClockNow()
	if err != nil {
		t.Fatal(err)
	}
	return now
}

// ctMakeEntries returns live entries with lifetimes now+firstLife, now+firstLife+1,
// … and expired entries with lifetimes in the past.
func ctMakeEntries[K bpf.CTKey](key func(int) K, now uint32, live, expired int, firstLife uint32) ctEntrySet[K] {
	e := ctEntrySet[K]{}
	for i := range live {
		e[key(i)] = bpf.CTEntry{Lifetime: now + firstLife + uint32(i), TxPackets: uint64(i), RevNAT: bpf.NewBe16(7)}
	}
	for i := live; i < live+expired; i++ {
		e[key(i)] = bpf.CTEntry{Lifetime: now - 1 - uint32(i%50), TxPackets: uint64(i)}
	}
	return e
}

// ctWriteEntries puts entries into m with one batch update.
func ctWriteEntries[K bpf.CTKey](t testing.TB, m bpf.Map, entries ctEntrySet[K]) {
	t.Helper()
	keys := make([]K, 0, len(entries))
	values := make([]bpf.CTEntry, 0, len(entries))
	for k, v := range entries {
		keys = append(keys, k)
		values = append(values, v)
	}
	if n, err := m.BatchUpdate(keys, values, nil); err != nil || n != len(keys) {
		t.Fatalf("write %d entries: wrote %d, %v", len(keys), n, err)
	}
}

// ctReadEntries returns every entry of m.
func ctReadEntries[K bpf.CTKey](t testing.TB, m bpf.Map) ctEntrySet[K] {
	t.Helper()
	got := ctEntrySet[K]{}
	if err := bpf.WalkCT(m, 1024, func(keys []K, values []bpf.CTEntry) error {
		for i, k := range keys {
			got[k] = values[i]
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return got
}

// ctPinnedMap opens what is pinned under name in dir.
func ctPinnedMap(t testing.TB, dir, name string) *ebpf.Map {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func ctMapID(t testing.TB, bm bpf.Map) ebpf.MapID {
	t.Helper()
	m, err := bpf.KernelMap(bm)
	if err != nil {
		t.Fatal(err)
	}
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, ok := info.ID()
	if !ok {
		t.Fatal("no map ID")
	}
	return id
}

// ctUpdate reconciles row with ops, as the reconciler would, and returns the
// row as the reconciler would store it.
func ctUpdate(t testing.TB, ops *reconcilers.CTMaps, row *tables.CTMap) *tables.CTMap {
	t.Helper()
	row = row.Clone()
	if err := ops.Update(context.Background(), nil, 0, row); err != nil {
		t.Fatalf("update %s: %v", row.Name, err)
	}
	return row
}

func ctNewOps(t testing.TB, dir string) *reconcilers.CTMaps {
	ops := reconcilers.NewCTMaps(nil, nil, dir)
	t.Cleanup(func() { ops.Close() })
	return ops
}

func ctUseMap(t testing.TB, ops *reconcilers.CTMaps, name string, fn func(bpf.Map)) {
	t.Helper()
	if err := ops.Use(name, func(m bpf.Map) error { fn(m); return nil }); err != nil {
		t.Fatal(err)
	}
}

func TestCTMapsCreateThenReuse(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	row := &tables.CTMap{Name: bpf.CT4GlobalMap, MaxEntries: 4096}
	now := ctNow(t)
	entries := ctMakeEntries(ctKey4, now, 100, 20, 3600)

	ops := ctNewOps(t, dir)
	got := ctUpdate(t, ops, row)
	if got.Pin != "created" || got.ActualMaxEntries != 4096 || got.Change != "" || got.Copied != 0 {
		t.Errorf("first open: %+v", got)
	}
	var id ebpf.MapID
	ctUseMap(t, ops, row.Name, func(m bpf.Map) {
		ctWriteEntries(t, m, entries)
		id = ctMapID(t, m)
	})
	ops.Close()

	// A restart with the same size keeps the very same map, expired
	// entries included (the GC deals with those).
	ops = ctNewOps(t, dir)
	got = ctUpdate(t, ops, row)
	if got.Pin != "reused" || got.ActualMaxEntries != 4096 || got.Change != "" {
		t.Errorf("reopen: %+v", got)
	}
	ctUseMap(t, ops, row.Name, func(m bpf.Map) {
		if got := ctMapID(t, m); got != id {
			t.Errorf("reopen: map ID %d, want %d", got, id)
		}
		if got := ctReadEntries[bpf.CTKey4](t, m); len(got) != len(entries) {
			t.Errorf("reopen: %d entries, want %d", len(got), len(entries))
		}
	})
	if names := ops.Names(); !slices.Equal(names, []string{bpf.CT4GlobalMap}) {
		t.Errorf("Names() = %v", names)
	}
}

func TestCTMapsResize(t *testing.T) {
	cases := []struct {
		name          string
		v6            bool
		from, to      uint32
		live, expired int
		// wantKept is how many of the live entries must be kept, the ones
		// with the latest lifetimes; -1 means all.
		wantKept int
	}{
		{name: "grow", from: 4096, to: 16384, live: 800, expired: 300, wantKept: -1},
		{name: "grow_ipv6", v6: true, from: 4096, to: 8192, live: 800, expired: 300, wantKept: -1},
		{name: "shrink_fits", from: 16384, to: 4096, live: 800, expired: 3000, wantKept: -1},
		// 3000 live entries into 1024: the kernel's LRU may strand free
		// elements on other CPUs, so the count kept is measured, not fixed.
		{name: "shrink_drops", from: 8192, to: 1024, live: 3000, expired: 100, wantKept: 0},
		{name: "shrink_drops_ipv6", v6: true, from: 8192, to: 2048, live: 3000, expired: 100, wantKept: 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			name := bpf.CT4GlobalMap
			if c.v6 {
				name = bpf.CTAny6GlobalMap
			}
			if c.v6 {
				testCTResize(t, name, ctKey6, c.from, c.to, c.live, c.expired, c.wantKept)
			} else {
				testCTResize(t, name, ctKey4, c.from, c.to, c.live, c.expired, c.wantKept)
			}
		})
	}
}

func testCTResize[K bpf.CTKey](t *testing.T, name string, key func(int) K, from, to uint32, live, expired, wantKept int) {
	dir := testenv.BPFPinDir(t)
	now := ctNow(t)
	// Live lifetimes start an hour out, so none expires during the test.
	entries := ctMakeEntries(key, now, live, expired, 3600)

	ops := ctNewOps(t, dir)
	ctUpdate(t, ops, &tables.CTMap{Name: name, MaxEntries: from})
	var oldID ebpf.MapID
	ctUseMap(t, ops, name, func(m bpf.Map) {
		ctWriteEntries(t, m, entries)
		oldID = ctMapID(t, m)
	})
	ops.Close()

	ops = ctNewOps(t, dir)
	got := ctUpdate(t, ops, &tables.CTMap{Name: name, MaxEntries: to})
	t.Logf("resize %d → %d: copied %d, dropped %d, expired %d", from, to, got.Copied, got.Dropped, got.Expired)
	if got.Pin != "replaced" || got.ActualMaxEntries != to {
		t.Errorf("resize: pin %q, actual max entries %d; want replaced, %d", got.Pin, got.ActualMaxEntries, to)
	}
	if want := fmt.Sprintf("max entries %d → %d", from, to); got.Change != want {
		t.Errorf("change %q, want %q", got.Change, want)
	}
	if got.Expired != uint64(expired) {
		t.Errorf("expired %d, want %d", got.Expired, expired)
	}
	if got.Copied+got.Dropped != uint64(live) || got.Entries != got.Copied {
		t.Errorf("copied %d + dropped %d != %d live, or entries %d != copied", got.Copied, got.Dropped, live, got.Entries)
	}

	var after ctEntrySet[K]
	ctUseMap(t, ops, name, func(m bpf.Map) {
		if ctMapID(t, m) == oldID {
			t.Error("the old map is still in use")
		}
		after = ctReadEntries[K](t, m)
	})
	// The pin holds the new map, the temporary pin is gone.
	if pinned := ctPinnedMap(t, dir, name); pinned.MaxEntries() != to {
		t.Errorf("pin has max entries %d, want %d", pinned.MaxEntries(), to)
	}
	if _, err := os.Stat(filepath.Join(dir, name+"_new")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("temporary pin left behind (stat: %v)", err)
	}

	if uint64(len(after)) != got.Copied {
		t.Errorf("new map holds %d entries, reported copied %d", len(after), got.Copied)
	}
	// Live entries have lifetimes now+3600+i: those kept must be the ones
	// with the highest i, every one unchanged, and no expired one.
	minKept := 0
	switch {
	case wantKept < 0:
		if got.Dropped != 0 {
			t.Errorf("dropped %d, want 0", got.Dropped)
		}
	default:
		if got.Dropped == 0 || got.Copied == 0 {
			t.Errorf("copied %d, dropped %d; want some of each", got.Copied, got.Dropped)
		}
		if got.Copied > uint64(to) {
			t.Errorf("copied %d into a map of %d", got.Copied, to)
		}
		minKept = live - int(got.Copied)
	}
	for i := range live {
		v, ok := after[key(i)]
		switch {
		case i >= minKept && !ok:
			t.Fatalf("live entry %d (of %d, kept from %d) is missing", i, live, minKept)
		case ok && v != entries[key(i)]:
			t.Fatalf("live entry %d changed: %+v, want %+v", i, v, entries[key(i)])
		case i < minKept && ok:
			t.Fatalf("entry %d kept although it expires before entries that were dropped", i)
		}
	}
	for i := live; i < live+expired; i++ {
		if _, ok := after[key(i)]; ok {
			t.Fatalf("expired entry %d was copied", i)
		}
	}
}

// TestCTMapsLayoutChanged replaces a pin whose value layout differs: its
// entries cannot be converted, so the new map starts empty instead of the
// reconciliation failing forever.
func TestCTMapsLayoutChanged(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	old, err := bpf.OpenPinnedMap(nil, &ebpf.MapSpec{Name: bpf.CT4GlobalMap, Type: ebpf.LRUHash,
		KeySize: bpf.CTKey4Size, ValueSize: 48, MaxEntries: 4096}, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Put(ctKey4(1), make([]byte, 48)); err != nil {
		t.Fatal(err)
	}
	old.Close()

	ops := ctNewOps(t, dir)
	got := ctUpdate(t, ops, &tables.CTMap{Name: bpf.CT4GlobalMap, MaxEntries: 4096})
	if got.Pin != "replaced" || got.Change != "value size 48 → 56" || got.Copied != 0 {
		t.Errorf("got %+v", got)
	}
	ctUseMap(t, ops, bpf.CT4GlobalMap, func(m bpf.Map) {
		if n := len(ctReadEntries[bpf.CTKey4](t, m)); n != 0 {
			t.Errorf("%d entries after a layout change, want 0", n)
		}
	})

	a, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: bpf.CTKey4Size, ValueSize: 48, MaxEntries: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	spec, _ := bpf.CTMapSpec(bpf.CT4GlobalMap, 16)
	b, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if _, err := reconcilers.MigrateCT(context.Background(), a, b, 0); !errors.Is(err, reconcilers.ErrCTLayoutChanged) {
		t.Errorf("MigrateCT across layouts: %v, want ErrCTLayoutChanged", err)
	}
}

func TestCTMapsPruneAndDelete(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	ops := ctNewOps(t, dir)
	var rows []*tables.CTMap
	for _, name := range bpf.CTMapNames(true) {
		row := &tables.CTMap{Name: name, MaxEntries: 1024}
		ctUpdate(t, ops, row)
		rows = append(rows, row)
	}

	// IPv6 disabled: only the IPv4 maps are desired.
	desired := func(yield func(*tables.CTMap, uint64) bool) {
		for _, row := range rows[:2] {
			if !yield(row, 0) {
				return
			}
		}
	}
	if err := ops.Prune(context.Background(), nil, desired); err != nil {
		t.Fatal(err)
	}
	for _, name := range bpf.CTMapNames(true) {
		_, err := os.Stat(filepath.Join(dir, name))
		if v6, _ := bpf.CTMapIsIPv6(name); v6 != errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after prune: stat %v", name, err)
		}
	}
	if names := ops.Names(); !slices.Equal(names, []string{bpf.CT4GlobalMap, bpf.CTAny4GlobalMap}) {
		t.Errorf("open after prune: %v", names)
	}
	if err := ops.Use(bpf.CT6GlobalMap, func(bpf.Map) error { return nil }); !errors.Is(err, reconcilers.ErrCTMapNotOpen) {
		t.Errorf("Use of a pruned map: %v, want ErrCTMapNotOpen", err)
	}

	if err := ops.Delete(context.Background(), nil, 0, rows[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, rows[0].Name)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("pin after delete: stat %v", err)
	}
	// Deleting what is gone is no error.
	if err := ops.Delete(context.Background(), nil, 0, rows[0]); err != nil {
		t.Errorf("second delete: %v", err)
	}
}

// TestCTMapsFailedResizeKeepsOld fails a resize (a size the kernel refuses):
// the map already pinned stays in service, entries and all.
func TestCTMapsFailedResizeKeepsOld(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	ops := ctNewOps(t, dir)
	ctUpdate(t, ops, &tables.CTMap{Name: bpf.CT4GlobalMap, MaxEntries: 4096})
	ctUseMap(t, ops, bpf.CT4GlobalMap, func(m bpf.Map) {
		ctWriteEntries(t, m, ctMakeEntries(ctKey4, ctNow(t), 10, 0, 3600))
	})
	ops.Close()

	ops = ctNewOps(t, dir)
	row := &tables.CTMap{Name: bpf.CT4GlobalMap}
	err := ops.Update(context.Background(), nil, 0, row)
	if err == nil || !strings.Contains(err.Error(), "the pinned map of 4096 entries stays in service") {
		t.Fatalf("update with max entries 0: %v", err)
	}
	if row.Pin != "kept" || row.ActualMaxEntries != 4096 {
		t.Errorf("row after a failed resize: %+v", row)
	}
	ctUseMap(t, ops, bpf.CT4GlobalMap, func(m bpf.Map) {
		if n := len(ctReadEntries[bpf.CTKey4](t, m)); m.MaxEntries() != 4096 || n != 10 {
			t.Errorf("map in service: max entries %d, %d entries; want 4096, 10", m.MaxEntries(), n)
		}
	})
}

func TestCTMapsBadRow(t *testing.T) {
	ops := ctNewOps(t, testenv.BPFPinDir(t))
	if err := ops.Update(context.Background(), nil, 0, &tables.CTMap{Name: "lb4_services", MaxEntries: 1024}); err == nil {
		t.Error("Update accepted a map that is no conntrack map")
	}
	if err := ops.Update(context.Background(), nil, 0, &tables.CTMap{Name: bpf.CT4GlobalMap}); err == nil {
		t.Error("Update accepted max entries 0")
	}
}

func TestMigrateCTCancelled(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	ops := ctNewOps(t, dir)
	ctUpdate(t, ops, &tables.CTMap{Name: bpf.CT4GlobalMap, MaxEntries: 4096})
	ctUseMap(t, ops, bpf.CT4GlobalMap, func(m bpf.Map) {
		ctWriteEntries(t, m, ctMakeEntries(ctKey4, ctNow(t), 100, 0, 3600))
	})
	ops.Close()

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := ops.Update(ctx, nil, 0, &tables.CTMap{Name: bpf.CT4GlobalMap, MaxEntries: 8192})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("update with a cancelled context: %v", err)
	}
	// The old map stays pinned, whole.
	m := ctPinnedMap(t, dir, bpf.CT4GlobalMap)
	if m.MaxEntries() != 4096 || len(ctReadEntries[bpf.CTKey4](t, m)) != 100 {
		t.Errorf("after a cancelled resize the pin has max entries %d", m.MaxEntries())
	}
}
