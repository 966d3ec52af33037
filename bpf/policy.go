package bpf

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Names (and pin file names) of the policy enforcement maps.
const (
	// PolicyMap is the LPM trie of every endpoint's policy entries,
	// keyed by endpoint ID, remote identity and direction, then protocol,
	// then destination port.
	PolicyMap = "policy"
	// PolicyEndpointsMap maps the cgroup ID of an endpoint (a pod's
	// cgroup) to its endpoint ID and enforcement flags.
	PolicyEndpointsMap = "policy_endpoints"
	// PolicyEndpointsGenMap holds one counter (a uint64 at key 0) that
	// the agent increments after each change of policy_endpoints: the
	// programs keep what they found for a cgroup along with the counter,
	// and walk its ancestors again once it has moved.
	PolicyEndpointsGenMap = "policy_endpoints_gen"
	// PolicySockMap is the socket storage (BPF_MAP_TYPE_SK_STORAGE) in
	// which each socket of an endpoint remembers its allowed flows, so
	// that replies pass whatever the other direction's policy says. It
	// is freed with the socket; no other socket's traffic can push a
	// flow out of it.
	PolicySockMap = "policy_sk"
	// PolicyFlowsMap is the shared LRU of flows of earlier versions,
	// which any endpoint's traffic could flush; the agent removes its pin.
	PolicyFlowsMap = "policy_flows"
	// PolicyStatsMap counts verdicts per direction, and events lost (per
	// CPU).
	PolicyStatsMap = "policy_stats"
	// PolicyEventsMap is the ring buffer of verdict events (PolicyEvent):
	// one per decision on a new connection or flow.
	PolicyEventsMap = "policy_events"
	// PolicyEventBudgetMap bounds, per endpoint and CPU, the events of
	// policy_events (PolicyEventBudget), so that one endpoint's flood
	// cannot crowd out the others' events.
	PolicyEventBudgetMap = "policy_event_budget"
)

// Byte sizes of the policy maps' keys and values, as the datapath's C
// structs (bpf/c/policy.c) lay them out.
const (
	PolicyKeySize           = 16
	PolicyValueSize         = 8
	PolicyEndpointKeySize   = 8
	PolicyEndpointValueSize = 8
	PolicySockValueSize     = 168
	PolicyEventSize         = 64
)

// PolicyStaticPrefixBits are the key bits every entry matches in full:
// endpoint ID, remote identity and direction. Protocol (8 bits) and port
// (up to 16) follow.
const PolicyStaticPrefixBits = 72

// PolicyFullPrefixBits is the prefix length of a lookup key.
const PolicyFullPrefixBits = PolicyStaticPrefixBits + 24

// DefaultPolicyMapMaxEntries is the default capacity of the policy map,
// shared by every endpoint of the node.
const DefaultPolicyMapMaxEntries = 65536

// DefaultPolicyEventsSize is the default size in bytes of policy_events:
// 1 MiB holds about 21000 events (48 bytes each with the ring's header).
const DefaultPolicyEventsSize = 1 << 20

// Policy map directions (PolicyKey.Egress).
const (
	PolicyIngress uint8 = 0
	PolicyEgress  uint8 = 1
)

// PolicyKey is the key of the policy LPM trie (struct policy_key).
type PolicyKey struct {
	// PrefixLen is PolicyStaticPrefixBits plus 8 when Protocol is set,
	// plus the port's prefix bits (1–16) when a port is.
	PrefixLen uint32
	// EndpointID is the node-local ID of the endpoint.
	EndpointID uint32
	// Identity is the remote security identity; 0 matches any.
	Identity uint32
	// Egress is PolicyIngress or PolicyEgress.
	Egress uint8
	// Protocol is the IANA protocol number, 0 for any (then no port).
	Protocol uint8
	// Port is the destination port (the endpoint's own on ingress).
	Port Be16
}

// Policy entry flags (PolicyValue.Flags).
const (
	// PolicyFlagDeny makes the entry deny what it matches.
	PolicyFlagDeny uint8 = 1 << 0
	// PolicyFlagAudit, on a deny entry, makes it deny nothing: what it
	// matches is allowed and counted as audited, unless another deny
	// entry that matches denies it.
	PolicyFlagAudit uint8 = 1 << 1
	// PolicyFlagPodAddrs, on an allow entry for a CIDR identity, makes it
	// match by address: a peer whose own identity no entry allows is
	// allowed when its address is inside the entry's prefix
	// (PolicyPrefixesMap), a pod's too. NetworkPolicy ipBlock sets it.
	PolicyFlagPodAddrs uint8 = 1 << 2
	// PolicyFlagFinal, on an entry of a peer identity (not 0), makes it
	// decide alone: the agent folded every layer into it (the
	// ClusterNetworkPolicy tiers, NetworkPolicy and CNP, the identity-0
	// entries), so the datapath does not look up identity 0.
	PolicyFlagFinal uint8 = 1 << 3
	// PolicyFlagPass, on an entry of a peer identity, makes it decide
	// nothing: the lookup goes on by identity 0 and the default as if it
	// had not matched (an Admin tier Pass with no lower rule matching).
	// Its cookie names the Pass in a default deny's event.
	PolicyFlagPass uint8 = 1 << 4
	// PolicyFlagDrop, on a deny entry, says a ClusterNetworkPolicy Deny
	// rule (Admin or Baseline tier) decided it, which the API says drops:
	// the socket hooks let it through where the endpoint's interface is
	// enforced (PolicyPodIface) and the interface program drops it;
	// elsewhere it is EPERM as any deny.
	PolicyFlagDrop uint8 = 1 << 5
)

// PolicySetRef is the identity of an endpoint's reference entry (any
// protocol and port, one per direction): its cookie is the ID of the
// policy set, a pseudo-endpoint whose allows the endpoint shares with
// others. The datapath looks it up, then the set's entry of the peer's
// identity, only where the endpoint's own entries leave a default deny
// (POLICY_SET_REF). No identity is this number.
const PolicySetRef uint32 = 0xffffffff

// PolicyValue is the value of the policy map (struct policy_value).
type PolicyValue struct {
	// Flags are PolicyFlag* bits.
	Flags uint8
	// PortPrefixLen repeats the key's protocol and port prefix bits
	// (0–24), which an LPM lookup does not return.
	PortPrefixLen uint8
	Pad           uint16
	// Cookie names the policy that put the entry there (0: none).
	Cookie uint32
}

// NewPolicyKey returns the key of an entry: protocol 0 means any protocol
// and port; portBits (0–16) is how many leading bits of port the entry
// matches.
func NewPolicyKey(endpointID, identity uint32, egress, protocol uint8, port uint16, portBits int) PolicyKey {
	k := PolicyKey{PrefixLen: PolicyStaticPrefixBits, EndpointID: endpointID, Identity: identity, Egress: egress}
	if protocol == 0 {
		return k
	}
	k.PrefixLen += 8 + uint32(portBits)
	k.Protocol = protocol
	mask := uint16(0)
	if portBits > 0 {
		mask = ^uint16(0) << (16 - portBits)
	}
	k.Port = NewBe16(port & mask)
	return k
}

// PortBits returns how many bits of Port the key matches.
func (k PolicyKey) PortBits() int {
	if k.PrefixLen <= PolicyStaticPrefixBits+8 {
		return 0
	}
	return int(k.PrefixLen - PolicyStaticPrefixBits - 8)
}

// Policy endpoint flags (PolicyEndpointValue.Flags).
const (
	// PolicyEnforceIngress: packets into the endpoint are checked.
	PolicyEnforceIngress uint32 = 1 << 0
	// PolicyEnforceEgress: connections and packets out are checked.
	PolicyEnforceEgress uint32 = 1 << 1
	// PolicyAudit: nothing is denied; what would be is counted as audited.
	PolicyAudit uint32 = 1 << 2
	// PolicyAuditDefaultIngress: what the ingress default deny would deny
	// is allowed and counted as audited; deny entries still deny.
	PolicyAuditDefaultIngress uint32 = 1 << 3
	// PolicyAuditDefaultEgress: the same for the egress default deny.
	PolicyAuditDefaultEgress uint32 = 1 << 4
	// PolicyPodTree marks the root of the kubelet's pod cgroups, not an
	// endpoint: a process below it in no endpoint is unclassified, denied
	// both ways until its pod is registered (EndpointID is 0).
	PolicyPodTree uint32 = 1 << 5
	// PolicyDNS: the endpoint's egress policy has a DNS rule, so its DNS
	// (port 53) goes to the DNS proxy, or is denied when it cannot (see
	// DNSConfigMap).
	PolicyDNS uint32 = 1 << 6
	// PolicyPodIface: the endpoint's pod interface is enforced (the
	// interface programs attached, its policy_ifaces entry naming the
	// endpoint's cgroup), so a PolicyFlagDrop deny may pass the socket
	// hooks to be dropped there. The agent clears it from every entry
	// when it opens the map, and sets it again per endpoint once its
	// interface is reconciled.
	PolicyPodIface uint32 = 1 << 7
	// PolicyPodIfindexShift and PolicyPodIfindexMask place, with
	// PolicyPodIface, the index of the pod side of the enforced interface
	// in the pod's network namespace (1 to 32767) in the flags: a packet
	// that leaves by another device is not let through to be dropped
	// there (cgroup_skb/egress).
	PolicyPodIfindexShift        = 16
	PolicyPodIfindexMask  uint32 = 0x7fff << PolicyPodIfindexShift
)

// PolicyFlowSlots is how many flows (peers) a socket remembers; a socket
// with more forgets its oldest, whose next packets are judged again.
const PolicyFlowSlots = 8

// PolicyEndpointValue is the value of policy_endpoints (struct
// policy_endpoint); the key is the cgroup ID (u64).
type PolicyEndpointValue struct {
	EndpointID uint32
	Flags      uint32
}

// Verdict indexes of policy_stats: direction*PolicyVerdicts + verdict;
// then PolicyStatsLost. The verdicts are also PolicyEvent.Verdict.
const (
	PolicyVerdictAllowed = 0
	PolicyVerdictDenied  = 1
	PolicyVerdictAudited = 2
	PolicyVerdicts       = 4
	// PolicyStatsLost counts the events that found policy_events full.
	PolicyStatsLost    = 2 * PolicyVerdicts
	PolicyStatsEntries = PolicyStatsLost + 1
)

// Reasons of a decision (PolicyEvent.Reason).
const (
	// PolicyReasonEntry: an entry decided; PolicyEvent.Cookie is its.
	PolicyReasonEntry uint8 = 0
	// PolicyReasonDefaultDeny: no entry matched in an enforced direction.
	PolicyReasonDefaultDeny uint8 = 1
	// PolicyReasonNoPolicy: the endpoint does not enforce the direction.
	PolicyReasonNoPolicy uint8 = 2
	// PolicyReasonUnclassified: a process of a pod cgroup the agent has
	// not registered (yet), under a PolicyPodTree cgroup.
	PolicyReasonUnclassified uint8 = 3
	// PolicyReasonSpoofed: a pod's packet from an address not its own,
	// dropped on its interface.
	PolicyReasonSpoofed uint8 = 4
	// PolicyReasonDNSProxy: DNS of an endpoint with PolicyDNS that
	// cannot go to the DNS proxy (interception off, no proxy address of
	// the family), denied rather than let through unfiltered.
	PolicyReasonDNSProxy uint8 = 5
	// PolicyReasonDNSBypass: a packet to port 53 (TCP or UDP) of an
	// endpoint with PolicyDNS that did not go to the DNS proxy (a raw or
	// packet socket, a socket connected before the DNS rule), dropped.
	PolicyReasonDNSBypass uint8 = 6
	// PolicyReasonUnparsable: a packet whose headers could not be read
	// to its ports (more IPv6 extension headers than the programs walk,
	// a header cut short), dropped rather than judged as port 0.
	PolicyReasonUnparsable uint8 = 7
	// PolicyReasonNotRouter: a router's ICMPv6 (router advertisement,
	// redirect) from a pod, which is no router.
	PolicyReasonNotRouter uint8 = 8
)

// Programs that decide (PolicyEvent.Hook).
const (
	PolicyHookConnect4 uint8 = 0
	PolicyHookSendmsg4 uint8 = 1
	PolicyHookIngress  uint8 = 2
	PolicyHookEgress   uint8 = 3
	PolicyHookConnect6 uint8 = 4
	PolicyHookSendmsg6 uint8 = 5
	// PolicyHookFromPod and PolicyHookToPod are the programs on the host
	// side of a pod's interface (packet level; they report drops only).
	PolicyHookFromPod uint8 = 6
	PolicyHookToPod   uint8 = 7
)

// PolicyEvent is a record of policy_events (struct policy_event): one
// decision on a new connection or flow, seen from the endpoint.
type PolicyEvent struct {
	// TimeNs is when it was taken (CLOCK_MONOTONIC, bpf_ktime_get_ns).
	TimeNs         uint64
	EndpointID     uint32
	RemoteIdentity uint32
	// Cookie is the cookie of the entry that decided (PolicyValue.Cookie),
	// 0 when none did: of the deny entry when denied or audited by one,
	// else of the allowing entry, the peer's own before identity 0's.
	Cookie uint32
	// LocalAddr and LocalPort are the endpoint's side, RemoteAddr and
	// RemotePort the peer's: IPv6, or IPv4 as ::ffff:a.b.c.d (network
	// order). connect and sendmsg give the socket's address and port
	// only if it is bound already, else 0.
	LocalAddr  [16]byte
	RemoteAddr [16]byte
	LocalPort  Be16
	RemotePort Be16
	Protocol   uint8
	// Direction is PolicyIngress or PolicyEgress.
	Direction uint8
	// Verdict is PolicyVerdictAllowed, PolicyVerdictDenied or
	// PolicyVerdictAudited (allowed, but a denial under audit).
	Verdict uint8
	// Reason is a PolicyReason*.
	Reason uint8
	// Hook is a PolicyHook*.
	Hook uint8
	// Family is 4 or 6: the family the peer was judged in (an
	// IPv4-mapped address is judged as IPv4).
	Family uint8
	Pad    [2]byte
}

// Local returns the endpoint's address and port.
func (e PolicyEvent) Local() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(e.LocalAddr).Unmap(), e.LocalPort.Uint16())
}

// Remote returns the peer's address and port.
func (e PolicyEvent) Remote() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(e.RemoteAddr).Unmap(), e.RemotePort.Uint16())
}

// ParsePolicyEvent decodes a record of policy_events.
func ParsePolicyEvent(raw []byte) (PolicyEvent, error) {
	var e PolicyEvent
	if len(raw) < PolicyEventSize {
		return e, fmt.Errorf("policy event of %d bytes, want %d", len(raw), PolicyEventSize)
	}
	e.TimeNs = binary.NativeEndian.Uint64(raw[0:])
	e.EndpointID = binary.NativeEndian.Uint32(raw[8:])
	e.RemoteIdentity = binary.NativeEndian.Uint32(raw[12:])
	e.Cookie = binary.NativeEndian.Uint32(raw[16:])
	e.LocalAddr = [16]byte(raw[20:36])
	e.RemoteAddr = [16]byte(raw[36:52])
	e.LocalPort = Be16(raw[52:54])
	e.RemotePort = Be16(raw[54:56])
	e.Protocol = raw[56]
	e.Direction = raw[57]
	e.Verdict = raw[58]
	e.Reason = raw[59]
	e.Hook = raw[60]
	e.Family = raw[61]
	e.Pad = [2]byte(raw[62:64])
	return e, nil
}

// PolicyMapSpec returns the spec of the policy map with room for
// maxEntries entries.
func PolicyMapSpec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       PolicyMap,
		Type:       ebpf.LPMTrie,
		KeySize:    PolicyKeySize,
		ValueSize:  PolicyValueSize,
		MaxEntries: maxEntries,
		Flags:      unix.BPF_F_NO_PREALLOC,
		Pinning:    ebpf.PinByName,
	}
}

// PolicyEndpointsMapSpec returns the spec of policy_endpoints.
func PolicyEndpointsMapSpec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       PolicyEndpointsMap,
		Type:       ebpf.Hash,
		KeySize:    PolicyEndpointKeySize,
		ValueSize:  PolicyEndpointValueSize,
		MaxEntries: maxEntries,
		Flags:      unix.BPF_F_NO_PREALLOC,
		Pinning:    ebpf.PinByName,
	}
}

// PolicyEndpointsGenMapSpec returns the spec of policy_endpoints_gen.
func PolicyEndpointsGenMapSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       PolicyEndpointsGenMap,
		Type:       ebpf.Array,
		KeySize:    4,
		ValueSize:  8,
		MaxEntries: 1,
		Pinning:    ebpf.PinByName,
	}
}

// PolicySockMapSpec returns the spec of policy_sk from the programs'
// object (spec): socket storage needs the BTF of its value, which holds a
// spin lock, so it is made from the object's definition.
func PolicySockMapSpec(spec *ebpf.CollectionSpec) (*ebpf.MapSpec, error) {
	ms := spec.Maps[PolicySockMap]
	if ms == nil {
		return nil, fmt.Errorf("the policy programs' object has no map %s", PolicySockMap)
	}
	ms = ms.Copy()
	ms.Pinning = ebpf.PinByName
	return ms, nil
}

// PolicyStatsMapSpec returns the spec of policy_stats.
func PolicyStatsMapSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       PolicyStatsMap,
		Type:       ebpf.PerCPUArray,
		KeySize:    4,
		ValueSize:  8,
		MaxEntries: PolicyStatsEntries,
		Pinning:    ebpf.PinByName,
	}
}

// PolicyEventsMapSpec returns the spec of policy_events, a ring buffer of
// sizeBytes bytes: a power of 2 and a multiple of the page size (the
// kernel refuses other sizes).
//
// The programs wake its reader only once an eighth of the ring waits to be
// read (a wakeup per event would cost more than the decision itself), so a
// reader must also poll: read with a deadline (ringbuf.Reader.SetDeadline)
// and read again when it passes. Events that find the ring full are lost,
// counted at PolicyStatsLost of policy_stats.
func PolicyEventsMapSpec(sizeBytes uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       PolicyEventsMap,
		Type:       ebpf.RingBuf,
		MaxEntries: sizeBytes,
		Pinning:    ebpf.PinByName,
	}
}

// String formats a key for error messages: "ep 3 id 256 egress proto 6
// port 80/16" (the port's prefix bits after the slash).
func (k PolicyKey) String() string {
	dir := "ingress"
	if k.Egress == PolicyEgress {
		dir = "egress"
	}
	return fmt.Sprintf("ep %d id %d %s proto %d port %d/%d", k.EndpointID, k.Identity, dir, k.Protocol, k.Port.Uint16(), k.PortBits())
}

// PolicyEventBudget is a value of policy_event_budget, per CPU: an
// endpoint's credit of events (a token bucket counted in nanoseconds, one
// event costing a second over the rate) and the events it lost for want
// of credit.
type PolicyEventBudget struct {
	CreditNs uint64
	LastNs   uint64
	Lost     uint64
}

// PolicyEventBudgetMapSpec returns the spec of policy_event_budget: a
// per-CPU hash of endpoint ID (uint32) to PolicyEventBudget, with room for
// maxEntries endpoints (an endpoint beyond them is not bounded).
func PolicyEventBudgetMapSpec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       PolicyEventBudgetMap,
		Type:       ebpf.PerCPUHash,
		KeySize:    4,
		ValueSize:  24,
		MaxEntries: maxEntries,
		Flags:      unix.BPF_F_NO_PREALLOC,
		Pinning:    ebpf.PinByName,
	}
}
