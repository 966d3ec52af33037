package bpf

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Names of the load-balancing maps the agent writes, which are also their
// pins' file names.
const (
	// LB4ServicesMap maps (frontend address, port, protocol, slot) to the
	// service entry (slot 0) or one of its backends (slots 1..).
	LB4ServicesMap = "lb4_services"
	// LB4BackendsMap maps a backend ID to the backend's address.
	LB4BackendsMap = "lb4_backends"
	// LB4RevNatMap maps a rev-NAT index (a service ID) to the frontend
	// address that replies are translated back to.
	LB4RevNatMap = "lb4_reverse_nat"
	// LB6ServicesMap, LB6BackendsMap and LB6RevNatMap are the IPv6 twins,
	// with 16-byte addresses. Service and backend IDs are one space for
	// both families.
	LB6ServicesMap = "lb6_services"
	LB6BackendsMap = "lb6_backends"
	LB6RevNatMap   = "lb6_reverse_nat"
	// LBAffinityMatchMap holds (backend ID, service ID) for each active
	// backend of a service with session affinity: the datapath follows a
	// client's remembered backend only while its entry is there.
	LBAffinityMatchMap = "lb_affinity_match"
)

// LBMapNames lists the load-balancing maps the agent writes.
var LBMapNames = [...]string{
	LB4ServicesMap, LB4BackendsMap, LB4RevNatMap,
	LB6ServicesMap, LB6BackendsMap, LB6RevNatMap,
	LBAffinityMatchMap,
}

// Byte sizes of the load-balancing keys and values, as the datapath's C
// structs (struct lb4_key, lb4_service, lb4_backend, lb4_reverse_nat) lay
// them out.
const (
	LB4ServiceKeySize   = 12
	LB4ServiceValueSize = 12
	LB4BackendKeySize   = 4
	LB4BackendValueSize = 12
	LB4RevNatKeySize    = 2
	LB4RevNatValueSize  = 6

	LB6ServiceKeySize   = 24
	LB6ServiceValueSize = 12
	LB6BackendKeySize   = 4
	LB6BackendValueSize = 24
	LB6RevNatKeySize    = 2
	LB6RevNatValueSize  = 18

	LBAffinityMatchKeySize   = 8
	LBAffinityMatchValueSize = 1
)

// LB4ServiceKey is the key of lb4_services (struct lb4_key). Slot 0 is the
// service entry; slots 1..count+qcount hold the backends.
type LB4ServiceKey struct {
	Address [4]byte
	Port    Be16
	Slot    uint16
	Proto   uint8 // IANA protocol number
	Scope   uint8
	Pad     [2]byte
}

// LB4ServiceValue is the value of lb4_services (struct lb4_service). In slot
// 0, BackendID carries the LB algorithm and affinity timeout (0: random, no
// affinity), Count the number of active backends and QCount the terminating
// ones after them, used only when Count is 0. In the other slots only
// BackendID, RevNat and Flags are set.
type LB4ServiceValue struct {
	BackendID uint32
	Count     uint16
	RevNat    Be16
	Flags     ServiceFlags
	Flags2    uint8
	QCount    uint16
}

// LB6ServiceKey is the key of lb6_services (struct lb6_key): LB4ServiceKey
// with a 16-byte address.
type LB6ServiceKey struct {
	Address [16]byte
	Port    Be16
	Slot    uint16
	Proto   uint8 // IANA protocol number, 0 for a wildcard
	Scope   uint8
	Pad     [2]byte
}

// LB6ServiceValue is the value of lb6_services (struct lb6_service), which
// the datapath lays out as the IPv4 one.
type LB6ServiceValue = LB4ServiceValue

// AffinityTimeoutMask keeps the affinity timeout (seconds) in the
// BackendID field of a service entry (slot 0); the top 8 bits are the LB
// algorithm, 0 (random) here.
const AffinityTimeoutMask = 0xFFFFFF

// ServiceFlags are the low 8 bits of a service's flags (SVC_FLAG_* in the
// datapath). A ClusterIP service has none of the type bits.
type ServiceFlags uint8

// Service flags apiary sets.
const (
	SvcFlagExternalIPs ServiceFlags = 1 << 0
	SvcFlagNodePort    ServiceFlags = 1 << 1
	// SvcFlagSessionAffinity: the low 24 bits of the service entry's
	// BackendID are the ClientIP affinity timeout in seconds.
	SvcFlagSessionAffinity ServiceFlags = 1 << 4
	SvcFlagLoadBalancer    ServiceFlags = 1 << 5
	// SvcFlagRoutable marks addresses that are reachable from outside the
	// node (every type but ClusterIP).
	SvcFlagRoutable ServiceFlags = 1 << 6
)

// String names the service type and routability, e.g. "ClusterIP" or
// "LoadBalancer+routable".
func (f ServiceFlags) String() string {
	var parts []string
	switch {
	case f&SvcFlagExternalIPs != 0:
		parts = append(parts, "ExternalIP")
	case f&SvcFlagNodePort != 0:
		parts = append(parts, "NodePort")
	case f&SvcFlagLoadBalancer != 0:
		parts = append(parts, "LoadBalancer")
	default:
		parts = append(parts, "ClusterIP")
	}
	if f&SvcFlagSessionAffinity != 0 {
		parts = append(parts, "sessionAffinity")
	}
	if f&SvcFlagRoutable != 0 {
		parts = append(parts, "routable")
	}
	if rest := f &^ (SvcFlagExternalIPs | SvcFlagNodePort | SvcFlagLoadBalancer | SvcFlagSessionAffinity | SvcFlagRoutable); rest != 0 {
		parts = append(parts, fmt.Sprintf("%#x", uint8(rest)))
	}
	return strings.Join(parts, "+")
}

// LB4BackendValue is the value of lb4_backends (struct lb4_backend); the key
// is the backend ID, a host-order uint32.
type LB4BackendValue struct {
	Address   [4]byte
	Port      Be16
	Proto     uint8 // IANA protocol number
	State     BackendState
	ClusterID uint16
	Zone      uint8
	Pad       uint8
}

// LB6BackendValue is the value of lb6_backends (struct lb6_backend).
type LB6BackendValue struct {
	Address   [16]byte
	Port      Be16
	Proto     uint8 // IANA protocol number
	State     BackendState
	ClusterID uint16
	Zone      uint8
	Pad       uint8
}

// BackendState is a backend's state as the datapath sees it (the flags field
// of struct lb4_backend).
type BackendState uint8

// Backend states.
const (
	// BackendActive backends are chosen for new connections.
	BackendActive BackendState = 0
	// BackendTerminating backends keep their connections and are chosen
	// only when a service has no active backend.
	BackendTerminating BackendState = 1
	// BackendQuarantined backends failed health checks.
	BackendQuarantined BackendState = 2
	// BackendMaintenance backends are not chosen at all, but keep their
	// entry so that established connections to them still work.
	BackendMaintenance BackendState = 3
)

// String returns "active", "terminating", "quarantined" or "maintenance".
func (s BackendState) String() string {
	switch s {
	case BackendActive:
		return "active"
	case BackendTerminating:
		return "terminating"
	case BackendQuarantined:
		return "quarantined"
	case BackendMaintenance:
		return "maintenance"
	}
	return fmt.Sprintf("state-%d", uint8(s))
}

// LB4RevNatValue is the value of lb4_reverse_nat (struct lb4_reverse_nat);
// the key is the rev-NAT index in network order (Be16).
type LB4RevNatValue struct {
	Address [4]byte
	Port    Be16
}

// LB6RevNatValue is the value of lb6_reverse_nat (struct lb6_reverse_nat,
// packed: 18 bytes); the key is the rev-NAT index in network order.
type LB6RevNatValue struct {
	Address [16]byte
	Port    Be16
}

// LBAffinityMatchKey is the key of lb_affinity_match (struct
// lb_affinity_match); the value is one byte, 0.
type LBAffinityMatchKey struct {
	BackendID uint32
	RevNat    Be16
	Pad       uint16
}

// LBMapSpec returns the spec of the load-balancing map called name with room
// for maxEntries entries. The maps are hashes without preallocation, so an
// empty map costs next to nothing whatever its size.
func LBMapSpec(name string, maxEntries uint32) (*ebpf.MapSpec, error) {
	spec := &ebpf.MapSpec{
		Name:       name,
		Type:       ebpf.Hash,
		MaxEntries: maxEntries,
		Flags:      unix.BPF_F_NO_PREALLOC,
	}
	switch name {
	case LB4ServicesMap:
		spec.KeySize, spec.ValueSize = LB4ServiceKeySize, LB4ServiceValueSize
	case LB4BackendsMap:
		spec.KeySize, spec.ValueSize = LB4BackendKeySize, LB4BackendValueSize
	case LB4RevNatMap:
		spec.KeySize, spec.ValueSize = LB4RevNatKeySize, LB4RevNatValueSize
	case LB6ServicesMap:
		spec.KeySize, spec.ValueSize = LB6ServiceKeySize, LB6ServiceValueSize
	case LB6BackendsMap:
		spec.KeySize, spec.ValueSize = LB6BackendKeySize, LB6BackendValueSize
	case LB6RevNatMap:
		spec.KeySize, spec.ValueSize = LB6RevNatKeySize, LB6RevNatValueSize
	case LBAffinityMatchMap:
		spec.KeySize, spec.ValueSize = LBAffinityMatchKeySize, LBAffinityMatchValueSize
	default:
		return nil, fmt.Errorf("%q is not a load-balancing map (want one of %s)",
			name, strings.Join(LBMapNames[:], ", "))
	}
	return spec, nil
}

// L4Addr returns the address and port a service key stands for.
func (k LB4ServiceKey) L4Addr() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4(k.Address), k.Port.Uint16())
}

// L4Addr returns the backend's address and port.
func (v LB4BackendValue) L4Addr() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4(v.Address), v.Port.Uint16())
}

// L4Addr returns the frontend address and port replies are translated to.
func (v LB4RevNatValue) L4Addr() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom4(v.Address), v.Port.Uint16())
}

// L4Addr returns the address and port a service key stands for.
func (k LB6ServiceKey) L4Addr() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(k.Address), k.Port.Uint16())
}

// L4Addr returns the backend's address and port.
func (v LB6BackendValue) L4Addr() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(v.Address), v.Port.Uint16())
}

// L4Addr returns the frontend address and port replies are translated to.
func (v LB6RevNatValue) L4Addr() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(v.Address), v.Port.Uint16())
}

// Names of the maps the socket LB programs write themselves (the agent
// only pins them and removes what is stale).
const (
	// LB4AffinityMap and LB6AffinityMap remember, per client network
	// namespace and service, the backend chosen last and when.
	LB4AffinityMap = "lb4_affinity"
	LB6AffinityMap = "lb6_affinity"
)

// LB4AffinityKey is the key of lb4_affinity (struct lb4_affinity_key). The
// socket LB keys by network namespace cookie (NetnsCookie 1).
type LB4AffinityKey struct {
	ClientID    uint64
	RevNat      Be16
	NetnsCookie uint8
	Pad1        uint8
	Pad2        uint32
}

// LB6AffinityKey is the key of lb6_affinity (struct lb6_affinity_key):
// the client ID has room for an IPv6 address; the socket LB puts the
// network namespace cookie in its first 8 bytes.
type LB6AffinityKey struct {
	ClientID    [16]byte
	RevNat      Be16
	NetnsCookie uint8
	Pad1        uint8
	Pad2        uint32
}

// LBAffinityValue is the value of both affinity maps (struct
// lb_affinity_val): when the client last used the backend (CLOCK_MONOTONIC,
// nanoseconds, as bpf_ktime_get_ns) and which one.
type LBAffinityValue struct {
	LastUsed  uint64
	BackendID uint32
	Pad       uint32
}

// The keys and values of the load-balancing maps, built in one place: the
// LB reconciler writes these, and tests that fill maps by hand use them
// too, so that they hold what the agent writes.

// NewLB4ServiceKey returns the lb4_services key of slot (0: the master
// entry) of the frontend addr (IPv4) with protocol proto (0: any).
func NewLB4ServiceKey(addr netip.AddrPort, proto uint8, slot uint16) LB4ServiceKey {
	return LB4ServiceKey{Address: addr.Addr().As4(), Port: NewBe16(addr.Port()), Slot: slot, Proto: proto}
}

// NewLB6ServiceKey is NewLB4ServiceKey for lb6_services.
func NewLB6ServiceKey(addr netip.AddrPort, proto uint8, slot uint16) LB6ServiceKey {
	return LB6ServiceKey{Address: addr.Addr().As16(), Port: NewBe16(addr.Port()), Slot: slot, Proto: proto}
}

// NewLBMasterValue returns the master entry (slot 0) of the frontend with
// service ID id: count active and qcount terminating backends, the
// frontend's flags, and with SvcFlagSessionAffinity its affinity timeout
// in seconds. Both families' maps hold this value.
func NewLBMasterValue(id, count, qcount uint16, flags ServiceFlags, affinityTimeout uint32) LB4ServiceValue {
	return LB4ServiceValue{BackendID: affinityTimeout, Count: count, QCount: qcount, RevNat: NewBe16(id), Flags: flags}
}

// NewLBSlotValue returns a backend slot of the frontend with service ID id
// and flags: the backend's ID.
func NewLBSlotValue(backend uint32, id uint16, flags ServiceFlags) LB4ServiceValue {
	return LB4ServiceValue{BackendID: backend, RevNat: NewBe16(id), Flags: flags}
}

// NewLB4BackendValue returns the lb4_backends value of the backend at addr
// (IPv4) with protocol proto in state.
func NewLB4BackendValue(addr netip.AddrPort, proto uint8, state BackendState) LB4BackendValue {
	return LB4BackendValue{Address: addr.Addr().As4(), Port: NewBe16(addr.Port()), Proto: proto, State: state}
}

// NewLB6BackendValue is NewLB4BackendValue for lb6_backends.
func NewLB6BackendValue(addr netip.AddrPort, proto uint8, state BackendState) LB6BackendValue {
	return LB6BackendValue{Address: addr.Addr().As16(), Port: NewBe16(addr.Port()), Proto: proto, State: state}
}

// NewLB4RevNatValue returns the lb4_reverse_nat value of the frontend addr
// (IPv4), which replies are translated back to.
func NewLB4RevNatValue(addr netip.AddrPort) LB4RevNatValue {
	return LB4RevNatValue{Address: addr.Addr().As4(), Port: NewBe16(addr.Port())}
}

// NewLB6RevNatValue is NewLB4RevNatValue for lb6_reverse_nat.
func NewLB6RevNatValue(addr netip.AddrPort) LB6RevNatValue {
	return LB6RevNatValue{Address: addr.Addr().As16(), Port: NewBe16(addr.Port())}
}
