package bpf

import (
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Names (and pin file names) of the maps of packet-level enforcement: the
// programs on the host side of each pod's interface (bpf/c/policy.c,
// policy_from_pod and policy_to_pod).
const (
	// PolicyIfacesMap maps the ifindex of a pod interface's host side to
	// the pod (PolicyIfaceValue): its cgroup and its own addresses.
	PolicyIfacesMap = "policy_ifaces"
	// PolicyIfaceFlowsMap holds one LRU of flows per interface (a hash of
	// maps keyed by ifindex), so that no pod's traffic can push out
	// another pod's flows.
	PolicyIfaceFlowsMap = "policy_iface_flows"
	// PolicyIfaceFragsMap remembers the first fragments that passed, so
	// that the later ones (without ports) pass too: one LRU per interface
	// (a hash of maps keyed by ifindex), so that no pod's fragments can
	// push out another pod's.
	PolicyIfaceFragsMap = "policy_iface_frags"
	// PolicyIfaceStatsMap counts packet-level verdicts, spoofed packets
	// and frames that are neither IP nor ARP (per CPU).
	PolicyIfaceStatsMap = "policy_iface_stats"
)

// PolicyIfaceAddrs is how many addresses of its own a pod may send from.
const PolicyIfaceAddrs = 4

// PolicyIfaceUnclassifiedDeny (PolicyIfaceValue.Flags): a pod whose cgroup
// is in no endpoint yet is denied both ways.
const PolicyIfaceUnclassifiedDeny uint32 = 1 << 0

// PolicyIfaceNetns (PolicyIfaceValue.Flags): NetnsID is the pod's network
// namespace, where the programs ask the kernel for the pod's TCP
// connections. Without it, a TCP segment without SYN that policy denies and
// the interface's flows do not know is dropped.
const PolicyIfaceNetns uint32 = 1 << 1

// PolicyIfacePending (PolicyIfaceValue.Flags) marks the entry the apiary-cni
// plugin writes for a pod's interface before the agent has found the pod
// (cgroup 0 and PolicyIfaceUnclassifiedDeny: denied both ways). The
// programs do not read it; the agent does, to write the pod's own entry
// over it.
const PolicyIfacePending uint32 = 1 << 31

// Indexes of policy_iface_stats after the verdicts (direction *
// PolicyVerdicts + verdict, as in policy_stats).
const (
	PolicyIfaceStatsSpoofed = 2 * PolicyVerdicts
	PolicyIfaceStatsNotIP   = PolicyIfaceStatsSpoofed + 1
	// PolicyIfaceStatsUnparsable counts IP packets whose headers could
	// not be read to the ports, dropped.
	PolicyIfaceStatsUnparsable = PolicyIfaceStatsNotIP + 1
	// PolicyIfaceStatsFragUnknown counts later fragments dropped because
	// the interface does not know their first fragment: it was denied, or
	// the pod's own newer fragments pushed it out of its LRU.
	PolicyIfaceStatsFragUnknown = PolicyIfaceStatsUnparsable + 1
	PolicyIfaceStatsEntries     = PolicyIfaceStatsFragUnknown + 1
)

// DefaultPolicyIfaceFlows is the default capacity of each interface's
// flow LRU.
const DefaultPolicyIfaceFlows = 4096

// PolicyIfaceFrags is the capacity of each interface's LRU of first
// fragments: datagrams in flight in fragments, per pod.
const PolicyIfaceFrags = 1024

// PolicyIfaceValue is the value of policy_ifaces (struct policy_iface).
type PolicyIfaceValue struct {
	// CgroupID is the pod's cgroup: its key in policy_endpoints.
	CgroupID uint64
	// Flags are PolicyIface* flags.
	Flags uint32
	// NAddrs is how many of Addrs are the pod's.
	NAddrs uint8
	Pad    [3]byte
	// Addrs are the pod's addresses, IPv4 mapped into IPv6.
	Addrs [PolicyIfaceAddrs][16]byte
	// NetnsID is the pod's network namespace by its id in the host's
	// (IFLA_LINK_NETNSID of the interface's host side), with
	// PolicyIfaceNetns.
	NetnsID int32
	Pad2    uint32
}

// SetNetns records the pod's network namespace by its id in the host's
// network namespace; a negative id (none assigned) records none.
func (v *PolicyIfaceValue) SetNetns(id int) {
	v.Flags &^= PolicyIfaceNetns
	v.NetnsID = 0
	if id >= 0 && id <= 1<<31-1 {
		v.Flags |= PolicyIfaceNetns
		v.NetnsID = int32(id)
	}
}

// NewPolicyIfaceValue returns the value for the pod of cgroup cgroupID
// with addresses addrs; more than PolicyIfaceAddrs is an error.
func NewPolicyIfaceValue(cgroupID uint64, flags uint32, addrs []netip.Addr) (PolicyIfaceValue, error) {
	v := PolicyIfaceValue{CgroupID: cgroupID, Flags: flags}
	if len(addrs) > PolicyIfaceAddrs {
		return v, fmt.Errorf("%d addresses, at most %d fit", len(addrs), PolicyIfaceAddrs)
	}
	for i, a := range addrs {
		v.Addrs[i] = a.As16() // IPv4 as ::ffff:a.b.c.d
	}
	v.NAddrs = uint8(len(addrs))
	return v, nil
}

// PolicyIfaceFlowKey is the key of an interface's flow LRU (struct
// iface_flow): the peer, its port and the pod's port, and the protocol.
type PolicyIfaceFlowKey struct {
	Peer      [16]byte
	PeerPort  Be16
	LocalPort Be16
	Protocol  uint8
	Pad       [3]byte
}

// PolicyIfaceFragKey is the key of an interface's LRU of first fragments
// (struct iface_frag).
type PolicyIfaceFragKey struct {
	ID       uint32
	SAddr    [16]byte
	DAddr    [16]byte
	Protocol uint8
	Pad      [3]byte
}

// PolicyIfacesMapSpec returns the spec of policy_ifaces.
func PolicyIfacesMapSpec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       PolicyIfacesMap,
		Type:       ebpf.Hash,
		KeySize:    4,
		ValueSize:  88,
		MaxEntries: maxEntries,
		Flags:      unix.BPF_F_NO_PREALLOC,
		Pinning:    ebpf.PinByName,
	}
}

// PolicyIfaceFlowsInnerSpec returns the spec of one interface's flow LRU,
// with room for maxEntries flows.
func PolicyIfaceFlowsInnerSpec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       "iface_flows",
		Type:       ebpf.LRUHash,
		KeySize:    24,
		ValueSize:  4,
		MaxEntries: maxEntries,
	}
}

// PolicyIfaceFlowsMapSpec returns the spec of policy_iface_flows, whose
// inner maps have room for flows flows each.
func PolicyIfaceFlowsMapSpec(maxEntries, flows uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       PolicyIfaceFlowsMap,
		Type:       ebpf.HashOfMaps,
		KeySize:    4,
		ValueSize:  4,
		MaxEntries: maxEntries,
		InnerMap:   PolicyIfaceFlowsInnerSpec(flows),
		Pinning:    ebpf.PinByName,
	}
}

// PolicyIfaceFragsInnerSpec returns the spec of one interface's LRU of
// first fragments.
func PolicyIfaceFragsInnerSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       "iface_frags",
		Type:       ebpf.LRUHash,
		KeySize:    40,
		ValueSize:  4,
		MaxEntries: PolicyIfaceFrags,
	}
}

// PolicyIfaceFragsMapSpec returns the spec of policy_iface_frags, a hash
// of maps with room for maxEntries interfaces.
func PolicyIfaceFragsMapSpec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       PolicyIfaceFragsMap,
		Type:       ebpf.HashOfMaps,
		KeySize:    4,
		ValueSize:  4,
		MaxEntries: maxEntries,
		InnerMap:   PolicyIfaceFragsInnerSpec(),
		Pinning:    ebpf.PinByName,
	}
}

// PolicyIfaceStatsMapSpec returns the spec of policy_iface_stats.
func PolicyIfaceStatsMapSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       PolicyIfaceStatsMap,
		Type:       ebpf.PerCPUArray,
		KeySize:    4,
		ValueSize:  8,
		MaxEntries: PolicyIfaceStatsEntries,
		Pinning:    ebpf.PinByName,
	}
}
