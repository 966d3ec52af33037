package ct

import (
	"fmt"
	"math"

	"golang.org/x/sys/unix"
)

// Limits on the size of a conntrack map, in entries.
const (
	// MinEntries and MaxEntries bound an explicit size flag. Below 1024
	// entries the LRU's per-CPU free lists take a large share of the map;
	// 16Mi entries of a preallocated map already take over 2 GiB.
	MinEntries = 1 << 10
	MaxEntries = 1 << 24
	// MinDynamicTCPEntries and MinDynamicAnyEntries are the least a map
	// sized from memory gets, so that small nodes can still track a useful
	// number of connections.
	MinDynamicTCPEntries = 1 << 17
	MinDynamicAnyEntries = 1 << 16
)

// EntryBytes is the kernel memory one IPv4 conntrack entry costs in a
// preallocated LRU hash, which is what a map sized from memory is divided
// by:
//
//	48  element header: hash-list and LRU-list links, hash
//	16  key (14 bytes, rounded up to 8)
//	56  value
//	16  hash bucket (one per entry, more up to the next power of two)
//
// It matches the memlock the kernel reports for such a map (see the test).
// IPv6 keys take 24 bytes more; the IPv6 maps get the same number of entries
// as the IPv4 ones.
const EntryBytes = 48 + 16 + 56 + 16

// mapSize is the size of one kind of map and the flag it comes from.
type mapSize struct {
	entries uint32
	sizedBy string
}

// mapSizes returns the sizes of the TCP and non-TCP maps for cfg on a node
// with totalMemory bytes of memory.
//
// An explicit size flag wins. A zero flag takes the map's share of
// ratio × totalMemory: that budget buys budget / EntryBytes entries, split
// 2:1 between TCP and other protocols (TCP connections live longer), each
// clamped to [MinDynamic…Entries, MaxEntries].
func mapSizes(cfg Config, totalMemory uint64) (tcp, other mapSize, err error) {
	if err := cfg.validate(); err != nil {
		return mapSize{}, mapSize{}, err
	}
	for _, f := range []struct {
		flag  string
		value int
	}{{TCPMaxFlag, cfg.BPFCTGlobalTCPMax}, {AnyMaxFlag, cfg.BPFCTGlobalAnyMax}} {
		if f.value != 0 && (f.value < MinEntries || f.value > MaxEntries) {
			return mapSize{}, mapSize{}, fmt.Errorf("--%s=%d is out of range: want %d to %d, or 0 to size from --%s",
				f.flag, f.value, MinEntries, MaxEntries, SizeRatioFlag)
		}
	}
	ratio := cfg.BPFMapDynamicSizeRatio
	if !(ratio >= 0 && ratio <= 1) {
		return mapSize{}, mapSize{}, fmt.Errorf("--%s=%g is out of range: want a fraction of total memory, 0 to 1", SizeRatioFlag, ratio)
	}
	if ratio == 0 && (cfg.BPFCTGlobalTCPMax == 0 || cfg.BPFCTGlobalAnyMax == 0) {
		return mapSize{}, mapSize{}, fmt.Errorf("--%s=0 leaves the maps whose size flag is 0 without a size: set --%s and --%s, or a ratio",
			SizeRatioFlag, TCPMaxFlag, AnyMaxFlag)
	}

	entries := ratio * float64(totalMemory) / EntryBytes
	tcp = sizeOf(cfg.BPFCTGlobalTCPMax, TCPMaxFlag, entries*2/3, MinDynamicTCPEntries)
	other = sizeOf(cfg.BPFCTGlobalAnyMax, AnyMaxFlag, entries/3, MinDynamicAnyEntries)
	return tcp, other, nil
}

func sizeOf(explicit int, flag string, dynamic float64, minDynamic uint32) mapSize {
	if explicit != 0 {
		return mapSize{entries: uint32(explicit), sizedBy: "--" + flag}
	}
	n := uint32(min(max(math.Floor(dynamic), float64(minDynamic)), MaxEntries))
	return mapSize{entries: n, sizedBy: "--" + SizeRatioFlag}
}

// totalMemory returns the node's total memory in bytes. Like Cilium it is
// the machine's memory, not the agent's cgroup limit, although the kernel
// charges the maps to the memory cgroup of the process that creates them:
// an agent with a memory limit needs room for its maps (see
// docs/conntrack.md).
func totalMemory() (uint64, error) {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		return 0, fmt.Errorf("read total memory: %w", err)
	}
	return uint64(si.Totalram) * uint64(si.Unit), nil
}
