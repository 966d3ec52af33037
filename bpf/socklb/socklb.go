package socklb

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/cgrouplink"
)

// Names (and pin names) of the maps in which the programs remember, per
// socket, which frontend a backend was chosen for, so that replies and
// getpeername show the frontend. An IPv4-mapped frontend of an AF_INET6
// socket is remembered in the IPv4 map. They are socket storage (freed
// with the socket, so no socket's entries can push out another's): an
// older agent's pins of these names (LRU hashes) are replaced at start.
const (
	SockRevNat4Map = "lb4_sock_revnat"
	SockRevNat6Map = "lb6_sock_revnat"
)

// OwnMaps lists the maps the programs write themselves, as opposed to the
// load balancer's (bpf.LBMapNames): the agent creates them with MapSpec and
// pins them, so that what they remember survives a restart. The affinity
// maps (bpf.LB4AffinityMap, bpf.LB6AffinityMap) remember, per network
// namespace and service, the backend chosen last.
var OwnMaps = [...]string{SockRevNat4Map, SockRevNat6Map, bpf.LB4AffinityMap, bpf.LB6AffinityMap}

// Hooks lists the programs in attach order: the reverse translations come
// before the forward ones, so that no socket is translated one way while
// its replies cannot yet be translated back.
var Hooks = []cgrouplink.Hook{
	{Name: "recvmsg4", Program: socklbProgSock4Recvmsg, Attach: ebpf.AttachCGroupUDP4Recvmsg},
	{Name: "getpeername4", Program: socklbProgSock4Getpeername, Attach: ebpf.AttachCgroupInet4GetPeername},
	{Name: "recvmsg6", Program: socklbProgSock6Recvmsg, Attach: ebpf.AttachCGroupUDP6Recvmsg},
	{Name: "getpeername6", Program: socklbProgSock6Getpeername, Attach: ebpf.AttachCgroupInet6GetPeername},
	{Name: "connect4", Program: socklbProgSock4Connect, Attach: ebpf.AttachCGroupInet4Connect},
	{Name: "sendmsg4", Program: socklbProgSock4Sendmsg, Attach: ebpf.AttachCGroupUDP4Sendmsg},
	{Name: "connect6", Program: socklbProgSock6Connect, Attach: ebpf.AttachCGroupInet6Connect},
	{Name: "sendmsg6", Program: socklbProgSock6Sendmsg, Attach: ebpf.AttachCGroupUDP6Sendmsg},
}

// Spec returns the programs' collection spec, as compiled into the binary.
func Spec() (*ebpf.CollectionSpec, error) {
	return loadSocklb()
}

// Maps are the maps the programs use, all owned (and pinned) by the agent.
type Maps struct {
	// The load balancer's maps, which the agent writes (see
	// bpf.LBMapNames).
	Services4, Backends4, RevNat4 *ebpf.Map
	Services6, Backends6, RevNat6 *ebpf.Map
	AffinityMatch                 *ebpf.Map

	// The programs' own maps (see OwnMaps, MapSpec).
	SockRevNat4, SockRevNat6 *ebpf.Map
	Affinity4, Affinity6     *ebpf.Map

	// DNSSock is the sockets' storage of intercepted DNS (bpf.DNSSockMap),
	// the policy programs': recvmsg and getpeername give a socket whose
	// DNS the policy programs sent to the proxy its resolver back before
	// translating it. Nil: the programs' own, in which no socket is.
	DNSSock *ebpf.Map

	// XlateEvents and XlateLost, when set (both, from XlateMapSpecs),
	// make the programs report each translation of a connect() or
	// sendmsg() in XlateEvents (a ring of XlateEvent) and count in
	// XlateLost the ones it had no room for. Nil: they report nothing.
	XlateEvents, XlateLost *ebpf.Map
}

// XlateEvent is a translation the programs report (struct xlate_event):
// a socket of the cgroup CgroupID asked for Frontend and was sent to
// Backend. Addresses are IPv6 or IPv4-mapped, ports in network order.
type XlateEvent struct {
	TimeNs       uint64 // bpf_ktime_get_ns()
	CgroupID     uint64
	SockCookie   uint64
	Frontend     [16]byte
	Backend      [16]byte
	FrontendPort [2]byte
	BackendPort  [2]byte
	Protocol     uint8
	Pad          [3]uint8
}

// FrontendAddr is the address and port the socket asked for.
func (e *XlateEvent) FrontendAddr() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(e.Frontend).Unmap(), binary.BigEndian.Uint16(e.FrontendPort[:]))
}

// BackendAddr is the address and port the socket was sent to.
func (e *XlateEvent) BackendAddr() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(e.Backend).Unmap(), binary.BigEndian.Uint16(e.BackendPort[:]))
}

// DecodeXlateEvent decodes a record of the XlateEvents ring.
func DecodeXlateEvent(raw []byte) (XlateEvent, error) {
	var e XlateEvent
	if err := binary.Read(bytes.NewReader(raw), binary.LittleEndian, &e); err != nil {
		return e, fmt.Errorf("decode a translation event of %d bytes: %w", len(raw), err)
	}
	return e, nil
}

// XlateMapSpecs returns the specs of the maps that make the programs
// report translations (see Maps.XlateEvents): the ring and the per-CPU
// count of the events it had no room for.
func XlateMapSpecs() (events, lost *ebpf.MapSpec, err error) {
	spec, err := Spec()
	if err != nil {
		return nil, nil, err
	}
	return spec.Maps[socklbMapXlateEvents].Copy(), spec.Maps[socklbMapXlateLost].Copy(), nil
}

// Load loads the programs with m in place of the object's own map
// definitions, so that the programs read the maps the agent writes. The
// object's map sizes are only defaults: each definition takes the size and
// flags of the map that replaces it, which must otherwise agree (type, key
// and value sizes) or loading fails. Every map of m but DNSSock must be set.
//
// The caller owns the returned programs, keyed by program name.
func Load(m Maps) (map[string]*ebpf.Program, error) {
	spec, err := Spec()
	if err != nil {
		return nil, err
	}
	repl := map[string]*ebpf.Map{
		socklbMapLb4Services:     m.Services4,
		socklbMapLb4Backends:     m.Backends4,
		socklbMapLb4ReverseNat:   m.RevNat4,
		socklbMapLb6Services:     m.Services6,
		socklbMapLb6Backends:     m.Backends6,
		socklbMapLb6ReverseNat:   m.RevNat6,
		socklbMapLbAffinityMatch: m.AffinityMatch,
		socklbMapLb4SockRevnat:   m.SockRevNat4,
		socklbMapLb6SockRevnat:   m.SockRevNat6,
		socklbMapLb4Affinity:     m.Affinity4,
		socklbMapLb6Affinity:     m.Affinity6,
	}
	if m.DNSSock != nil {
		repl[socklbMapDnsSk] = m.DNSSock
	}
	if (m.XlateEvents == nil) != (m.XlateLost == nil) {
		return nil, fmt.Errorf("socket LB programs: the translation events' ring and lost count go together")
	}
	if m.XlateEvents != nil {
		if err := spec.Variables[socklbVarTraceXlate].Set(uint8(1)); err != nil {
			return nil, fmt.Errorf("socket LB programs: enable translation events: %w", err)
		}
		repl[socklbMapXlateEvents] = m.XlateEvents
		repl[socklbMapXlateLost] = m.XlateLost
	}
	return bpf.LoadPrograms(spec, repl, "socket LB programs")
}

// MapSpec returns the spec of the programs' own map called name (one of
// OwnMaps) with room for maxEntries entries, for the agent to create and
// pin it. The affinity maps are LRU hashes: when one is full, the entries
// used least recently make room. The socket reverse-NAT maps are socket
// storage, which has no size: maxEntries is ignored for them.
func MapSpec(name string, maxEntries uint32) (*ebpf.MapSpec, error) {
	if !slices.Contains(OwnMaps[:], name) {
		return nil, fmt.Errorf("%q is not a map of the socket LB programs (want one of %s)",
			name, strings.Join(OwnMaps[:], ", "))
	}
	spec, err := Spec()
	if err != nil {
		return nil, err
	}
	ms := spec.Maps[name].Copy()
	if ms.Type != ebpf.SkStorage {
		ms.MaxEntries = maxEntries
	}
	return ms, nil
}
