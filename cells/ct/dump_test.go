package ct

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

func key4(proto uint8, flags bpf.CTTupleFlags, saddr string, sport uint16, daddr string, dport uint16) bpf.CTKey4 {
	return bpf.CTKey4{
		SAddr: netip.MustParseAddr(saddr).As4(), SPort: bpf.NewBe16(sport),
		DAddr: netip.MustParseAddr(daddr).As4(), DPort: bpf.NewBe16(dport),
		NextHdr: proto, Flags: flags,
	}
}

func TestWriteEntries(t *testing.T) {
	testenv.RequireRoot(t)
	const now = 1000

	v4 := newCTMap(t, bpf.CT4GlobalMap, 1024)
	put := func(m *ebpf.Map, k any, v bpf.CTEntry) {
		t.Helper()
		if err := m.Put(k, v); err != nil {
			t.Fatal(err)
		}
	}
	put(v4, key4(6, bpf.CTEgress, "10.0.0.1", 41234, "10.0.0.2", 80), bpf.CTEntry{
		Lifetime: now + 3599, Flags: bpf.CTSeenNonSyn, RxPackets: 1, RxBytes: 60, TxPackets: 2, TxBytes: 120,
		RxFlagsSeen: 0x12, TxFlagsSeen: 0x02,
	})
	// Sorted by address value: 10.0.0.9 before 10.0.0.10.
	put(v4, key4(6, bpf.CTIngress|bpf.CTService, "10.0.0.10", 80, "10.0.0.1", 5000), bpf.CTEntry{
		Lifetime: now - 1, Flags: bpf.CTRxClosing | bpf.CTTxClosing, RevNAT: bpf.NewBe16(3), SourceIdentity: 256, IfIndex: 4,
	})
	put(v4, key4(6, bpf.CTIngress, "10.0.0.9", 80, "10.0.0.1", 5000), bpf.CTEntry{Lifetime: now})
	put(v4, key4(47, bpf.CTRelated, "10.0.0.9", 0, "10.0.0.1", 0), bpf.CTEntry{Lifetime: now + 1})

	v6 := newCTMap(t, bpf.CTAny6GlobalMap, 1024)
	put(v6, bpf.CTKey6{
		SAddr: netip.MustParseAddr("fd00::1").As16(), SPort: bpf.NewBe16(53),
		DAddr: netip.MustParseAddr("fd00::2").As16(), DPort: bpf.NewBe16(33000), NextHdr: 17,
	}, bpf.CTEntry{Lifetime: now + 60})
	put(v6, bpf.CTKey6{
		SAddr: netip.MustParseAddr("fd00::1").As16(), DAddr: netip.MustParseAddr("fd00::2").As16(), NextHdr: 58,
	}, bpf.CTEntry{Lifetime: now + 5})

	var out strings.Builder
	for _, m := range []*ebpf.Map{v4, v6} {
		if err := WriteEntries(&out, m, now); err != nil {
			t.Fatal(err)
		}
	}
	want := `TCP OUT 10.0.0.1:41234 -> 10.0.0.2:80 remaining=3599s flags=seen_non_syn rev_nat=0 src_identity=0 ifindex=0 rx_packets=1 rx_bytes=60 tx_packets=2 tx_bytes=120 rx_flags_seen=0x12 tx_flags_seen=0x02
proto-47 OUT related 10.0.0.9:0 -> 10.0.0.1:0 remaining=1s flags=none rev_nat=0 src_identity=0 ifindex=0 rx_packets=0 rx_bytes=0 tx_packets=0 tx_bytes=0 rx_flags_seen=0x00 tx_flags_seen=0x00
TCP IN 10.0.0.9:80 -> 10.0.0.1:5000 remaining=0s flags=none rev_nat=0 src_identity=0 ifindex=0 rx_packets=0 rx_bytes=0 tx_packets=0 tx_bytes=0 rx_flags_seen=0x00 tx_flags_seen=0x00
TCP IN service 10.0.0.10:80 -> 10.0.0.1:5000 remaining=expired flags=rx_closing|tx_closing rev_nat=3 src_identity=256 ifindex=4 rx_packets=0 rx_bytes=0 tx_packets=0 tx_bytes=0 rx_flags_seen=0x00 tx_flags_seen=0x00
ICMPv6 OUT [fd00::1]:0 -> [fd00::2]:0 remaining=5s flags=none rev_nat=0 src_identity=0 ifindex=0 rx_packets=0 rx_bytes=0 tx_packets=0 tx_bytes=0 rx_flags_seen=0x00 tx_flags_seen=0x00
UDP OUT [fd00::1]:53 -> [fd00::2]:33000 remaining=60s flags=none rev_nat=0 src_identity=0 ifindex=0 rx_packets=0 rx_bytes=0 tx_packets=0 tx_bytes=0 rx_flags_seen=0x00 tx_flags_seen=0x00
`
	if got := out.String(); got != want {
		t.Errorf("got:\n%s\nwant:\n%s", got, want)
	}

	other, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := WriteEntries(&out, other, now); err == nil {
		t.Error("WriteEntries accepted a map that is no conntrack map")
	}
}

func TestWritePinned(t *testing.T) {
	dir := testenv.BPFPinDir(t)

	var out strings.Builder
	if err := WritePinned(&out, dir); err == nil || !strings.Contains(err.Error(), "no conntrack map is pinned in "+dir) {
		t.Errorf("with nothing pinned: %v", err)
	}

	pin := func(name string) *bpf.PinnedMap {
		spec, err := bpf.CTMapSpec(name, 1024)
		if err != nil {
			t.Fatal(err)
		}
		pm, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pm.Close() })
		return pm
	}
	now := ctNow(t)
	tcp := pin(bpf.CT4GlobalMap)
	if err := tcp.Put(key4(6, bpf.CTEgress, "10.0.0.1", 1000, "10.0.0.2", 80), bpf.CTEntry{Lifetime: now + 100}); err != nil {
		t.Fatal(err)
	}
	other := pin(bpf.CTAny4GlobalMap)
	if err := other.Put(key4(17, bpf.CTEgress, "10.0.0.1", 53, "10.0.0.2", 53), bpf.CTEntry{Lifetime: now - 1}); err != nil {
		t.Fatal(err)
	}

	// Every pinned map, the IPv6 ones being absent.
	if err := WritePinned(&out, dir); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "TCP OUT 10.0.0.1:1000 -> 10.0.0.2:80 remaining=") ||
		!strings.HasPrefix(lines[1], "UDP OUT 10.0.0.1:53 -> 10.0.0.2:53 remaining=expired ") {
		t.Errorf("got:\n%s", out.String())
	}

	out.Reset()
	if err := WritePinned(&out, dir, bpf.CTAny4GlobalMap); err != nil || strings.Count(out.String(), "\n") != 1 {
		t.Errorf("one map: %v\n%s", err, out.String())
	}
	if err := WritePinned(&out, dir, bpf.CT6GlobalMap); err == nil {
		t.Error("a named map that is not pinned is no error")
	}
	if err := WritePinned(&out, dir, "lb4_services"); err == nil {
		t.Error("a name that is no conntrack map is no error")
	}
}
