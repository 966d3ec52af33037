package reconcilers

import "testing"

// TestSlab: a slab hands out distinct zero values, beyond one chunk too;
// reset zeroes them and hands them out again, and keeps at most
// keepChunks chunks.
func TestSlab(t *testing.T) {
	for _, n := range []int{1, slabChunk, slabChunk + 1, (keepChunks + 2) * slabChunk} {
		var s slab[lbOp]
		for round := range 2 {
			seen := map[*lbOp]bool{}
			for i := range n {
				op := s.get()
				if seen[op] {
					t.Fatalf("n=%d round %d: value %d handed out twice", n, round, i)
				}
				seen[op] = true
				if op.id != 0 {
					t.Fatalf("n=%d round %d: value %d not zero (id %d)", n, round, i, op.id)
				}
				op.id = uint32(i + 1)
			}
			s.reset()
			if len(s.chunks) > keepChunks {
				t.Fatalf("n=%d: %d chunks kept, want at most %d", n, len(s.chunks), keepChunks)
			}
			for _, c := range s.chunks {
				for i := range c {
					if c[i].id != 0 {
						t.Fatalf("n=%d: reset left a value", n)
					}
				}
			}
		}
	}
}

// TestWantBuf: the plans' want lists carved from one run never overlap,
// and appending past what was asked for leaves the neighbour alone.
func TestWantBuf(t *testing.T) {
	r := (&LB{}).newRun()
	defer r.release()
	a := r.wantBuf(2)
	b := r.wantBuf(3)
	b = append(b, 7, 8, 9)
	a = append(a, 1, 2, 3) // past its room: reallocated
	if b[0] != 7 || len(b) != 3 {
		t.Fatalf("b = %v, want [7 8 9]", b)
	}
	if a[0] != 1 || a[2] != 3 {
		t.Fatalf("a = %v, want [1 2 3]", a)
	}
}
