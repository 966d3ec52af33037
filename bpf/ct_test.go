package bpf_test

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

func TestCTMapSpecLayout(t *testing.T) {
	cases := []struct {
		name    string
		keySize uint32
		check   func(*ebpf.MapSpec) error
	}{
		{bpf.CT4GlobalMap, bpf.CTKey4Size, bpf.CheckLayout[bpf.CTKey4, bpf.CTEntry]},
		{bpf.CTAny4GlobalMap, bpf.CTKey4Size, bpf.CheckLayout[bpf.CTKey4, bpf.CTEntry]},
		{bpf.CT6GlobalMap, bpf.CTKey6Size, bpf.CheckLayout[bpf.CTKey6, bpf.CTEntry]},
		{bpf.CTAny6GlobalMap, bpf.CTKey6Size, bpf.CheckLayout[bpf.CTKey6, bpf.CTEntry]},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			spec, err := bpf.CTMapSpec(c.name, 4096)
			if err != nil {
				t.Fatal(err)
			}
			if spec.Name != c.name || spec.Type != ebpf.LRUHash || spec.KeySize != c.keySize ||
				spec.ValueSize != bpf.CTEntrySize || spec.MaxEntries != 4096 || spec.Flags != 0 {
				t.Errorf("spec = %+v", spec)
			}
			if err := c.check(spec); err != nil {
				t.Error(err)
			}
		})
	}

	if _, err := bpf.CTMapSpec("ct4.global", 4096); err == nil {
		t.Error("CTMapSpec accepted a name that is no conntrack map")
	}
}

func TestCTMapNames(t *testing.T) {
	if got := bpf.CTMapNames(false); len(got) != 2 || got[0] != "ct4_global" || got[1] != "ct_any4_global" {
		t.Errorf("CTMapNames(false) = %v", got)
	}
	got := bpf.CTMapNames(true)
	if len(got) != 4 || got[2] != "ct6_global" || got[3] != "ct_any6_global" {
		t.Errorf("CTMapNames(true) = %v", got)
	}
	for _, name := range got {
		v6, err := bpf.CTMapIsIPv6(name)
		if err != nil || v6 != (name == "ct6_global" || name == "ct_any6_global") {
			t.Errorf("CTMapIsIPv6(%q) = %v, %v", name, v6, err)
		}
	}
}

// ctKey4 and ctEntry are what the datapath would write, with every field set
// to a distinct value so that a misplaced field shows.
var (
	ctKey4 = bpf.CTKey4{
		DAddr:   [4]byte{10, 0, 0, 1},
		SAddr:   [4]byte{10, 0, 0, 2},
		DPort:   bpf.NewBe16(0x1234),
		SPort:   bpf.NewBe16(80),
		NextHdr: unix.IPPROTO_TCP,
		Flags:   bpf.CTIngress | bpf.CTService,
	}
	ctEntry = bpf.CTEntry{
		RxPackets:      0x0101010101010101,
		RxBytes:        0x0202020202020202,
		TxPackets:      0x0303030303030303,
		TxBytes:        0x0404040404040404,
		Lifetime:       0x05050505,
		Flags:          bpf.CTRxClosing | bpf.CTSeenNonSyn,
		RevNAT:         bpf.NewBe16(0x0607),
		IfIndex:        0x0809,
		TxFlagsSeen:    0x0a,
		RxFlagsSeen:    0x0b,
		SourceIdentity: 0x0c0c0c0c,
		LastTxReport:   0x0d0d0d0d,
		LastRxReport:   0x0e0e0e0e,
	}
)

// The bytes the datapath's C structs hold for ctKey4 and ctEntry on a
// little-endian machine.
var (
	ctKey4Bytes = []byte{
		10, 0, 0, 1, // daddr
		10, 0, 0, 2, // saddr
		0x12, 0x34, // dport, network order
		0, 80, // sport, network order
		6,     // nexthdr
		1 | 4, // flags
	}
	ctEntryBytes = bytes.Join([][]byte{
		bytes.Repeat([]byte{1}, 8),
		bytes.Repeat([]byte{2}, 8),
		bytes.Repeat([]byte{3}, 8),
		bytes.Repeat([]byte{4}, 8),
		{5, 5, 5, 5},
		{0x11, 0x00}, // rx_closing (bit 0) and seen_non_syn (bit 4)
		{0x06, 0x07}, // rev_nat_index, network order
		{0x09, 0x08}, // ifindex
		{0x0a, 0x0b},
		{0xc, 0xc, 0xc, 0xc},
		{0xd, 0xd, 0xd, 0xd},
		{0xe, 0xe, 0xe, 0xe},
	}, nil)
)

func TestCTEncoding(t *testing.T) {
	if binary.NativeEndian.Uint16([]byte{1, 0}) != 1 {
		t.Skip("the expected bytes are those of a little-endian machine")
	}
	got, err := binary.Append(nil, binary.NativeEndian, ctKey4)
	if err != nil || !bytes.Equal(got, ctKey4Bytes) {
		t.Errorf("key encodes to % x, %v; want % x", got, err, ctKey4Bytes)
	}
	got, err = binary.Append(nil, binary.NativeEndian, ctEntry)
	if err != nil || !bytes.Equal(got, ctEntryBytes) {
		t.Errorf("entry encodes to % x, %v; want % x", got, err, ctEntryBytes)
	}
}

// TestCTMapBytes checks what the kernel stores, which is what the library's
// zero-copy path for padding-free structs hands it.
func TestCTMapBytes(t *testing.T) {
	if binary.NativeEndian.Uint16([]byte{1, 0}) != 1 {
		t.Skip("the expected bytes are those of a little-endian machine")
	}
	dir := testenv.BPFPinDir(t)
	spec, err := bpf.CTMapSpec(bpf.CT4GlobalMap, 1024)
	if err != nil {
		t.Fatal(err)
	}
	m, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()

	if err := m.Put(ctKey4, ctEntry); err != nil {
		t.Fatalf("put: %v", err)
	}
	var raw []byte
	if err := m.Lookup(ctKey4Bytes, &raw); err != nil {
		t.Fatalf("lookup by the C layout of the key: %v", err)
	}
	if !bytes.Equal(raw, ctEntryBytes) {
		t.Errorf("kernel holds % x, want % x", raw, ctEntryBytes)
	}
	var back bpf.CTEntry
	if err := m.Lookup(ctKey4, &back); err != nil || back != ctEntry {
		t.Errorf("lookup = %+v, %v; want %+v", back, err, ctEntry)
	}
}

func TestCTTuple(t *testing.T) {
	tuple := ctKey4.Tuple()
	want := bpf.CTTuple{
		DAddr: netip.MustParseAddr("10.0.0.1"), SAddr: netip.MustParseAddr("10.0.0.2"),
		DPort: 0x1234, SPort: 80, NextHdr: 6, Flags: bpf.CTIngress | bpf.CTService,
	}
	if tuple != want {
		t.Errorf("Tuple() = %+v, want %+v", tuple, want)
	}

	k6 := bpf.CTKey6{DAddr: netip.MustParseAddr("fd00::1").As16(), SAddr: netip.MustParseAddr("fd00::2").As16(),
		DPort: bpf.NewBe16(53), SPort: bpf.NewBe16(5353), NextHdr: unix.IPPROTO_UDP}
	if got := k6.Tuple(); got.DAddr.String() != "fd00::1" || got.SAddr.String() != "fd00::2" ||
		got.DPort != 53 || got.SPort != 5353 || got.NextHdr != 17 {
		t.Errorf("IPv6 Tuple() = %+v", got)
	}

	lower := want
	lower.SPort--
	if want.Compare(lower) <= 0 || lower.Compare(want) >= 0 || want.Compare(want) != 0 {
		t.Error("Compare does not order by source port")
	}
}

func TestCTFlagsString(t *testing.T) {
	cases := []struct {
		got, want string
	}{
		{bpf.CTEgress.String(), "OUT"},
		{bpf.CTIngress.String(), "IN"},
		{(bpf.CTIngress | bpf.CTRelated | bpf.CTService).String(), "IN related service"},
		{bpf.CTTupleFlags(0x10).String(), "OUT flags=0x10"},
		{bpf.CTEntryFlags(0).String(), "none"},
		{(bpf.CTRxClosing | bpf.CTTxClosing | bpf.CTSeenNonSyn).String(), "rx_closing|tx_closing|seen_non_syn"},
		{(bpf.CTFromTunnel | 1<<15).String(), "from_tunnel|0x8000"},
	}
	for _, c := range cases {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
}

func TestCTEntryExpired(t *testing.T) {
	e := bpf.CTEntry{Lifetime: 100}
	for _, c := range []struct {
		now  uint32
		want bool
	}{{99, false}, {100, false}, {101, true}} {
		if got := e.Expired(c.now); got != c.want {
			t.Errorf("lifetime 100 expired at %d = %v, want %v", c.now, got, c.want)
		}
	}
}

func TestCTClockNow(t *testing.T) {
	now, err := bpf.CTClockNow()
	if err != nil {
		t.Fatal(err)
	}
	// CLOCK_MONOTONIC counts from boot, without the time spent suspended,
	// so it never runs ahead of the uptime (CLOCK_BOOTTIME).
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		t.Fatal(err)
	}
	if now == 0 || int64(now) > int64(si.Uptime)+1 {
		t.Errorf("CT clock %d s, uptime %d s", now, si.Uptime)
	}
}

func TestWalkCT(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	spec, err := bpf.CTMapSpec(bpf.CTAny4GlobalMap, 4096)
	if err != nil {
		t.Fatal(err)
	}
	m, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()

	const n = 1000
	keys := make([]bpf.CTKey4, n)
	values := make([]bpf.CTEntry, n)
	for i := range keys {
		keys[i] = bpf.CTKey4{DAddr: [4]byte{10, 0, byte(i >> 8), byte(i)}, NextHdr: unix.IPPROTO_UDP}
		values[i] = bpf.CTEntry{Lifetime: uint32(i)}
	}
	if _, err := m.BatchUpdate(keys, values, nil); err != nil {
		t.Fatal(err)
	}

	// Delete the odd lifetimes while walking: the walk still sees every
	// entry once.
	seen := map[bpf.CTKey4]uint32{}
	batches := 0
	err = bpf.WalkCT(m.Map, 64, func(keys []bpf.CTKey4, values []bpf.CTEntry) error {
		batches++
		var odd []bpf.CTKey4
		for i, k := range keys {
			if _, dup := seen[k]; dup {
				t.Errorf("key %v seen twice", k)
			}
			seen[k] = values[i].Lifetime
			if values[i].Lifetime%2 == 1 {
				odd = append(odd, k)
			}
		}
		_, err := m.BatchDelete(odd, nil)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(seen) != n || batches < n/64 {
		t.Errorf("walk saw %d entries in %d batches, want %d in at least %d", len(seen), batches, n, n/64)
	}
	for i, k := range keys {
		if seen[k] != uint32(i) {
			t.Fatalf("entry %d: lifetime %d, want %d", i, seen[k], i)
		}
	}

	left := 0
	if err := bpf.WalkCT(m.Map, 4096, func(keys []bpf.CTKey4, _ []bpf.CTEntry) error {
		left += len(keys)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if left != n/2 {
		t.Errorf("%d entries left after deleting the odd ones, want %d", left, n/2)
	}

	if err := bpf.WalkCT(m.Map, 0, func([]bpf.CTKey4, []bpf.CTEntry) error { return nil }); err == nil {
		t.Error("WalkCT accepted batch size 0")
	}
}
