package socklb

import (
	"fmt"
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
