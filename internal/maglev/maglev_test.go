package maglev

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

func names(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("10.244.%d.%d:8080/TCP", i/250, i%250+1)
	}
	return out
}

func TestValidateTableSize(t *testing.T) {
	for _, tt := range []struct {
		m    uint32
		want string
	}{
		{16381, ""}, {251, ""}, {131071, ""}, {65521, ""},
		{16384, "not a prime"}, {1000, "not a prime"}, {7, "out of range"}, {262139, "out of range"},
	} {
		err := ValidateTableSize(tt.m)
		if (tt.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tt.want)) {
			t.Errorf("%d: %v, want %q", tt.m, err, tt.want)
		}
	}
	if _, err := Table(names(3), 1000); err == nil {
		t.Errorf("Table with a size that is no prime: no error")
	}
	if _, err := Table([]string{"a", "b", "a"}, 251); err == nil {
		t.Errorf("Table with a backend twice: no error")
	}
}

// TestAgree: two agents that learnt the same backends in different orders
// (and so gave them different IDs) compute tables that name the same
// backend in every slot.
func TestAgree(t *testing.T) {
	a := names(10)
	b := append([]string(nil), a...)
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(b), func(i, j int) { b[i], b[j] = b[j], b[i] })
	ta, err := Table(a, DefaultTableSize)
	if err != nil {
		t.Fatal(err)
	}
	tb, err := Table(b, DefaultTableSize)
	if err != nil {
		t.Fatal(err)
	}
	for i := range ta {
		if a[ta[i]] != b[tb[i]] {
			t.Fatalf("slot %d: %s on one agent, %s on the other", i, a[ta[i]], b[tb[i]])
		}
	}
}

// TestBalanceAndDisruption: every backend gets about m/N slots; removing
// one moves its own slots and only few others (Maglev's guarantee is
// near-minimal disruption: about 1/N of the flows).
func TestBalanceAndDisruption(t *testing.T) {
	for _, tt := range []struct {
		n int
		m uint32
	}{{3, 251}, {10, DefaultTableSize}, {100, DefaultTableSize}, {1000, 65521}} {
		t.Run(fmt.Sprint(tt.n, "x", tt.m), func(t *testing.T) {
			all := names(tt.n)
			full, err := Table(all, tt.m)
			if err != nil {
				t.Fatal(err)
			}
			per := make([]int, tt.n)
			for _, b := range full {
				per[b]++
			}
			fair := float64(tt.m) / float64(tt.n)
			for i, c := range per {
				if float64(c) < fair*0.5 || float64(c) > fair*1.5 {
					t.Errorf("backend %d has %d slots, fair share %.0f", i, c, fair)
				}
			}
			gone := tt.n / 2
			rest := append(append([]string(nil), all[:gone]...), all[gone+1:]...)
			less, err := Table(rest, tt.m)
			if err != nil {
				t.Fatal(err)
			}
			moved := 0
			for i := range full {
				if all[full[i]] != rest[less[i]] {
					moved++
				}
			}
			frac := float64(moved) / float64(tt.m)
			// Its own share must move; Maglev moves a little more
			// (the paper measures a few percent at these sizes).
			want := 1 / float64(tt.n)
			if frac < want*0.5 || frac > want*1.6+0.01 {
				t.Errorf("removing 1 of %d backends moved %.4f of the slots, want about %.4f", tt.n, frac, want)
			}
			t.Logf("removing 1 of %d moved %.4f of the slots (1/N = %.4f)", tt.n, frac, want)
		})
	}
}

// BenchmarkTable: computing one service's table, by backend count.
func BenchmarkTable(b *testing.B) {
	for _, n := range []int{10, 100, 1000} {
		nm := names(n)
		b.Run(fmt.Sprintf("backends=%d/m=%d", n, DefaultTableSize), func(b *testing.B) {
			for b.Loop() {
				if _, err := Table(nm, DefaultTableSize); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
