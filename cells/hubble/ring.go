package hubble

import (
	"sync"

	flowpb "github.com/cilium/cilium/api/v1/flow"
)

// ring is the bounded store of the most recent flows. Writing never waits
// for a reader: a reader that falls more than the capacity behind finds
// its flows overwritten and is told how many it lost.
type ring struct {
	mu  sync.Mutex
	buf []*flowpb.Flow
	// next is the sequence number of the next flow written; flow n is at
	// buf[n%len(buf)] while n >= next-len(buf).
	next uint64
	// written is closed and replaced on every write, waking followers.
	written chan struct{}
}

func newRing(capacity int) *ring {
	return &ring{buf: make([]*flowpb.Flow, capacity), written: make(chan struct{})}
}

// write stores f, overwriting the oldest flow once the ring is full. The
// flow must not be changed afterwards: readers share it.
func (r *ring) write(f *flowpb.Flow) {
	r.mu.Lock()
	r.buf[r.next%uint64(len(r.buf))] = f
	r.next++
	close(r.written)
	r.written = make(chan struct{})
	r.mu.Unlock()
}

// oldestLocked is the sequence number of the oldest flow still stored.
func (r *ring) oldestLocked() uint64 {
	if n := uint64(len(r.buf)); r.next > n {
		return r.next - n
	}
	return 0
}

// snapshot returns the stored flows, oldest first, and the sequence
// number following the last of them.
func (r *ring) snapshot() ([]*flowpb.Flow, uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*flowpb.Flow, 0, r.next-r.oldestLocked())
	for n := r.oldestLocked(); n < r.next; n++ {
		out = append(out, r.buf[n%uint64(len(r.buf))])
	}
	return out, r.next
}

// readFrom returns up to max flows from sequence number from on, how many
// flows from there were already overwritten (lost), the sequence number
// to read from next time, and a channel closed at the next write.
func (r *ring) readFrom(from uint64, max int) (flows []*flowpb.Flow, lost, next uint64, written <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if oldest := r.oldestLocked(); from < oldest {
		lost, from = oldest-from, oldest
	}
	for ; from < r.next && len(flows) < max; from++ {
		flows = append(flows, r.buf[from%uint64(len(r.buf))])
	}
	return flows, lost, from, r.written
}

// stats returns how many flows are stored and how many were ever written.
func (r *ring) stats() (stored, seen uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.next - r.oldestLocked(), r.next
}
