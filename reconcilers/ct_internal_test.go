package reconcilers

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
)

func TestCTLRUBudget(t *testing.T) {
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	headroom := uint32(lruLocalFree * cpus)
	cases := []struct {
		maxEntries, want uint32
	}{
		{1 << 20, 1<<20 - headroom},
		{1 << 24, 1<<24 - headroom},
		// Small maps keep at least three quarters of their room.
		{1024, 1024 - min(headroom, 256)},
		{4, 3},
	}
	for _, c := range cases {
		if got := lruBudget(c.maxEntries); got != c.want {
			t.Errorf("lruBudget(%d) = %d, want %d (%d possible CPUs)", c.maxEntries, got, c.want, cpus)
		}
	}
}

func TestCTCompactLive(t *testing.T) {
	keys := []int{0, 1, 2, 3, 4, 5}
	values := []bpf.CTEntry{{Lifetime: 9}, {Lifetime: 10}, {Lifetime: 11}, {Lifetime: 5}, {Lifetime: 100}, {Lifetime: 0}}
	n := compactLive(keys, values, 10)
	if n != 3 || keys[0] != 1 || keys[1] != 2 || keys[2] != 4 ||
		values[0].Lifetime != 10 || values[1].Lifetime != 11 || values[2].Lifetime != 100 {
		t.Errorf("compactLive = %d, keys %v, values %+v", n, keys[:n], values[:n])
	}
}
