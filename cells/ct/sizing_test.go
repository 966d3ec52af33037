package ct

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

const gib = 1 << 30

func TestMapSizes(t *testing.T) {
	ratio := func(r float64) Config { return Config{BPFMapDynamicSizeRatio: r} }
	explicit := func(tcp, other int) Config {
		return Config{BPFCTGlobalTCPMax: tcp, BPFCTGlobalAnyMax: other, BPFMapDynamicSizeRatio: 0.0025}
	}
	const byRatio, byTCP, byAny = "--bpf-map-dynamic-size-ratio", "--bpf-ct-global-tcp-max", "--bpf-ct-global-any-max"

	cases := []struct {
		name               string
		cfg                Config
		mem                uint64
		tcp, other         uint32
		tcpFrom, otherFrom string
		err                string // part of the error; "" for none
	}{
		// ratio × memory / 136 bytes per entry, split 2:1, clamped.
		{name: "1GiB_clamped_up", cfg: ratio(0.0025), mem: 1 * gib,
			tcp: MinDynamicTCPEntries, other: MinDynamicAnyEntries, tcpFrom: byRatio, otherFrom: byRatio},
		{name: "16GiB", cfg: ratio(0.0025), mem: 16 * gib,
			tcp: 210537, other: 105268, tcpFrom: byRatio, otherFrom: byRatio},
		{name: "64GiB", cfg: ratio(0.0025), mem: 64 * gib,
			tcp: 842150, other: 421075, tcpFrom: byRatio, otherFrom: byRatio},
		{name: "4TiB_clamped_down", cfg: ratio(0.0025), mem: 4096 * gib,
			tcp: MaxEntries, other: MaxEntries, tcpFrom: byRatio, otherFrom: byRatio},
		{name: "big_ratio", cfg: ratio(0.01), mem: 16 * gib,
			tcp: 842150, other: 421075, tcpFrom: byRatio, otherFrom: byRatio},
		{name: "explicit_wins", cfg: explicit(4096, 2048), mem: 16 * gib,
			tcp: 4096, other: 2048, tcpFrom: byTCP, otherFrom: byAny},
		{name: "explicit_tcp_only", cfg: explicit(1<<20, 0), mem: 16 * gib,
			tcp: 1 << 20, other: 105268, tcpFrom: byTCP, otherFrom: byRatio},
		{name: "explicit_limits", cfg: explicit(MinEntries, MaxEntries), mem: 16 * gib,
			tcp: MinEntries, other: MaxEntries, tcpFrom: byTCP, otherFrom: byAny},
		{name: "explicit_with_ratio_0", cfg: Config{BPFCTGlobalTCPMax: 4096, BPFCTGlobalAnyMax: 2048}, mem: 16 * gib,
			tcp: 4096, other: 2048, tcpFrom: byTCP, otherFrom: byAny},

		{name: "tcp_too_small", cfg: explicit(1023, 0), err: "--bpf-ct-global-tcp-max=1023 is out of range"},
		{name: "tcp_negative", cfg: explicit(-1, 0), err: "--bpf-ct-global-tcp-max=-1 is out of range"},
		{name: "any_too_big", cfg: explicit(0, MaxEntries+1), err: "--bpf-ct-global-any-max=16777217 is out of range"},
		{name: "ratio_negative", cfg: ratio(-0.1), err: "--bpf-map-dynamic-size-ratio=-0.1 is out of range"},
		{name: "ratio_above_1", cfg: ratio(1.5), err: "--bpf-map-dynamic-size-ratio=1.5 is out of range"},
		{name: "ratio_nan", cfg: ratio(math.NaN()), err: "--bpf-map-dynamic-size-ratio=NaN is out of range"},
		{name: "ratio_0_needed", cfg: Config{BPFCTGlobalTCPMax: 4096}, err: "--bpf-map-dynamic-size-ratio=0 leaves"},
		{name: "gc_negative", cfg: Config{BPFMapDynamicSizeRatio: 0.0025, ConntrackGCInterval: -time.Second},
			err: "--conntrack-gc-interval=-1s is out of range"},
		{name: "gc_too_short", cfg: Config{BPFMapDynamicSizeRatio: 0.0025, ConntrackGCInterval: time.Millisecond},
			err: "--conntrack-gc-interval=1ms is out of range"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tcp, other, err := mapSizes(c.cfg, c.mem)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("got error %v, want one containing %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := [2]mapSize{{c.tcp, c.tcpFrom}, {c.other, c.otherFrom}}
			if got := [2]mapSize{tcp, other}; got != want {
				t.Errorf("got %+v, want %+v", got, want)
			}
		})
	}
}

// TestEntryBytes checks the sizing formula's cost per entry against the
// memory the kernel charges for a conntrack map.
func TestEntryBytes(t *testing.T) {
	testenv.RequireRoot(t)
	const entries = 1 << 17
	spec, err := bpf.CTMapSpec(bpf.CT4GlobalMap, entries)
	if err != nil {
		t.Fatal(err)
	}
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	memlock, ok := info.Memlock()
	if !ok {
		testenv.Skip(t, "the kernel does not report map memory")
	}
	perEntry := float64(memlock) / entries
	t.Logf("kernel charges %d bytes for %d entries: %.1f per entry; EntryBytes is %d", memlock, entries, perEntry, EntryBytes)
	if math.Abs(perEntry-EntryBytes)/EntryBytes > 0.1 {
		t.Errorf("kernel charges %.1f bytes per entry, EntryBytes says %d", perEntry, EntryBytes)
	}
}

func TestTotalMemory(t *testing.T) {
	mem, err := totalMemory()
	if err != nil {
		t.Fatal(err)
	}
	if mem < 64<<20 {
		t.Errorf("total memory %d bytes is implausible", mem)
	}
}
