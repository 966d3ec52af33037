package socklb

import (
	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/cgrouplink"
)

// SockRevNatMap is the name (and pin name) of the map in which the programs
// remember, per socket, which frontend a backend was chosen for.
const SockRevNatMap = "lb4_sock_revnat"

// Hooks lists the programs in attach order: the reverse translations come
// before the forward ones, so that no socket is translated one way while
// its replies cannot yet be translated back.
var Hooks = []cgrouplink.Hook{
	{Name: "recvmsg4", Program: socklbProgSock4Recvmsg, Attach: ebpf.AttachCGroupUDP4Recvmsg},
	{Name: "getpeername4", Program: socklbProgSock4Getpeername, Attach: ebpf.AttachCgroupInet4GetPeername},
	{Name: "connect4", Program: socklbProgSock4Connect, Attach: ebpf.AttachCGroupInet4Connect},
	{Name: "sendmsg4", Program: socklbProgSock4Sendmsg, Attach: ebpf.AttachCGroupUDP4Sendmsg},
}

// Spec returns the programs' collection spec, as compiled into the binary.
func Spec() (*ebpf.CollectionSpec, error) {
	return loadSocklb()
}

// Maps are the maps the programs use, all owned (and pinned) by the agent.
type Maps struct {
	Services, Backends, RevNat, SockRevNat *ebpf.Map
}

// Load loads the programs with m in place of the object's own map
// definitions, so that the programs read the maps the agent writes. The
// object's map sizes are only defaults: each definition takes the size and
// flags of the map that replaces it, which must otherwise agree (type, key
// and value sizes) or loading fails.
//
// The caller owns the returned programs, keyed by program name.
func Load(m Maps) (map[string]*ebpf.Program, error) {
	spec, err := Spec()
	if err != nil {
		return nil, err
	}
	repl := map[string]*ebpf.Map{
		socklbMapLb4Services:   m.Services,
		socklbMapLb4Backends:   m.Backends,
		socklbMapLb4ReverseNat: m.RevNat,
		socklbMapLb4SockRevnat: m.SockRevNat,
	}
	return bpf.LoadPrograms(spec, repl, "socket LB programs")
}

// SockRevNatSpec returns the spec of the socket reverse-NAT map, for the
// agent to pin it (so that replies on existing sockets keep being
// translated across restarts).
func SockRevNatSpec(maxEntries uint32) (*ebpf.MapSpec, error) {
	spec, err := Spec()
	if err != nil {
		return nil, err
	}
	ms := spec.Maps[socklbMapLb4SockRevnat].Copy()
	ms.MaxEntries = maxEntries
	return ms, nil
}
