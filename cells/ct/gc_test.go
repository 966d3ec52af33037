package ct

import (
	"context"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

func TestNextGCInterval(t *testing.T) {
	cases := []struct {
		cur     time.Duration
		deleted float64
		want    time.Duration
	}{
		{5 * time.Minute, 0, 450 * time.Second},                   // little deleted: ×1.5
		{5 * time.Minute, 0.049, 450 * time.Second},               // still little
		{5 * time.Minute, 0.05, 5 * time.Minute},                  // in between: unchanged
		{5 * time.Minute, 0.25, 5 * time.Minute},                  // in between: unchanged
		{5 * time.Minute, 0.5, 150 * time.Second},                 // much deleted: ×(1-ratio)
		{5 * time.Minute, 1, gcMinInterval},                       // everything deleted
		{15 * time.Second, 0.5, gcMinInterval},                    // never below 10s
		{10 * time.Hour, 0, gcMaxInterval},                        // never above 12h
		{gcMaxInterval, 0, gcMaxInterval},                         // stays at the top
		{gcMinInterval, 0, 15 * time.Second},                      // climbs back from the bottom
		{time.Hour, 0.3, time.Duration(0.7 * float64(time.Hour))}, // just above the threshold
	}
	for _, c := range cases {
		if got := nextGCInterval(c.cur, c.deleted); got != c.want {
			t.Errorf("nextGCInterval(%s, %g) = %s, want %s", c.cur, c.deleted, got, c.want)
		}
	}
}

func TestCollectExpired(t *testing.T) {
	testenv.RequireRoot(t)
	now := ctNow(t)
	// Every third entry expired a while ago, every third expires exactly
	// now (and is still alive), the rest live for an hour.
	lifetime := func(i int) int {
		switch i % 3 {
		case 0:
			return -100 - i%50
		case 1:
			return 0
		}
		return 3600
	}
	const n = 3000

	t.Run("ipv4", func(t *testing.T) {
		testCollect(t, newCTMap(t, bpf.CT4GlobalMap, 4*n), tcpKey, now, n, lifetime)
	})
	t.Run("ipv6", func(t *testing.T) {
		testCollect(t, newCTMap(t, bpf.CTAny6GlobalMap, 4*n), udp6Key, now, n, lifetime)
	})
}

func testCollect[K bpf.CTKey](t *testing.T, m *ebpf.Map, key func(int) K, now uint32, n int, lifetime func(int) int) {
	fill(t, m, key, n, now, lifetime)
	scanned, deleted, err := CollectExpired(context.Background(), m, now)
	if err != nil {
		t.Fatal(err)
	}
	if scanned != uint64(n) || deleted != uint64(n/3) {
		t.Errorf("scanned %d, deleted %d; want %d, %d", scanned, deleted, n, n/3)
	}
	left := contents[K](t, m)
	for i := range n {
		_, kept := left[key(i)]
		if want := lifetime(i) >= 0; kept != want {
			t.Fatalf("entry %d with lifetime now%+d: kept %v, want %v", i, lifetime(i), kept, want)
		}
	}
	// A second run finds nothing more to delete.
	scanned, deleted, err = CollectExpired(context.Background(), m, now)
	if err != nil || scanned != uint64(n-n/3) || deleted != 0 {
		t.Errorf("second run: scanned %d, deleted %d, %v; want %d, 0", scanned, deleted, err, n-n/3)
	}
}

// TestDeleteKeysSkipsMissing deletes a batch of keys some of which are
// already gone, as when the LRU or the datapath removed them meanwhile.
func TestDeleteKeysSkipsMissing(t *testing.T) {
	testenv.RequireRoot(t)
	m := newCTMap(t, bpf.CT4GlobalMap, 1024)
	now := ctNow(t)
	fill(t, m, tcpKey, 10, now, func(int) int { return 60 })

	keys := []bpf.CTKey4{tcpKey(100), tcpKey(0), tcpKey(1), tcpKey(101), tcpKey(102), tcpKey(2), tcpKey(103)}
	n, err := deleteKeys(m, keys)
	if err != nil || n != 3 {
		t.Errorf("deleteKeys = %d, %v; want 3, nil", n, err)
	}
	if got := len(contents[bpf.CTKey4](t, m)); got != 7 {
		t.Errorf("%d entries left, want 7", got)
	}
	if n, err := deleteKeys[bpf.CTKey4](m, nil); err != nil || n != 0 {
		t.Errorf("deleteKeys(nil) = %d, %v", n, err)
	}
}

func TestCollectExpiredCancelled(t *testing.T) {
	testenv.RequireRoot(t)
	m := newCTMap(t, bpf.CT4GlobalMap, 1024)
	fill(t, m, tcpKey, 10, ctNow(t), func(int) int { return -10 })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, _, err := CollectExpired(ctx, m, ctNow(t)); err == nil {
		t.Error("CollectExpired ignored a cancelled context")
	}
}
