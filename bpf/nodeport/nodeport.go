package nodeport

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
)

// Names (and pin names) of the programs' own maps.
const (
	// DevicesMap maps an external device's ifindex to the address remote
	// backends see as the source of what leaves through it (Device).
	DevicesMap = "nodeport_devices"
	// NAT4Map holds each translated flow's forward and reply tuples
	// (NATKey, NATEntry), sized by --bpf-nat-max.
	NAT4Map = "nodeport_nat4"
	// StatsMap holds per-CPU counts by Stat.
	StatsMap = "nodeport_stats"
	// SourceRange4Map holds the LoadBalancer frontends' source ranges
	// (SourceRangeKey).
	SourceRange4Map = "nodeport_srcrange4"

	// Affinity4Map remembers, per client address and frontend, the
	// backend chosen last (ClientIP session affinity); an LRU.
	Affinity4Map = "nodeport_affinity4"
)

// OwnMaps lists the maps the programs use besides the load balancer's.
var OwnMaps = [...]string{DevicesMap, NAT4Map, StatsMap, SourceRange4Map, Affinity4Map}

// SourceRangeKey is the key of nodeport_srcrange4 (struct
// np_srcrange4_key): a frontend's (rev-NAT index) client prefix. The
// frontend's own entry, Prefixlen 32 with value 0, denies what no prefix
// of its (value 1) allows.
type SourceRangeKey struct {
	Prefixlen uint32 // 32 + the prefix's bits
	RevNat    bpf.Be16
	Pad       uint16
	Addr      [4]byte
}

// SourceRangeKeys returns the entries that let the prefixes in to the
// frontend rev-NAT index id: its own entry (value 0) first.
func SourceRangeKeys(id uint16, prefixes []netip.Prefix) map[SourceRangeKey]uint8 {
	out := map[SourceRangeKey]uint8{{Prefixlen: 32, RevNat: bpf.NewBe16(id)}: 0}
	for _, p := range prefixes {
		if !p.Addr().Is4() {
			continue
		}
		out[SourceRangeKey{Prefixlen: 32 + uint32(p.Bits()), RevNat: bpf.NewBe16(id), Addr: p.Masked().Addr().As4()}] = 1
	}
	return out
}

// Program names: the ingress and egress programs of an external device.
const (
	IngressProg = nodeportProgNodeportIngress
	EgressProg  = nodeportProgNodeportEgress
)

// Device is the value of nodeport_devices (struct np_device).
type Device struct {
	Addr4 [4]byte
	Flags uint32
}

// Directions of a NATKey.
const (
	DirForward uint8 = 0 // as the client sent it
	DirReply   uint8 = 1 // as the backend's reply arrives
)

// NATKey is the key of nodeport_nat4 (struct np4_key); addresses and
// ports in network order.
type NATKey struct {
	SAddr, DAddr [4]byte
	SPort, DPort bpf.Be16
	Proto        uint8
	Dir          uint8
	Pad          [2]byte
}

// FlagSNAT marks the entries of a flow to a remote backend, whose source
// was rewritten.
const FlagSNAT uint8 = 0x1

// NATEntry is the value of nodeport_nat4 (struct np4_entry). Forward: Addr
// and Port the backend, NATAddr and NATPort the source it sees (zero when
// the client's is kept). Reply: Addr and Port the client, NATAddr and
// NATPort the frontend it sent to.
type NATEntry struct {
	LastSeen uint64 // CLOCK_MONOTONIC nanoseconds
	Addr     [4]byte
	NATAddr  [4]byte
	Port     bpf.Be16
	NATPort  bpf.Be16
	Flags    uint8
	Proto    uint8
	Pad      [2]byte
}

// Byte sizes of the structs above, as the C lays them out.
const (
	DeviceSize   = 8
	NATKeySize   = 16
	NATEntrySize = 24
)

var _ = [1]struct{}{}[unsafe.Sizeof(Device{})-DeviceSize]
var _ = [1]struct{}{}[unsafe.Sizeof(NATKey{})-NATKeySize]
var _ = [1]struct{}{}[unsafe.Sizeof(NATEntry{})-NATEntrySize]

// Stat indexes nodeport_stats.
type Stat uint32

// The counts, in the order of NP_STAT_* in nodeport.c.
const (
	StatNewLocal Stat = iota
	StatNewRemote
	StatForward
	StatReply
	StatNoBackend
	StatNATFull
	StatNATPorts
	StatNoSNATAddr
	StatNoRoute
	StatSourceRange
	statCount
)

// StatNames names each Stat, as metrics and the CLI show them.
var StatNames = [statCount]string{
	"new_local", "new_remote", "forward", "reply",
	"drop_no_backend", "drop_nat_full", "drop_nat_ports", "drop_no_snat_address", "drop_no_route", "drop_source_range",
}

// NAT port range the programs allocate from: above Linux's default
// ephemeral ports, so that the node's own sockets rarely meet it.
const (
	NATPortMin = 61000
	NATPortMax = 65535
)

// Spec returns the programs' collection spec, as compiled into the binary.
func Spec() (*ebpf.CollectionSpec, error) {
	return loadNodeport()
}

// Config holds the programs' constants.
type Config struct {
	// TCPTimeout and UDPTimeout are how long a flow may be idle before
	// its NAT port may be taken by another.
	TCPTimeout, UDPTimeout time.Duration
}

// Maps are the maps the programs use.
type Maps struct {
	// The load balancer's (bpf.LB4ServicesMap, bpf.LB4BackendsMap,
	// bpf.LBAffinityMatchMap).
	Services4, Backends4, AffinityMatch *ebpf.Map
	// The programs' own (see OwnMaps, MapSpec).
	Devices, NAT4, Stats, SourceRange4, Affinity4 *ebpf.Map
}

// Load loads the programs with m in place of the object's map definitions.
// The caller owns the returned programs, keyed by program name.
func Load(cfg Config, m Maps) (map[string]*ebpf.Program, error) {
	spec, err := Spec()
	if err != nil {
		return nil, err
	}
	for name, v := range map[string]uint64{
		nodeportVarTcpTimeoutNs: uint64(cfg.TCPTimeout),
		nodeportVarUdpTimeoutNs: uint64(cfg.UDPTimeout),
	} {
		if err := spec.Variables[name].Set(v); err != nil {
			return nil, fmt.Errorf("set %s: %w", name, err)
		}
	}
	return bpf.LoadPrograms(spec, map[string]*ebpf.Map{
		nodeportMapLb4Services:       m.Services4,
		nodeportMapLb4Backends:       m.Backends4,
		nodeportMapNodeportDevices:   m.Devices,
		nodeportMapNodeportNat4:      m.NAT4,
		nodeportMapNodeportStats:     m.Stats,
		nodeportMapNodeportSrcrange4: m.SourceRange4,
		nodeportMapLbAffinityMatch:   m.AffinityMatch,
		nodeportMapNodeportAffinity4: m.Affinity4,
	}, "nodeport programs")
}

// MapSpec returns the spec of the programs' own map called name (one of
// OwnMaps); maxEntries sizes the NAT map, the others keep their size.
func MapSpec(name string, maxEntries uint32) (*ebpf.MapSpec, error) {
	if !slices.Contains(OwnMaps[:], name) {
		return nil, fmt.Errorf("%q is not a map of the nodeport programs (want one of %s)",
			name, strings.Join(OwnMaps[:], ", "))
	}
	spec, err := Spec()
	if err != nil {
		return nil, err
	}
	ms := spec.Maps[name].Copy()
	if name == NAT4Map {
		ms.MaxEntries = maxEntries
	}
	return ms, nil
}

// Flow is one translated flow, as the NAT map holds it.
type Flow struct {
	Proto    uint8
	Client   netip.AddrPort
	Frontend netip.AddrPort
	Backend  netip.AddrPort
	// NAT is the source the backend sees; invalid when the client's is
	// kept (a local backend).
	NAT      netip.AddrPort
	LastSeen time.Duration // CLOCK_MONOTONIC
}

func addrPort(a [4]byte, p bpf.Be16) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4(a), p.Uint16())
}

// Flows lists the forward entries of the NAT map.
func Flows(nat *ebpf.Map) ([]Flow, error) {
	var (
		k   NATKey
		v   NATEntry
		out []Flow
	)
	it := nat.Iterate()
	for it.Next(&k, &v) {
		if k.Dir != DirForward {
			continue
		}
		f := Flow{
			Proto:    k.Proto,
			Client:   addrPort(k.SAddr, k.SPort),
			Frontend: addrPort(k.DAddr, k.DPort),
			Backend:  addrPort(v.Addr, v.Port),
			LastSeen: time.Duration(v.LastSeen),
		}
		if v.Flags&FlagSNAT != 0 {
			f.NAT = addrPort(v.NATAddr, v.NATPort)
		}
		out = append(out, f)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate %s: %w", NAT4Map, err)
	}
	return out, nil
}

// Stats sums the per-CPU counts of the stats map.
func Stats(m *ebpf.Map) (map[string]uint64, error) {
	out := make(map[string]uint64, statCount)
	for i := range statCount {
		var per []uint64
		if err := m.Lookup(uint32(i), &per); err != nil {
			return nil, fmt.Errorf("read %s[%d]: %w", StatsMap, i, err)
		}
		var sum uint64
		for _, n := range per {
			sum += n
		}
		out[StatNames[i]] = sum
	}
	return out, nil
}

// ReplyKey returns the key of the reply entry of the flow whose forward
// entry is (k, v).
func ReplyKey(k NATKey, v NATEntry) NATKey {
	r := NATKey{SAddr: v.Addr, SPort: v.Port, Proto: k.Proto, Dir: DirReply}
	if v.Flags&FlagSNAT != 0 {
		r.DAddr, r.DPort = v.NATAddr, v.NATPort
	} else {
		r.DAddr, r.DPort = k.SAddr, k.SPort
	}
	return r
}

// Expire deletes the flows idle past their protocol's timeout at now
// (CLOCK_MONOTONIC): both entries of a flow together, when neither
// direction was seen within the timeout, and reply entries whose forward
// entry is gone. It returns how many entries it deleted and kept.
func Expire(nat *ebpf.Map, now time.Duration, cfg Config) (deleted, kept int, err error) {
	var (
		k NATKey
		v NATEntry
	)
	fwd := map[NATKey]NATEntry{}
	rev := map[NATKey]NATEntry{}
	it := nat.Iterate()
	for it.Next(&k, &v) {
		if k.Dir == DirForward {
			fwd[k] = v
		} else {
			rev[k] = v
		}
	}
	if err := it.Err(); err != nil {
		return 0, 0, fmt.Errorf("iterate %s: %w", NAT4Map, err)
	}
	idle := func(v NATEntry, last uint64) bool {
		timeout := cfg.UDPTimeout
		if v.Proto == 6 { // TCP
			timeout = cfg.TCPTimeout
		}
		return now-time.Duration(last) > timeout
	}
	var dead []NATKey
	for k, v := range fwd {
		rk := ReplyKey(k, v)
		last := v.LastSeen
		r, ok := rev[rk]
		if ok {
			last = max(last, r.LastSeen)
			delete(rev, rk)
		}
		if !idle(v, last) {
			kept += 1 + btoi(ok)
			continue
		}
		dead = append(dead, k)
		if ok {
			dead = append(dead, rk)
		}
	}
	for k, v := range rev {
		if idle(v, v.LastSeen) {
			dead = append(dead, k)
		} else {
			kept++ // being made: its forward entry follows
		}
	}
	for _, k := range dead {
		if err := nat.Delete(&k); err == nil {
			deleted++
		}
	}
	return deleted, kept, nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
