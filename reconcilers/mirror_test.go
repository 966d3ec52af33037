package reconcilers

import (
	"errors"
	"fmt"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/memmap"
	"github.com/apiary-net/apiary/internal/testenv"
)

// mirrorConsistent fails the test unless the map holds exactly what the
// mirror's record says.
func mirrorConsistent[K, V comparable](t *testing.T, m *Mirror[K, V], when string) {
	t.Helper()
	got := map[K]V{}
	if err := m.Dump(func(k K, v V) { got[k] = v }); err != nil {
		t.Fatal(err)
	}
	if len(got) != m.Len() {
		t.Errorf("%s: the map holds %d entries, the record %d", when, len(got), m.Len())
	}
	for k, v := range m.All() {
		if w, ok := got[k]; !ok || w != v {
			t.Errorf("%s: %v is %v in the record, %v (present %v) in the map", when, k, v, w, ok)
		}
	}
}

func testMirrorSpec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{Name: "mirror_test", Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: maxEntries}
}

// onEveryMaps runs fn as a subtest on maps in memory and, under root, on
// the kernel's, with a mirror of a map of 64 entries into which n entries
// (seq(1, n)) were written.
func onEveryMaps(t *testing.T, n uint32, fn func(t *testing.T, opener bpf.Opener, dir string, m *Mirror[uint32, uint32], keys, values []uint32)) {
	where := map[string]func(t *testing.T) (bpf.Opener, string){
		"memmap": func(*testing.T) (bpf.Opener, string) { return memmap.NewPins(nil), "/test" },
		"kernel": func(t *testing.T) (bpf.Opener, string) { return bpf.KernelMaps, testenv.BPFPinDir(t) },
	}
	for name, open := range where {
		t.Run(name, func(t *testing.T) {
			opener, dir := open(t)
			m := openTestMirror(t, opener, dir, 64)
			keys, values := seq(1, n)
			m.PutBatch(keys, values, noFailure(t))
			fn(t, opener, dir, m, keys, values)
		})
	}
}

func openTestMirror(t *testing.T, opener bpf.Opener, pinDir string, maxEntries uint32) *Mirror[uint32, uint32] {
	t.Helper()
	m := NewMirror[uint32, uint32]("mirror_test")
	if _, err := m.Open(opener, nil, testMirrorSpec(maxEntries), pinDir, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func seq(from, n uint32) (keys, values []uint32) {
	for i := range n {
		keys, values = append(keys, from+i), append(values, 1000+from+i)
	}
	return keys, values
}

func noFailure(t *testing.T) func(int, error) bool {
	return func(i int, err error) bool {
		t.Errorf("entry %d: %v", i, err)
		return true
	}
}

// TestMirrorRestartWritesNothing: a mirror opened on a map that holds what
// it is asked for writes nothing; a resized map keeps its entries.
func TestMirrorRestartWritesNothing(t *testing.T) {
	onEveryMaps(t, 40, func(t *testing.T, opener bpf.Opener, dir string, m *Mirror[uint32, uint32], keys, values []uint32) {
		if u, _ := m.Writes(); u != 40 {
			t.Fatalf("%d writes, want 40", u)
		}
		m.Close()

		again := openTestMirror(t, opener, dir, 64)
		for i, k := range keys {
			if err := again.Put(k, values[i]); err != nil {
				t.Fatal(err)
			}
		}
		if u, d := again.Writes(); u+d != 0 {
			t.Errorf("restart wrote %d and deleted %d, want nothing", u, d)
		}
		again.Close()

		resized := openTestMirror(t, opener, dir, 128)
		if resized.Len() != 40 {
			t.Errorf("the resized map holds %d entries, want 40", resized.Len())
		}
		mirrorConsistent(t, resized, "after the resize")
	})
}

// TestMirrorFaults: a batch that fails halfway, or a map that fills up,
// leaves the map and the record in agreement, each failed entry with its
// own error.
func TestMirrorFaults(t *testing.T) {
	cases := []struct {
		name   string
		fault  memmap.Fault
		delete bool
		failed int
	}{
		{"write batch fails halfway", memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy, After: 3, Times: 1}, false, 0},
		{"write batch and two writes fail", memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy, After: 2, Times: 3}, false, 2},
		{"map full", memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrFull, After: 5}, false, 5},
		{"delete batch fails halfway", memmap.Fault{Op: memmap.OpDelete, Err: memmap.ErrBusy, After: 4, Times: 1}, true, 0},
		{"delete batch and a delete fail", memmap.Fault{Op: memmap.OpDelete, Err: memmap.ErrBusy, After: 1, Times: 2}, true, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var faulty *memmap.Faulty
			pins := memmap.NewPins(func(_ string, m *memmap.Map) bpf.Map {
				faulty = memmap.NewFaulty(m)
				return faulty
			})
			m := openTestMirror(t, pins, "/test", 64)
			keys, values := seq(1, 10)
			if tc.delete {
				m.PutBatch(keys, values, noFailure(t))
			}
			faulty.Inject(tc.fault)
			var errs []error
			failed := func(i int, err error) bool {
				errs = append(errs, fmt.Errorf("entry %d: %w", i, err))
				return true
			}
			if tc.delete {
				m.DeleteBatch(keys, failed)
			} else {
				m.PutBatch(keys, values, failed)
			}
			if len(errs) != tc.failed {
				t.Errorf("%d entries failed, want %d: %v", len(errs), tc.failed, errors.Join(errs...))
			}
			for _, err := range errs {
				if !errors.Is(err, tc.fault.Err) {
					t.Errorf("%v is not %v", err, tc.fault.Err)
				}
			}
			mirrorConsistent(t, m, "after the faults")
			faulty.Clear()
			if tc.delete {
				m.DeleteBatch(keys, noFailure(t))
			} else {
				m.PutBatch(keys, values, noFailure(t))
			}
			mirrorConsistent(t, m, "after the retry")
			if want := map[bool]int{true: 0, false: 10}[tc.delete]; m.Len() != want {
				t.Errorf("%d entries after the retry, want %d", m.Len(), want)
			}
		})
	}
}

// TestMirrorResync: entries changed, removed or added behind the mirror's
// back are repaired, counted by kind, and a clean map is only read.
func TestMirrorResync(t *testing.T) {
	onEveryMaps(t, 10, func(t *testing.T, _ bpf.Opener, _ string, m *Mirror[uint32, uint32], _, _ []uint32) {
		d, err := NewDrift(nil, prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Resync(d); err != nil {
			t.Fatal(err)
		}
		raw := m.Map()
		for _, err := range []error{raw.Delete(uint32(1)), raw.Delete(uint32(2)), raw.Put(uint32(3), uint32(7)), raw.Put(uint32(50), uint32(7))} {
			if err != nil {
				t.Fatal(err)
			}
		}
		if err := m.Resync(d); err != nil {
			t.Fatal(err)
		}
		for kind, want := range map[string]float64{DriftMissing: 2, DriftChanged: 1, DriftStray: 1} {
			var metric dto.Metric
			if err := d.Counter().WithLabelValues("mirror_test", kind).Write(&metric); err != nil {
				t.Fatal(err)
			}
			if got := metric.GetCounter().GetValue(); got != want {
				t.Errorf("%s: %v repaired, want %v", kind, got, want)
			}
		}
		mirrorConsistent(t, m, "after the resync")
		if u, d := m.Writes(); u != 10 || d != 0 {
			t.Errorf("the record counts %d writes and %d deletes, want the 10 writes (repairs are the drift's)", u, d)
		}
	})
}

// TestCopyFitting: a migration into a smaller map keeps what fits and
// counts the rest; CopyEntries calls that an error.
func TestCopyFitting(t *testing.T) {
	src, dst := memmap.New(testMirrorSpec(64)), memmap.New(testMirrorSpec(6))
	keys, values := seq(1, 10)
	if _, err := src.BatchUpdate(keys, values, nil); err != nil {
		t.Fatal(err)
	}
	left, err := bpf.CopyFitting[uint32, uint32](src, dst)
	if err != nil || left != 4 || dst.Len() != 6 {
		t.Errorf("copy: %d left out, %d copied, %v; want 4, 6, no error", left, dst.Len(), err)
	}
	faulty := memmap.NewFaulty(memmap.New(testMirrorSpec(64)))
	faulty.Inject(memmap.Fault{Op: memmap.OpWrite, Err: unix.EPERM, After: 2})
	if _, err := bpf.CopyFitting[uint32, uint32](src, faulty); !errors.Is(err, unix.EPERM) {
		t.Errorf("copy into a failing map: %v, want EPERM", err)
	}
}
