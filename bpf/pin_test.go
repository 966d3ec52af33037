package bpf_test

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// lpmKey is an IPv4 LPM trie key: prefix length in host order, address in
// network order.
type lpmKey struct {
	Prefixlen uint32
	Addr      [4]byte
}

// mapKind is a kind of map the agent pins, with what a test needs to put
// entries into it and copy them over.
type mapKind struct {
	name    string
	spec    func(maxEntries uint32) *ebpf.MapSpec
	key     func(i uint32) any
	migrate bpf.MigrateFunc
}

var mapKinds = []mapKind{
	{
		name: "hash",
		spec: func(n uint32) *ebpf.MapSpec {
			return &ebpf.MapSpec{Name: "test_map", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: n}
		},
		key:     func(i uint32) any { return i },
		migrate: bpf.CopyEntries[uint32, uint64],
	},
	{
		name: "lru_hash",
		spec: func(n uint32) *ebpf.MapSpec {
			return &ebpf.MapSpec{Name: "test_map", Type: ebpf.LRUHash, KeySize: 4, ValueSize: 8, MaxEntries: n}
		},
		key:     func(i uint32) any { return i },
		migrate: bpf.CopyEntries[uint32, uint64],
	},
	{
		name: "lpm_trie",
		spec: func(n uint32) *ebpf.MapSpec {
			return &ebpf.MapSpec{Name: "test_map", Type: ebpf.LPMTrie, KeySize: 8, ValueSize: 8, MaxEntries: n,
				Flags: unix.BPF_F_NO_PREALLOC}
		},
		key: func(i uint32) any {
			return lpmKey{Prefixlen: 32, Addr: [4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}}
		},
		migrate: bpf.CopyEntries[lpmKey, uint64],
	},
}

func TestOpenPinnedMapCreateThenReuse(t *testing.T) {
	type tc struct {
		name string
		spec *ebpf.MapSpec
		key  any // nil: the map cannot be written from user space
	}
	var cases []tc
	for _, k := range mapKinds {
		cases = append(cases, tc{k.name, k.spec(1024), k.key(7)})
	}
	cases = append(cases,
		tc{"hash_no_prealloc", &ebpf.MapSpec{Name: "test_map", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 1024,
			Flags: unix.BPF_F_NO_PREALLOC}, uint32(7)},
		tc{"lru_hash_no_common_lru", &ebpf.MapSpec{Name: "test_map", Type: ebpf.LRUHash, KeySize: 4, ValueSize: 8, MaxEntries: 1024,
			Flags: unix.BPF_F_NO_COMMON_LRU}, uint32(7)},
		// The kernel does not keep BPF_F_RDONLY with the map, so the pin
		// reports flags 0; that must not count as a mismatch.
		tc{"hash_rdonly", &ebpf.MapSpec{Name: "test_map", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 1024,
			Flags: unix.BPF_F_RDONLY}, nil},
		// The kernel adds BPF_F_RDONLY_PROG to device maps.
		tc{"devmap", &ebpf.MapSpec{Name: "test_map", Type: ebpf.DevMap, KeySize: 4, ValueSize: 4, MaxEntries: 4}, nil},
		// The library fills in the zero fields of a perf event array.
		tc{"perf_event_array", &ebpf.MapSpec{Name: "test_map", Type: ebpf.PerfEventArray}, nil},
	)

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := testenv.BPFPinDir(t)
			path := filepath.Join(dir, c.spec.Name)

			pm, err := bpf.OpenPinnedMap(nil, c.spec, dir, nil)
			if err != nil {
				t.Fatalf("create: %v", err)
			}
			if pm.Outcome != bpf.PinCreated || pm.Path != path || pm.Mismatch != "" {
				t.Errorf("create: got outcome %v, path %q, mismatch %q; want created, %q, empty",
					pm.Outcome, pm.Path, pm.Mismatch, path)
			}
			if _, err := os.Stat(path); err != nil {
				t.Errorf("pin after create: %v", err)
			}
			if c.key != nil {
				if err := pm.Put(c.key, uint64(42)); err != nil {
					t.Fatalf("put: %v", err)
				}
			}
			id := mapIDOf(t, pm.Map)
			pm.Close()

			pm, err = bpf.OpenPinnedMap(nil, c.spec, dir, nil)
			if err != nil {
				t.Fatalf("reopen: %v", err)
			}
			defer pm.Close()
			if pm.Outcome != bpf.PinReused || pm.Mismatch != "" {
				t.Errorf("reopen: got outcome %v, mismatch %q; want reused, empty", pm.Outcome, pm.Mismatch)
			}
			if got := mapIDOf(t, pm.Map); got != id {
				t.Errorf("reopen: map ID %d, want the pinned map's ID %d", got, id)
			}
			if c.key != nil {
				var v uint64
				if err := pm.Lookup(c.key, &v); err != nil || v != 42 {
					t.Errorf("reopen: lookup = %d, %v; want 42, nil", v, err)
				}
			}
		})
	}
}

func TestOpenPinnedMapReplace(t *testing.T) {
	base := func() *ebpf.MapSpec {
		return &ebpf.MapSpec{Name: "test_map", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 1024}
	}
	cases := []struct {
		name     string
		change   func(*ebpf.MapSpec)
		mismatch string
	}{
		{"max_entries", func(s *ebpf.MapSpec) { s.MaxEntries = 2048 }, "max entries 1024 → 2048"},
		{"value_size", func(s *ebpf.MapSpec) { s.ValueSize = 16 }, "value size 8 → 16"},
		{"key_size", func(s *ebpf.MapSpec) { s.KeySize = 8 }, "key size 4 → 8"},
		{"type", func(s *ebpf.MapSpec) { s.Type = ebpf.LRUHash }, "type Hash → LRUHash"},
		{"flags", func(s *ebpf.MapSpec) { s.Flags = unix.BPF_F_NO_PREALLOC }, "flags 0x0 → 0x1"},
		{"several", func(s *ebpf.MapSpec) { s.ValueSize, s.MaxEntries = 16, 4096 },
			"value size 8 → 16, max entries 1024 → 4096"},
	}

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := testenv.BPFPinDir(t)
			path := filepath.Join(dir, "test_map")

			old, err := bpf.OpenPinnedMap(nil, base(), dir, nil)
			if err != nil {
				t.Fatalf("create: %v", err)
			}
			if err := old.Put(uint32(7), uint64(42)); err != nil {
				t.Fatalf("put: %v", err)
			}
			oldID := mapIDOf(t, old.Map)
			old.Close()

			spec := base()
			c.change(spec)
			pm, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
			if err != nil {
				t.Fatalf("reopen with changed spec: %v", err)
			}
			if pm.Outcome != bpf.PinReplaced || pm.Mismatch != c.mismatch {
				t.Errorf("got outcome %v, mismatch %q; want replaced, %q", pm.Outcome, pm.Mismatch, c.mismatch)
			}
			if mapIDOf(t, pm.Map) == oldID {
				t.Errorf("returned map is still the old one (ID %d)", oldID)
			}
			if pm.MaxEntries() != spec.MaxEntries || pm.ValueSize() != spec.ValueSize || pm.Type() != spec.Type {
				t.Errorf("returned map has type %s, value size %d, max entries %d; want the spec's",
					pm.Type(), pm.ValueSize(), pm.MaxEntries())
			}
			if n := countEntries(t, pm.Map); n != 0 {
				t.Errorf("replaced map without migrate holds %d entries, want 0", n)
			}
			assertNoTempPin(t, path)

			// The pin now holds the new map: the next open reuses it.
			again, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
			if err != nil {
				t.Fatalf("open after replace: %v", err)
			}
			if again.Outcome != bpf.PinReused || mapIDOf(t, again.Map) != mapIDOf(t, pm.Map) {
				t.Errorf("open after replace: outcome %v, want reused with the same map", again.Outcome)
			}
			again.Close()

			// The returned map knows where it is pinned, although it was
			// pinned under the temporary name and renamed.
			if !pm.IsPinned() {
				t.Error("replaced map reports not pinned")
			}
			if err := pm.Unpin(); err != nil {
				t.Fatalf("unpin: %v", err)
			}
			if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("pin still present after Unpin of the replaced map (stat: %v)", err)
			}
			pm.Close()
		})
	}
}

func TestOpenPinnedMapMigrate(t *testing.T) {
	// An LRU hash can evict before it is full (its free elements sit in
	// per-CPU lists), so stay well below capacity for the entry count to be
	// exact.
	const entries = 1000
	for _, k := range mapKinds {
		t.Run(k.name, func(t *testing.T) {
			dir := testenv.BPFPinDir(t)
			path := filepath.Join(dir, "test_map")

			old, err := bpf.OpenPinnedMap(nil, k.spec(4096), dir, nil)
			if err != nil {
				t.Fatalf("create: %v", err)
			}
			for i := range uint32(entries) {
				if err := old.Put(k.key(i), uint64(i)+1); err != nil {
					t.Fatalf("put %d: %v", i, err)
				}
			}
			old.Close()

			migrated := false
			migrate := func(oldMap, newMap bpf.Map) error {
				migrated = true
				// Migration runs while the old map still is the pin, so a
				// crash now leaves it in place.
				if _, err := os.Stat(path); err != nil {
					t.Errorf("during migration: old pin: %v", err)
				}
				if _, err := os.Stat(path + "_new"); err != nil {
					t.Errorf("during migration: temporary pin: %v", err)
				}
				return k.migrate(oldMap, newMap)
			}
			pm, err := bpf.OpenPinnedMap(nil, k.spec(8192), dir, migrate)
			if err != nil {
				t.Fatalf("reopen with more max entries: %v", err)
			}
			defer pm.Close()
			if !migrated {
				t.Error("migrate was not called")
			}
			if want := "max entries 4096 → 8192"; pm.Outcome != bpf.PinReplaced || pm.Mismatch != want {
				t.Errorf("got outcome %v, mismatch %q; want replaced, %q", pm.Outcome, pm.Mismatch, want)
			}
			if pm.MaxEntries() != 8192 {
				t.Errorf("max entries %d, want 8192", pm.MaxEntries())
			}
			for i := range uint32(entries) {
				var v uint64
				if err := pm.Lookup(k.key(i), &v); err != nil || v != uint64(i)+1 {
					t.Fatalf("entry %d after migration: %d, %v; want %d, nil", i, v, err, i+1)
				}
			}
			if n := countEntries(t, pm.Map); n != entries {
				t.Errorf("migrated map holds %d entries, want %d", n, entries)
			}
			assertNoTempPin(t, path)
		})
	}
}

func TestOpenPinnedMapMigrateError(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	path := filepath.Join(dir, "test_map")
	spec := &ebpf.MapSpec{Name: "test_map", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 1024}

	old, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if err := old.Put(uint32(7), uint64(42)); err != nil {
		t.Fatalf("put: %v", err)
	}
	oldID := mapIDOf(t, old.Map)
	old.Close()

	errMigrate := errors.New("migration failed")
	bigger := spec.Copy()
	bigger.MaxEntries = 2048
	_, err = bpf.OpenPinnedMap(nil, bigger, dir, func(_, _ bpf.Map) error { return errMigrate })
	if !errors.Is(err, errMigrate) {
		t.Fatalf("got error %v, want one wrapping the migration error", err)
	}
	if !strings.Contains(err.Error(), "max entries 1024 → 2048") {
		t.Errorf("error %q does not say what changed", err)
	}
	assertNoTempPin(t, path)

	m, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		t.Fatalf("old pin after failed migration: %v", err)
	}
	defer m.Close()
	if got := mapIDOf(t, m); got != oldID {
		t.Errorf("pin holds map ID %d after failed migration, want the old %d", got, oldID)
	}
	var v uint64
	if err := m.Lookup(uint32(7), &v); err != nil || v != 42 {
		t.Errorf("old entry after failed migration: %d, %v; want 42, nil", v, err)
	}
}

func TestOpenPinnedMapStaleTempPin(t *testing.T) {
	spec := &ebpf.MapSpec{Name: "test_map", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 1024}
	bigger := spec.Copy()
	bigger.MaxEntries = 2048

	cases := []struct {
		name    string
		hasPin  bool          // whether a good pin exists next to the stale one
		open    *ebpf.MapSpec // the spec of the open after the crash
		outcome bpf.PinOutcome
	}{
		{"reuse", true, spec, bpf.PinReused},
		{"replace", true, bigger, bpf.PinReplaced},
		{"create", false, spec, bpf.PinCreated},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := testenv.BPFPinDir(t)
			path := filepath.Join(dir, "test_map")

			var oldID ebpf.MapID
			if c.hasPin {
				old, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
				if err != nil {
					t.Fatalf("create: %v", err)
				}
				if err := old.Put(uint32(7), uint64(42)); err != nil {
					t.Fatalf("put: %v", err)
				}
				oldID = mapIDOf(t, old.Map)
				old.Close()
			}

			// A replacement that crashed before its rename: pinned under the
			// temporary name, with some of the entries migrated.
			stale, err := ebpf.NewMap(bigger)
			if err != nil {
				t.Fatal(err)
			}
			if err := stale.Put(uint32(8), uint64(43)); err != nil {
				t.Fatal(err)
			}
			if err := stale.Pin(path + "_new"); err != nil {
				t.Fatal(err)
			}
			staleID := mapIDOf(t, stale)
			stale.Close()

			pm, err := bpf.OpenPinnedMap(nil, c.open, dir, nil)
			if err != nil {
				t.Fatalf("open after crash: %v", err)
			}
			defer pm.Close()
			if pm.Outcome != c.outcome {
				t.Errorf("got outcome %v, want %v", pm.Outcome, c.outcome)
			}
			assertNoTempPin(t, path)
			id := mapIDOf(t, pm.Map)
			if id == staleID {
				t.Error("the stale temporary map was put in place")
			}
			if c.outcome == bpf.PinReused {
				var v uint64
				if id != oldID {
					t.Errorf("map ID %d, want the good pin's %d", id, oldID)
				}
				if err := pm.Lookup(uint32(7), &v); err != nil || v != 42 {
					t.Errorf("entry of the good pin: %d, %v; want 42, nil", v, err)
				}
			}
		})
	}
}

func TestOpenPinnedMapBadName(t *testing.T) {
	cases := []struct {
		name, mapName, errText string
	}{
		{"dot", "lb4.services", "dot"},
		{"slash", "lb4/services", "slash"},
		{"empty", "", "no name"},
		{"reserved_suffix", "lb4_services_new", "reserved"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir() // never reached: the name is checked first
			spec := &ebpf.MapSpec{Name: c.mapName, Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 16}
			_, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
			if err == nil || !strings.Contains(err.Error(), c.errText) {
				t.Errorf("got error %v, want one about %q", err, c.errText)
			}
			if err := bpf.RemovePinnedMap(dir, c.mapName); err == nil {
				t.Error("RemovePinnedMap accepted the name")
			}
		})
	}
}

// TestBPFFSRefusesDots checks the kernel behaviour that OpenPinnedMap's name
// check exists for, so that a kernel that changes it is noticed.
func TestBPFFSRefusesDots(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(filepath.Join(dir, "with.dot")); !errors.Is(err, unix.EPERM) {
		t.Errorf("pinning a name with a dot: got %v, want EPERM", err)
	}
}

func TestOpenPinnedMapNotOnBPFFS(t *testing.T) {
	dir := t.TempDir()
	spec := &ebpf.MapSpec{Name: "test_map", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 16}
	_, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
	if err == nil || !strings.Contains(err.Error(), "not on bpffs") {
		t.Errorf("got error %v, want one saying the directory is not on bpffs", err)
	}
}

func TestOpenPinnedMapCreatesPinDir(t *testing.T) {
	dir := filepath.Join(testenv.BPFPinDir(t), "a", "b")
	spec := &ebpf.MapSpec{Name: "test_map", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 16}
	pm, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pm.Close()
	if _, err := os.Stat(filepath.Join(dir, "test_map")); err != nil {
		t.Errorf("pin: %v", err)
	}
}

func TestRemovePinnedMap(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	path := filepath.Join(dir, "test_map")
	spec := &ebpf.MapSpec{Name: "test_map", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 16}
	pm, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pm.Close()
	// A leftover of an interrupted replacement goes too.
	if err := pm.Pin(path + "_new"); err != nil {
		t.Fatal(err)
	}

	if err := bpf.RemovePinnedMap(dir, "test_map"); err != nil {
		t.Fatalf("remove: %v", err)
	}
	for _, p := range []string{path, path + "_new"} {
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s still present after remove (stat: %v)", p, err)
		}
	}
	if err := bpf.RemovePinnedMap(dir, "test_map"); err != nil {
		t.Errorf("removing an absent pin: %v", err)
	}
}

func TestPinOutcomeString(t *testing.T) {
	for o, want := range map[bpf.PinOutcome]string{
		bpf.PinCreated:  "created",
		bpf.PinReused:   "reused",
		bpf.PinReplaced: "replaced",
		0:               "PinOutcome(0)",
	} {
		if got := o.String(); got != want {
			t.Errorf("PinOutcome(%d).String() = %q, want %q", int(o), got, want)
		}
	}
}

func mapIDOf(t *testing.T, m *ebpf.Map) ebpf.MapID {
	t.Helper()
	info, err := m.Info()
	if err != nil {
		t.Fatalf("map info: %v", err)
	}
	id, ok := info.ID()
	if !ok {
		t.Fatal("kernel does not report map IDs")
	}
	return id
}

func countEntries(t *testing.T, m *ebpf.Map) int {
	t.Helper()
	n := 0
	var key, value []byte
	it := m.Iterate()
	for it.Next(&key, &value) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatalf("iterate: %v", err)
	}
	return n
}

func assertNoTempPin(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Stat(path + "_new"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("temporary pin %s_new left behind (stat: %v)", path, err)
	}
}

// TestOpenPinnedMapOtherLayout pins a map of another key size, value size or
// type, as an older agent or another program may have left: a migration
// written for the spec's types cannot read it, so it is refused with an
// error saying what differs and what to do, and the pin is left alone,
// unless the caller asks for it to be replaced.
func TestOpenPinnedMapOtherLayout(t *testing.T) {
	want := func() *ebpf.MapSpec {
		return &ebpf.MapSpec{Name: "test_map", Type: ebpf.Hash, KeySize: 12, ValueSize: 8, MaxEntries: 1024}
	}
	cases := []struct {
		name   string
		pinned func(*ebpf.MapSpec)
		diffs  string
	}{
		{"key_size", func(s *ebpf.MapSpec) { s.KeySize = 8 }, "key size 8, want 12"},
		{"value_size", func(s *ebpf.MapSpec) { s.ValueSize = 16; s.MaxEntries = 64 }, "value size 16, want 8"},
		{"type", func(s *ebpf.MapSpec) { s.Type = ebpf.LRUHash }, "type LRUHash, want Hash"},
		{"several", func(s *ebpf.MapSpec) { s.KeySize, s.ValueSize = 8, 4 }, "key size 8, want 12; value size 4, want 8"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := testenv.BPFPinDir(t)
			path := filepath.Join(dir, "test_map")
			spec := want()
			c.pinned(spec)
			old, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
			if err != nil {
				t.Fatal(err)
			}
			oldID := mapIDOf(t, old.Map)
			old.Close()

			migrated := false
			migrate := func(_, _ bpf.Map) error { migrated = true; return errors.New("buffer too small") }
			_, err = bpf.OpenPinnedMap(nil, want(), dir, migrate)
			var layoutErr *bpf.LayoutError
			if !errors.As(err, &layoutErr) {
				t.Fatalf("got %v, want a LayoutError", err)
			}
			wantMsg := "pinned map test_map has " + c.diffs + ": its entries cannot be converted; remove it (rm " +
				path + ") to have an empty one created, or use another pin directory"
			if err.Error() != wantMsg {
				t.Errorf("got  %q\nwant %q", err, wantMsg)
			}
			if migrated {
				t.Error("migrate was called for a pin of another layout")
			}
			assertNoTempPin(t, path)
			m, err := ebpf.LoadPinnedMap(path, nil)
			if err != nil {
				t.Fatal(err)
			}
			if mapIDOf(t, m) != oldID {
				t.Error("the refused pin was replaced")
			}
			if err := bpf.CheckLayoutOf(m, want(), path); err == nil || err.Error() != wantMsg {
				t.Errorf("CheckLayoutOf: %v, want %q", err, wantMsg)
			}
			if err := bpf.CheckLayoutOf(m, spec, path); err != nil {
				t.Errorf("CheckLayoutOf with the pin's own spec: %v", err)
			}
			m.Close()

			// Asked to, OpenPinnedMap replaces it, through migrate.
			pm, err := bpf.OpenPinnedMap(nil, want(), dir, func(_, _ bpf.Map) error { migrated = true; return nil },
				bpf.ReplaceOtherLayout)
			if err != nil {
				t.Fatal(err)
			}
			defer pm.Close()
			if !migrated || pm.Outcome != bpf.PinReplaced || pm.KeySize() != 12 || pm.ValueSize() != 8 || pm.Type() != ebpf.Hash {
				t.Errorf("with ReplaceOtherLayout: migrated %v, outcome %v, %s %d/%d", migrated, pm.Outcome,
					pm.Type(), pm.KeySize(), pm.ValueSize())
			}
		})
	}

	// Another size alone is no layout change: the migration copies.
	t.Run("max_entries", func(t *testing.T) {
		dir := testenv.BPFPinDir(t)
		spec := want()
		spec.MaxEntries = 16
		old, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
		if err != nil {
			t.Fatal(err)
		}
		old.Close()
		pm, err := bpf.OpenPinnedMap(nil, want(), dir, func(_, _ bpf.Map) error { return nil })
		if err != nil {
			t.Fatal(err)
		}
		pm.Close()
		if pm.Outcome != bpf.PinReplaced {
			t.Errorf("outcome %v, want replaced", pm.Outcome)
		}
	})
}
