package ct

import (
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
)

// ctNow returns the CT clock.
func ctNow(t testing.TB) uint32 {
	t.Helper()
	now, err := bpf.CTClockNow()
	if err != nil {
		t.Fatal(err)
	}
	return now
}

// newCTMap creates an unpinned conntrack map for a test.
func newCTMap(t testing.TB, name string, maxEntries uint32) *ebpf.Map {
	t.Helper()
	spec, err := bpf.CTMapSpec(name, maxEntries)
	if err != nil {
		t.Fatal(err)
	}
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// tcpKey returns a distinct IPv4 TCP tuple for each i.
func tcpKey(i int) bpf.CTKey4 {
	return bpf.CTKey4{
		DAddr:   [4]byte{10, 0, byte(i >> 8), byte(i)},
		SAddr:   [4]byte{10, 96, 0, 10},
		DPort:   bpf.NewBe16(uint16(30000 + i%30000)),
		SPort:   bpf.NewBe16(443),
		NextHdr: unix.IPPROTO_TCP,
	}
}

// udp6Key returns a distinct IPv6 UDP tuple for each i.
func udp6Key(i int) bpf.CTKey6 {
	d := netip.MustParseAddr("fd00::").As16()
	d[14], d[15] = byte(i>>8), byte(i)
	return bpf.CTKey6{
		DAddr:   d,
		SAddr:   netip.MustParseAddr("fd00::53").As16(),
		DPort:   bpf.NewBe16(uint16(30000 + i%30000)),
		SPort:   bpf.NewBe16(53),
		NextHdr: unix.IPPROTO_UDP,
	}
}

// fill writes n entries made by key into m, as the datapath would: entry i
// expires at now+lifetime(i).
func fill[K bpf.CTKey](t testing.TB, m *ebpf.Map, key func(int) K, n int, now uint32, lifetime func(i int) int) {
	t.Helper()
	keys := make([]K, n)
	values := make([]bpf.CTEntry, n)
	for i := range n {
		keys[i] = key(i)
		values[i] = bpf.CTEntry{Lifetime: uint32(int(now) + lifetime(i)), TxPackets: uint64(i)}
	}
	for start := 0; start < n; start += 8192 {
		end := min(start+8192, n)
		if c, err := m.BatchUpdate(keys[start:end], values[start:end], nil); err != nil || c != end-start {
			t.Fatalf("write entries %d-%d: wrote %d, %v", start, end, c, err)
		}
	}
}

// contents returns the lifetimes of every entry of m, by key.
func contents[K bpf.CTKey](t testing.TB, m *ebpf.Map) map[K]uint32 {
	t.Helper()
	got := map[K]uint32{}
	if err := bpf.WalkCT(m, 1024, func(keys []K, values []bpf.CTEntry) error {
		for i, k := range keys {
			got[k] = values[i].Lifetime
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return got
}
