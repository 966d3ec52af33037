package memmap_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/memmap"
	"github.com/apiary-net/apiary/internal/testenv"
)

type key struct {
	A uint32
	B uint16
	_ [2]byte
}

func spec(typ ebpf.MapType) *ebpf.MapSpec {
	return &ebpf.MapSpec{Name: "test", Type: typ, KeySize: 8, ValueSize: 4, MaxEntries: 4}
}

// script is what is done to a map, written as the results a user of the
// map sees; each map implementation must give the same.
func script(m bpf.Map) []string {
	var out []string
	say := func(what string, err error) {
		switch {
		case err == nil:
			out = append(out, what+": ok")
		case errors.Is(err, ebpf.ErrKeyNotExist):
			out = append(out, what+": no key")
		case errors.Is(err, unix.E2BIG), errors.Is(err, unix.ENOSPC):
			out = append(out, what+": full")
		case errors.Is(err, unix.EEXIST):
			out = append(out, what+": exists")
		default:
			out = append(out, fmt.Sprintf("%s: %v", what, err))
		}
	}
	say("put 1", m.Put(key{A: 1}, uint32(10)))
	say("put 2", m.Put(&key{A: 2}, new(uint32(20))))
	say("update 2 noexist", m.Update(key{A: 2}, uint32(21), ebpf.UpdateNoExist))
	say("update 3 exist", m.Update(key{A: 3}, uint32(30), ebpf.UpdateExist))
	var v uint32
	say(fmt.Sprintf("lookup 2 (%d)", func() uint32 { m.Lookup(key{A: 2}, &v); return v }()), nil)
	say("lookup 9", m.Lookup(key{A: 9}, &v))
	say("delete 9", m.Delete(key{A: 9}))
	n, err := m.BatchUpdate([]key{{A: 3}, {A: 4}, {A: 5}}, []uint32{30, 40, 50}, nil)
	say(fmt.Sprintf("batch update 3 4 5 (%d done)", n), err)
	say("put 1 again (full map, key exists)", m.Put(key{A: 1}, uint32(11)))
	n, err = m.BatchDelete([]key{{A: 3}, {A: 9}, {A: 4}}, nil)
	say(fmt.Sprintf("batch delete 3 9 4 (%d done)", n), err)
	say("put wrong size", m.Put(uint16(1), uint32(1)))
	var all []string
	err = bpf.Walk(m, 16, func(keys []key, values []uint32) error {
		for i, k := range keys {
			all = append(all, fmt.Sprintf("%d=%d", k.A, values[i]))
		}
		return nil
	})
	slices.Sort(all)
	say(fmt.Sprintf("walk %v", all), err)
	return out
}

// The map in memory answers as the kernel's hash map does (compared when
// the test may create kernel maps).
func TestMapAnswersAsTheKernel(t *testing.T) {
	got := script(memmap.New(spec(ebpf.Hash)))
	want := []string{
		"put 1: ok",
		"put 2: ok",
		"update 2 noexist: exists",
		"update 3 exist: no key",
		"lookup 2 (20): ok",
		"lookup 9: no key",
		"delete 9: no key",
		"batch update 3 4 5 (2 done): full",
		"put 1 again (full map, key exists): ok",
		"batch delete 3 9 4 (1 done): no key",
		"put wrong size: ", // an EINVAL of either kind
		"walk [1=11 2=20 4=40]: ok",
	}
	check := func(t *testing.T, name string, got []string) {
		t.Helper()
		for i := range want {
			if i >= len(got) || got[i] != want[i] && !(want[i] == "put wrong size: " && len(got[i]) > len(want[i])) {
				t.Errorf("%s:\n got %q\nwant %q", name, got, want)
				return
			}
		}
	}
	check(t, "memory", got)
	t.Run("kernel", func(t *testing.T) {
		testenv.RequireRoot(t)
		km, err := ebpf.NewMap(spec(ebpf.Hash))
		if err != nil {
			testenv.Skip(t, "create a BPF map: "+err.Error())
		}
		defer km.Close()
		check(t, "kernel", script(km))
	})
}

func TestLPMTrieFullIsENOSPC(t *testing.T) {
	s := spec(ebpf.LPMTrie)
	s.MaxEntries = 1
	m := memmap.New(s)
	if err := m.Put(key{A: 1}, uint32(1)); err != nil {
		t.Fatal(err)
	}
	if err := m.Put(key{A: 2}, uint32(2)); !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("second put into a trie of one: %v, want ENOSPC", err)
	}
}

func TestFaultyFailsHalfwayThroughABatch(t *testing.T) {
	m := memmap.New(spec(ebpf.Hash))
	f := memmap.NewFaulty(m)
	f.Inject(memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy, After: 1, Times: 1})
	n, err := f.BatchUpdate([]key{{A: 1}, {A: 2}}, []uint32{1, 2}, nil)
	if n != 1 || !errors.Is(err, unix.EBUSY) {
		t.Fatalf("batch with a fault after 1: %d, %v; want 1, EBUSY", n, err)
	}
	if m.Len() != 1 {
		t.Fatalf("the map holds %d entries, want the 1 written before the fault", m.Len())
	}
	// Used up: the next batch goes through.
	if n, err := f.BatchUpdate([]key{{A: 2}}, []uint32{2}, nil); n != 1 || err != nil {
		t.Fatalf("batch after the fault: %d, %v", n, err)
	}
	f.Inject(memmap.Fault{Op: memmap.OpDelete, Err: memmap.ErrFull})
	for range 2 {
		if err := f.Delete(key{A: 1}); !errors.Is(err, unix.E2BIG) {
			t.Fatalf("delete under a lasting fault: %v", err)
		}
	}
	if f.Failed() != 3 {
		t.Errorf("%d operations failed, want 3", f.Failed())
	}
	f.Clear()
	if err := f.Delete(key{A: 1}); err != nil {
		t.Fatalf("delete after Clear: %v", err)
	}
}

func TestPinsKeepContentsAcrossOpens(t *testing.T) {
	var p memmap.Pins
	s := spec(ebpf.Hash)
	om, err := p.OpenMap(nil, s, "/x", nil)
	if err != nil || om.Outcome != bpf.PinCreated {
		t.Fatalf("first open: %v, %v", om, err)
	}
	if err := om.Put(key{A: 1}, uint32(1)); err != nil {
		t.Fatal(err)
	}
	om.Close()
	om, err = p.OpenMap(nil, s, "/x", nil)
	if err != nil || om.Outcome != bpf.PinReused || p.Get("/x/test").Len() != 1 {
		t.Fatalf("second open: %+v, %v", om, err)
	}
	// A resize keeps what the migration copies, as the kernel's pins do.
	bigger := s.Copy()
	bigger.MaxEntries = 8
	om, err = p.OpenMap(nil, bigger, "/x", bpf.CopyEntries[key, uint32])
	if err != nil || om.Outcome != bpf.PinReplaced || om.Mismatch != "max entries 4 → 8" || p.Get("/x/test").Len() != 1 {
		t.Fatalf("open with more entries: %+v, %v", om, err)
	}
	// A failed migration leaves the old map pinned.
	failing := func(_, _ bpf.Map) error { return errors.New("no") }
	if _, err := p.OpenMap(nil, s, "/x", failing); err == nil || p.Get("/x/test").MaxEntries() != 8 {
		t.Fatalf("failed migration: %v, the pin has %d entries", err, p.Get("/x/test").MaxEntries())
	}
	// Without a migration nothing is kept.
	om, err = p.OpenMap(nil, s, "/x", nil)
	if err != nil || om.Outcome != bpf.PinReplaced || p.Get("/x/test").Len() != 0 {
		t.Fatalf("resize without migration: %+v, %v", om, err)
	}
	if err := p.RemoveMap("/x", "test"); err != nil || p.Get("/x/test") != nil {
		t.Fatalf("remove: %v", err)
	}
	if _, err := p.LoadMap("/x", "test"); err == nil {
		t.Fatal("load of a removed map succeeded")
	}
}

// A map of maps and an array in memory answer their users as the
// kernel's do: bpf.PutInner stores a new map under a key (a lookup reads
// its ID), the Faulty wrapper passes it on, and an array's entries exist
// from the start, zero.
func TestMapsOfMapsAndArrays(t *testing.T) {
	inner := &ebpf.MapSpec{Name: "inner", Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 2}
	outer := &ebpf.MapSpec{Name: "outer", Type: ebpf.HashOfMaps, KeySize: 4, ValueSize: 4, MaxEntries: 2, InnerMap: inner}
	array := &ebpf.MapSpec{Name: "counters", Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: 8, MaxEntries: 2}
	run := func(t *testing.T, outer, array bpf.Map) {
		t.Helper()
		if ok, err := bpf.HasInner(outer, uint32(1)); ok || err != nil {
			t.Fatalf("empty map of maps: %v, %v", ok, err)
		}
		if err := bpf.PutInner(outer, uint32(1), inner); err != nil {
			t.Fatal(err)
		}
		var first uint32
		if err := outer.Lookup(uint32(1), &first); err != nil || first == 0 {
			t.Fatalf("lookup of the inner map's ID: %d, %v", first, err)
		}
		if err := bpf.PutInner(outer, uint32(1), inner); err != nil {
			t.Fatal(err)
		}
		if ok, err := bpf.HasInner(outer, uint32(1)); !ok || err != nil {
			t.Fatalf("after PutInner: %v, %v", ok, err)
		}
		var second uint32
		if outer.Lookup(uint32(1), &second); second == first {
			t.Error("PutInner kept the map it replaces")
		}
		counts := make([]uint64, 2)
		if err := bpf.SumPerCPU(array, "counters", counts); err != nil || counts[0] != 0 || counts[1] != 0 {
			t.Errorf("counters of a new array: %v, %v", counts, err)
		}
		if err := bpf.SumPerCPU(array, "counters", make([]uint64, 3)); err == nil {
			t.Error("an index past the array's end: no error")
		}
	}
	t.Run("memory", func(t *testing.T) {
		m := memmap.New(outer)
		run(t, memmap.NewFaulty(m), memmap.New(array))
		if m.Inner(uint32(1)) == nil || m.Inner(uint32(2)) != nil {
			t.Error("Inner does not return the map stored")
		}
	})
	t.Run("kernel", func(t *testing.T) {
		testenv.RequireRoot(t)
		km, err := ebpf.NewMap(outer)
		if err != nil {
			testenv.Skip(t, "create a BPF map: "+err.Error())
		}
		defer km.Close()
		ka, err := ebpf.NewMap(array)
		if err != nil {
			testenv.Skip(t, "create a BPF map: "+err.Error())
		}
		defer ka.Close()
		run(t, km, ka)
	})
}
