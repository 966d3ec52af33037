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
	// NAT6Map is its IPv6 twin (NAT6Key, NAT6Entry), of the same size.
	NAT6Map = "nodeport_nat6"
	// StatsMap holds per-CPU counts by Stat.
	StatsMap = "nodeport_stats"
	// SourceRange4Map holds the LoadBalancer frontends' source ranges
	// (SourceRangeKey).
	SourceRange4Map = "nodeport_srcrange4"
	// SourceRange6Map is its IPv6 twin (SourceRange6Key).
	SourceRange6Map = "nodeport_srcrange6"

	// Affinity4Map remembers, per client address and frontend, the
	// backend chosen last (ClientIP session affinity); an LRU.
	Affinity4Map = "nodeport_affinity4"
	// Affinity6Map is its IPv6 twin.
	Affinity6Map = "nodeport_affinity6"

	// MaglevMap holds each frontend's Maglev lookup table (MaglevKey ->
	// the backend IDs of its slots), with --lb-algorithm=maglev; its
	// value is sized by --lb-maglev-table-size (see MaglevMapSpec).
	MaglevMap = "lb_maglev"
)

// OwnMaps lists the maps the programs use besides the load balancer's.
var OwnMaps = [...]string{DevicesMap, NAT4Map, NAT6Map, StatsMap, SourceRange4Map, SourceRange6Map, Affinity4Map, Affinity6Map, MaglevMap}

// MaglevKey is the key of lb_maglev (struct lb_maglev_key): a frontend's
// rev-NAT index (service ID), IPv4 and IPv6 alike, one ID space.
type MaglevKey struct {
	RevNat bpf.Be16
	Pad    uint16
}

// MaglevMapSpec is lb_maglev's spec for tables of size slots; the
// programs must be loaded with the same Config.MaglevSize.
func MaglevMapSpec(size uint32) (*ebpf.MapSpec, error) {
	spec, err := MapSpec(MaglevMap, 0)
	if err != nil {
		return nil, err
	}
	if size == 0 {
		// Random selection: the programs never read it; one slot
		// keeps it small.
		size = 1
	}
	spec.ValueSize = 4 * size
	spec.Value = nil
	return spec, nil
}

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

// SourceRange6Key is the key of nodeport_srcrange6 (struct
// np_srcrange6_key), SourceRangeKey with an IPv6 address.
type SourceRange6Key struct {
	Prefixlen uint32 // 32 + the prefix's bits
	RevNat    bpf.Be16
	Pad       uint16
	Addr      [16]byte
}

// SourceRangeKeys returns the entries that let the prefixes of the
// frontend's family in to the frontend rev-NAT index id: its own entry
// (value 0) and one per prefix (value 1).
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

// SourceRange6Keys is SourceRangeKeys for an IPv6 frontend.
func SourceRange6Keys(id uint16, prefixes []netip.Prefix) map[SourceRange6Key]uint8 {
	out := map[SourceRange6Key]uint8{{Prefixlen: 32, RevNat: bpf.NewBe16(id)}: 0}
	for _, p := range prefixes {
		if !p.Addr().Is6() || p.Addr().Is4In6() {
			continue
		}
		out[SourceRange6Key{Prefixlen: 32 + uint32(p.Bits()), RevNat: bpf.NewBe16(id), Addr: p.Masked().Addr().As16()}] = 1
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
	Addr6 [16]byte
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

// NAT6Key is the key of nodeport_nat6 (struct np6_key).
type NAT6Key struct {
	SAddr, DAddr [16]byte
	SPort, DPort bpf.Be16
	Proto        uint8
	Dir          uint8
	Pad          [2]byte
}

// NAT6Entry is the value of nodeport_nat6 (struct np6_entry), NATEntry
// with IPv6 addresses.
type NAT6Entry struct {
	LastSeen uint64
	Addr     [16]byte
	NATAddr  [16]byte
	Port     bpf.Be16
	NATPort  bpf.Be16
	Flags    uint8
	Proto    uint8
	Pad      [2]byte
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
	DeviceSize   = 24
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
	StatReset
	StatUnreach
	statCount
)

// StatNames names each Stat, as metrics and the CLI show them.
var StatNames = [statCount]string{
	"new_local", "new_remote", "forward", "reply",
	"drop_no_backend", "drop_nat_full", "drop_nat_ports", "drop_no_snat_address", "drop_no_route", "drop_source_range", "reset_sent",
	"unreachable_sent",
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
	// MaglevSize is the size of the Maglev tables in lb_maglev (a
	// prime), 0 for random backend selection.
	MaglevSize uint32
}

// Maps are the maps the programs use.
type Maps struct {
	// The load balancer's (bpf.LB4ServicesMap, bpf.LB4BackendsMap,
	// bpf.LB6ServicesMap, bpf.LB6BackendsMap, bpf.LBAffinityMatchMap).
	Services4, Backends4, Services6, Backends6, AffinityMatch *ebpf.Map
	// The programs' own (see OwnMaps, MapSpec).
	Devices, NAT4, NAT6, Stats, SourceRange4, SourceRange6, Affinity4, Affinity6, Maglev *ebpf.Map
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
	// lb_maglev's value is one table: the object's size is the default's.
	mg, err := MaglevMapSpec(cfg.MaglevSize)
	if err != nil {
		return nil, err
	}
	spec.Maps[MaglevMap] = mg
	if m.Maglev != nil && m.Maglev.ValueSize() != mg.ValueSize {
		return nil, fmt.Errorf("%s holds tables of %d slots, the programs want %d", MaglevMap, m.Maglev.ValueSize()/4, mg.ValueSize/4)
	}
	if err := spec.Variables[nodeportVarMaglevSize].Set(cfg.MaglevSize); err != nil {
		return nil, fmt.Errorf("set %s: %w", nodeportVarMaglevSize, err)
	}
	return bpf.LoadPrograms(spec, map[string]*ebpf.Map{
		nodeportMapLb4Services:       m.Services4,
		nodeportMapLb4Backends:       m.Backends4,
		nodeportMapNodeportDevices:   m.Devices,
		nodeportMapNodeportNat4:      m.NAT4,
		nodeportMapNodeportStats:     m.Stats,
		nodeportMapNodeportSrcrange4: m.SourceRange4,
		nodeportMapLbAffinityMatch:   m.AffinityMatch,
		nodeportMapLb6Services:       m.Services6,
		nodeportMapLb6Backends:       m.Backends6,
		nodeportMapNodeportNat6:      m.NAT6,
		nodeportMapNodeportSrcrange6: m.SourceRange6,
		nodeportMapNodeportAffinity4: m.Affinity4,
		nodeportMapNodeportAffinity6: m.Affinity6,
		nodeportMapLbMaglev:          m.Maglev,
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
	if name == NAT4Map || name == NAT6Map {
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

// natKey and natEntry are the keys and values of both NAT maps.
type natKey interface {
	comparable
	dir() uint8
	flow(v any) Flow
	replyKey(v any) any
}

func (k NATKey) dir() uint8 { return k.Dir }

func (k NATKey) flow(e any) Flow {
	v := e.(NATEntry)
	f := Flow{
		Proto:    k.Proto,
		Client:   netip.AddrPortFrom(netip.AddrFrom4(k.SAddr), k.SPort.Uint16()),
		Frontend: netip.AddrPortFrom(netip.AddrFrom4(k.DAddr), k.DPort.Uint16()),
		Backend:  netip.AddrPortFrom(netip.AddrFrom4(v.Addr), v.Port.Uint16()),
		LastSeen: time.Duration(v.LastSeen),
	}
	if v.Flags&FlagSNAT != 0 {
		f.NAT = netip.AddrPortFrom(netip.AddrFrom4(v.NATAddr), v.NATPort.Uint16())
	}
	return f
}

func (k NATKey) replyKey(e any) any { return ReplyKey(k, e.(NATEntry)) }

func (k NAT6Key) dir() uint8 { return k.Dir }

func (k NAT6Key) flow(e any) Flow {
	v := e.(NAT6Entry)
	f := Flow{
		Proto:    k.Proto,
		Client:   netip.AddrPortFrom(netip.AddrFrom16(k.SAddr), k.SPort.Uint16()),
		Frontend: netip.AddrPortFrom(netip.AddrFrom16(k.DAddr), k.DPort.Uint16()),
		Backend:  netip.AddrPortFrom(netip.AddrFrom16(v.Addr), v.Port.Uint16()),
		LastSeen: time.Duration(v.LastSeen),
	}
	if v.Flags&FlagSNAT != 0 {
		f.NAT = netip.AddrPortFrom(netip.AddrFrom16(v.NATAddr), v.NATPort.Uint16())
	}
	return f
}

func (k NAT6Key) replyKey(e any) any {
	v := e.(NAT6Entry)
	r := NAT6Key{SAddr: v.Addr, SPort: v.Port, Proto: k.Proto, Dir: DirReply}
	if v.Flags&FlagSNAT != 0 {
		r.DAddr, r.DPort = v.NATAddr, v.NATPort
	} else {
		r.DAddr, r.DPort = k.SAddr, k.SPort
	}
	return r
}

// lastSeen and proto read either entry type.
func lastSeen(e any) uint64 {
	if v, ok := e.(NATEntry); ok {
		return v.LastSeen
	}
	return e.(NAT6Entry).LastSeen
}

func protoOf(e any) uint8 {
	if v, ok := e.(NATEntry); ok {
		return v.Proto
	}
	return e.(NAT6Entry).Proto
}

func readNAT[K natKey, V any](nat *ebpf.Map) (fwd, rev map[K]any, err error) {
	var (
		k K
		v V
	)
	fwd, rev = map[K]any{}, map[K]any{}
	it := nat.Iterate()
	for it.Next(&k, &v) {
		if k.dir() == DirForward {
			fwd[k] = v
		} else {
			rev[k] = v
		}
	}
	if err := it.Err(); err != nil {
		return nil, nil, fmt.Errorf("iterate the NAT map: %w", err)
	}
	return fwd, rev, nil
}

// Flows lists the forward entries of nodeport_nat4.
func Flows(nat *ebpf.Map) ([]Flow, error) { return flows[NATKey, NATEntry](nat) }

// Flows6 lists the forward entries of nodeport_nat6.
func Flows6(nat *ebpf.Map) ([]Flow, error) { return flows[NAT6Key, NAT6Entry](nat) }

func flows[K natKey, V any](nat *ebpf.Map) ([]Flow, error) {
	fwd, _, err := readNAT[K, V](nat)
	if err != nil {
		return nil, err
	}
	out := make([]Flow, 0, len(fwd))
	for k, v := range fwd {
		out = append(out, k.flow(v))
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

// Expire deletes the flows of nodeport_nat4 idle past their protocol's
// timeout at now (CLOCK_MONOTONIC): both entries of a flow together, when
// neither direction was seen within the timeout, and reply entries whose
// forward entry is gone. It returns how many entries it deleted and kept.
func Expire(nat *ebpf.Map, now time.Duration, cfg Config) (deleted, kept int, err error) {
	return expire[NATKey, NATEntry](nat, now, cfg)
}

// Expire6 is Expire for nodeport_nat6.
func Expire6(nat *ebpf.Map, now time.Duration, cfg Config) (deleted, kept int, err error) {
	return expire[NAT6Key, NAT6Entry](nat, now, cfg)
}

func expire[K natKey, V any](nat *ebpf.Map, now time.Duration, cfg Config) (deleted, kept int, err error) {
	fwd, rev, err := readNAT[K, V](nat)
	if err != nil {
		return 0, 0, err
	}
	idle := func(v any, last uint64) bool {
		timeout := cfg.UDPTimeout
		if protoOf(v) == 6 { // TCP
			timeout = cfg.TCPTimeout
		}
		return now-time.Duration(last) > timeout
	}
	var dead []K
	for k, v := range fwd {
		rk := k.replyKey(v).(K)
		last := lastSeen(v)
		r, ok := rev[rk]
		if ok {
			last = max(last, lastSeen(r))
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
		if idle(v, lastSeen(v)) {
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
