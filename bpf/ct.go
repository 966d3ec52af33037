package bpf

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Names of the global conntrack maps, which are also their pins' file names.
// TCP connections are tracked in the ct maps, every other protocol in the
// ct_any maps, so that a flood of UDP or ICMP flows cannot evict TCP state.
const (
	CT4GlobalMap    = "ct4_global"
	CTAny4GlobalMap = "ct_any4_global"
	CT6GlobalMap    = "ct6_global"
	CTAny6GlobalMap = "ct_any6_global"
)

// Byte sizes of the conntrack keys and value, as the datapath's C structs
// (struct ipv4_ct_tuple, struct ipv6_ct_tuple, struct ct_entry) lay them out.
const (
	CTKey4Size  = 14
	CTKey6Size  = 38
	CTEntrySize = 56
)

// CTMapNames returns the names of the conntrack maps in use: the IPv4 pair,
// and the IPv6 pair too when ipv6 is set.
func CTMapNames(ipv6 bool) []string {
	names := []string{CT4GlobalMap, CTAny4GlobalMap}
	if ipv6 {
		names = append(names, CT6GlobalMap, CTAny6GlobalMap)
	}
	return names
}

// CTMapIsIPv6 reports whether the conntrack map called name holds IPv6
// tuples. It returns an error for names that are not conntrack maps.
func CTMapIsIPv6(name string) (bool, error) {
	switch name {
	case CT4GlobalMap, CTAny4GlobalMap:
		return false, nil
	case CT6GlobalMap, CTAny6GlobalMap:
		return true, nil
	}
	return false, fmt.Errorf("%q is not a conntrack map (want one of %s)",
		name, strings.Join(CTMapNames(true), ", "))
}

// CTMapSpec returns the spec of the conntrack map called name with room for
// maxEntries connections.
//
// The maps are LRU hashes with the common LRU list (flags 0): when a map is
// full, the datapath evicts the least recently used connection instead of
// failing to track a new one.
func CTMapSpec(name string, maxEntries uint32) (*ebpf.MapSpec, error) {
	ipv6, err := CTMapIsIPv6(name)
	if err != nil {
		return nil, err
	}
	keySize := uint32(CTKey4Size)
	if ipv6 {
		keySize = CTKey6Size
	}
	return &ebpf.MapSpec{
		Name:       name,
		Type:       ebpf.LRUHash,
		KeySize:    keySize,
		ValueSize:  CTEntrySize,
		MaxEntries: maxEntries,
	}, nil
}

// CTTupleFlags are the flags of a conntrack key, saying which way the tracked
// connection goes (TUPLE_F_* in the datapath).
type CTTupleFlags uint8

// Conntrack tuple flags. A tuple without CTIngress is an egress (OUT) tuple.
const (
	CTEgress  CTTupleFlags = 0
	CTIngress CTTupleFlags = 1 << 0
	CTRelated CTTupleFlags = 1 << 1
	CTService CTTupleFlags = 1 << 2
)

// String returns the direction ("IN" or "OUT") followed by " related" and
// " service" when those flags are set, as `apiary bpf ct list` prints them.
func (f CTTupleFlags) String() string {
	s := "OUT"
	if f&CTIngress != 0 {
		s = "IN"
	}
	if f&CTRelated != 0 {
		s += " related"
	}
	if f&CTService != 0 {
		s += " service"
	}
	if rest := f &^ (CTIngress | CTRelated | CTService); rest != 0 {
		s += fmt.Sprintf(" flags=%#x", uint8(rest))
	}
	return s
}

// CTKey4 is the key of ct4_global and ct_any4_global (struct ipv4_ct_tuple).
// As in the datapath, the address and port fields are named from the point
// of view of reply traffic.
type CTKey4 struct {
	DAddr   [4]byte
	SAddr   [4]byte
	DPort   Be16
	SPort   Be16
	NextHdr uint8
	Flags   CTTupleFlags
}

// Tuple returns the key in family-independent form.
func (k CTKey4) Tuple() CTTuple {
	return CTTuple{
		DAddr:   netip.AddrFrom4(k.DAddr),
		SAddr:   netip.AddrFrom4(k.SAddr),
		DPort:   k.DPort.Uint16(),
		SPort:   k.SPort.Uint16(),
		NextHdr: k.NextHdr,
		Flags:   k.Flags,
	}
}

// CTKey6 is the key of ct6_global and ct_any6_global (struct ipv6_ct_tuple).
type CTKey6 struct {
	DAddr   [16]byte
	SAddr   [16]byte
	DPort   Be16
	SPort   Be16
	NextHdr uint8
	Flags   CTTupleFlags
}

// Tuple returns the key in family-independent form.
func (k CTKey6) Tuple() CTTuple {
	return CTTuple{
		DAddr:   netip.AddrFrom16(k.DAddr),
		SAddr:   netip.AddrFrom16(k.SAddr),
		DPort:   k.DPort.Uint16(),
		SPort:   k.SPort.Uint16(),
		NextHdr: k.NextHdr,
		Flags:   k.Flags,
	}
}

// CTKey is either conntrack key type. Code that walks or copies conntrack
// maps is generic over it, so both families share one implementation that
// still moves keys without reflection.
type CTKey interface {
	CTKey4 | CTKey6
	Tuple() CTTuple
}

// CTTuple is a conntrack key of either family, for printing and sorting.
type CTTuple struct {
	DAddr   netip.Addr
	SAddr   netip.Addr
	DPort   uint16
	SPort   uint16
	NextHdr uint8
	Flags   CTTupleFlags
}

// Compare orders tuples by source, then destination, then protocol and
// flags, so that listings are stable.
func (t CTTuple) Compare(u CTTuple) int {
	if c := t.SAddr.Compare(u.SAddr); c != 0 {
		return c
	}
	if c := int(t.SPort) - int(u.SPort); c != 0 {
		return c
	}
	if c := t.DAddr.Compare(u.DAddr); c != 0 {
		return c
	}
	if c := int(t.DPort) - int(u.DPort); c != 0 {
		return c
	}
	if c := int(t.NextHdr) - int(u.NextHdr); c != 0 {
		return c
	}
	return int(t.Flags) - int(u.Flags)
}

// CTEntryFlags is the bit field of struct ct_entry that records the state
// of a connection.
type CTEntryFlags uint16

// Conntrack entry flags, in the order of the datapath's bit field (the first
// field is the least significant bit on little-endian machines).
const (
	CTRxClosing CTEntryFlags = 1 << iota
	CTTxClosing
	CTNAT64
	CTLBLoopback
	CTSeenNonSyn
	CTNodePort
	CTProxyRedirect
	CTDSRInternal
	CTFromL7LB
	ctReserved1
	CTFromTunnel
)

var ctEntryFlagNames = []struct {
	flag CTEntryFlags
	name string
}{
	{CTRxClosing, "rx_closing"},
	{CTTxClosing, "tx_closing"},
	{CTNAT64, "nat64"},
	{CTLBLoopback, "lb_loopback"},
	{CTSeenNonSyn, "seen_non_syn"},
	{CTNodePort, "node_port"},
	{CTProxyRedirect, "proxy_redirect"},
	{CTDSRInternal, "dsr_internal"},
	{CTFromL7LB, "from_l7lb"},
	{CTFromTunnel, "from_tunnel"},
}

// String returns the set flags joined by "|", or "none".
func (f CTEntryFlags) String() string {
	var names []string
	for _, n := range ctEntryFlagNames {
		if f&n.flag != 0 {
			names = append(names, n.name)
			f &^= n.flag
		}
	}
	if f != 0 {
		names = append(names, fmt.Sprintf("%#x", uint16(f)))
	}
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, "|")
}

// CTEntry is the value of every conntrack map (struct ct_entry).
type CTEntry struct {
	RxPackets uint64
	RxBytes   uint64
	TxPackets uint64
	TxBytes   uint64
	// Lifetime is when the entry expires, in seconds of the CT clock (see
	// CTClockNow).
	Lifetime uint32
	Flags    CTEntryFlags
	// RevNAT is the reverse NAT index of the service the connection was
	// load-balanced through, or 0.
	RevNAT         Be16
	IfIndex        uint16
	TxFlagsSeen    uint8
	RxFlagsSeen    uint8
	SourceIdentity uint32
	LastTxReport   uint32
	LastRxReport   uint32
}

// Expired reports whether the entry's lifetime lies before now (both in
// seconds of the CT clock). An entry whose lifetime is now is still alive,
// as in the datapath.
func (e *CTEntry) Expired(now uint32) bool {
	return e.Lifetime < now
}

// CTClockNow returns the conntrack clock: whole seconds of CLOCK_MONOTONIC,
// which is what the datapath computes as bpf_ktime_get_ns() / 1e9 and stores
// in CTEntry.Lifetime.
func CTClockNow() (uint32, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0, fmt.Errorf("read CLOCK_MONOTONIC: %w", err)
	}
	return uint32(ts.Sec), nil
}

// WalkCT reads every entry of the conntrack map m with batch lookups of up
// to batchSize entries and calls fn with each batch, as Walk does.
func WalkCT[K CTKey](m Map, batchSize int, fn func(keys []K, values []CTEntry) error) error {
	if err := Walk(m, batchSize, fn); err != nil {
		return fmt.Errorf("walk conntrack map: %w", err)
	}
	return nil
}
