package policyprog

import (
	"cmp"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/cgrouplink"
)

// Hooks lists the programs in attach order. The programs that remember
// flows come first: sockops (accepted connections), then connect and
// sendmsg of both families (the endpoint's own), so that a connection
// made while the packet filters arrive already has the flow its replies
// need to pass them. Of the packet filters, ingress comes before egress
// because it remembers the UDP flows that egress then lets out as
// replies.
//
// Attach these after the socket load balancer's programs on the same
// cgroup: programs of one hook run in attach order, and connect and
// sendmsg must see the backend the load balancer chose, the address the
// packets will carry (SockAddrHooks are those that must run last).
var Hooks = []cgrouplink.Hook{
	{Name: "policy_sockops", Program: policyprogProgPolicySockops, Attach: ebpf.AttachCGroupSockOps},
	{Name: "policy_connect4", Program: policyprogProgPolicyConnect4, Attach: ebpf.AttachCGroupInet4Connect},
	{Name: "policy_sendmsg4", Program: policyprogProgPolicySendmsg4, Attach: ebpf.AttachCGroupUDP4Sendmsg},
	{Name: "policy_connect6", Program: policyprogProgPolicyConnect6, Attach: ebpf.AttachCGroupInet6Connect},
	{Name: "policy_sendmsg6", Program: policyprogProgPolicySendmsg6, Attach: ebpf.AttachCGroupUDP6Sendmsg},
	{Name: "policy_ingress", Program: policyprogProgPolicyIngress, Attach: ebpf.AttachCGroupInetIngress},
	{Name: "policy_egress", Program: policyprogProgPolicyEgress, Attach: ebpf.AttachCGroupInetEgress},
	// Intercepted DNS: the proxy's answers show the resolver the socket
	// asked. In either order with the socket LB's programs of these
	// hooks, which restore the same first (bpf/c/dns_redirect.h).
	{Name: "policy_recvmsg4", Program: policyprogProgPolicyRecvmsg4, Attach: ebpf.AttachCGroupUDP4Recvmsg},
	{Name: "policy_getpeername4", Program: policyprogProgPolicyGetpeername4, Attach: ebpf.AttachCgroupInet4GetPeername},
	{Name: "policy_recvmsg6", Program: policyprogProgPolicyRecvmsg6, Attach: ebpf.AttachCGroupUDP6Recvmsg},
	{Name: "policy_getpeername6", Program: policyprogProgPolicyGetpeername6, Attach: ebpf.AttachCgroupInet6GetPeername},
}

// RunsLast reports whether the program of attach type t must run after
// every other program of its hook on the cgroup: the connect and sendmsg
// programs, which judge the address the socket load balancer chose.
func RunsLast(t ebpf.AttachType) bool {
	switch t {
	case ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupUDP4Sendmsg,
		ebpf.AttachCGroupInet6Connect, ebpf.AttachCGroupUDP6Sendmsg:
		return true
	}
	return false
}

// Spec returns the programs' collection spec, as compiled into the binary.
func Spec() (*ebpf.CollectionSpec, error) {
	return loadPolicyprog()
}

// Maps are the maps the programs use, all owned (and pinned) by the agent.
type Maps struct {
	// Policy is the policy LPM trie (bpf.PolicyMapSpec).
	Policy *ebpf.Map
	// Endpoints maps pod cgroup IDs to endpoints (bpf.PolicyEndpointsMapSpec).
	Endpoints *ebpf.Map
	// EndpointsGen is the counter whoever writes Endpoints increments
	// after each change (bpf.PolicyEndpointsGenMapSpec). With it, the
	// programs remember what each cgroup's ancestor walk found until the
	// counter moves; nil: they walk on every run.
	EndpointsGen *ebpf.Map
	// Sock is the sockets' storage of allowed flows
	// (bpf.PolicySockMapSpec).
	Sock *ebpf.Map
	// Stats counts verdicts and lost events (bpf.PolicyStatsMapSpec).
	Stats *ebpf.Map
	// IPCache gives peers' identities (bpf.IPCacheMapSpec).
	IPCache *ebpf.Map
	// Prefixes gives the policy prefix holding a peer's address
	// (bpf.PolicyPrefixesMapSpec), for entries with bpf.PolicyFlagPodAddrs.
	Prefixes *ebpf.Map
	// Events receives a bpf.PolicyEvent per decision
	// (bpf.PolicyEventsMapSpec); the programs never wait for its reader,
	// and wake it only once an eighth of the ring waits: it must poll.
	Events *ebpf.Map
	// Budget bounds each endpoint's share of Events.
	Budget EventBudget

	// The maps of DNS interception, shared with the socket LB's programs
	// (bpf.DNSSockMap, bpf.DNSOriginMap, bpf.DNSConfigMap). Each one left
	// nil is the programs' own: nothing is then intercepted, and DNS of
	// an endpoint with bpf.PolicyDNS is denied.
	DNSSock, DNSOrigin, DNSConfig *ebpf.Map
	// DNSOriginLost counts origins the programs could not publish
	// (bpf.DNSOriginLostMapSpec); nil: the programs' own.
	DNSOriginLost *ebpf.Map
}

// Load loads the programs with m in place of the object's own map
// definitions, so that the programs read the maps the agent writes. The
// object's map sizes are only defaults: each definition takes the size and
// flags of the map that replaces it, which must otherwise agree (type, key
// and value sizes) or loading fails.
//
// The caller owns the returned programs, keyed by program name.
func Load(m Maps) (map[string]*ebpf.Program, error) {
	if m.Events == nil {
		return nil, fmt.Errorf("load policy programs: no events map (Maps.Events, a ring buffer from bpf.PolicyEventsMapSpec(%d))",
			bpf.DefaultPolicyEventsSize)
	}
	spec, err := Spec()
	if err != nil {
		return nil, err
	}
	// The interface programs are LoadInterface's, with maps of their own.
	delete(spec.Programs, FromPod)
	delete(spec.Programs, ToPod)
	for _, name := range []string{policyprogMapPolicyIfaces, policyprogMapPolicyIfaceFlows,
		policyprogMapPolicyIfaceFrags, policyprogMapPolicyIfaceStats} {
		delete(spec.Maps, name)
	}
	if err := m.Budget.apply(spec); err != nil {
		return nil, err
	}
	if m.EndpointsGen != nil {
		v, ok := spec.Variables[policyprogVarEndpointCache]
		if !ok {
			return nil, fmt.Errorf("load policy programs: no endpoint_cache variable")
		}
		if err := v.Set(uint32(1)); err != nil {
			return nil, fmt.Errorf("load policy programs: endpoint_cache: %w", err)
		}
	}
	repl := map[string]*ebpf.Map{
		policyprogMapPolicy:          m.Policy,
		policyprogMapPolicyEndpoints: m.Endpoints,
		policyprogMapPolicySk:        m.Sock,
		policyprogMapPolicyStats:     m.Stats,
		policyprogMapIpcache:         m.IPCache,
		policyprogMapPolicyPrefixes:  m.Prefixes,
		policyprogMapPolicyEvents:    m.Events,
	}
	for name, dm := range map[string]*ebpf.Map{
		policyprogMapDnsSk: m.DNSSock, policyprogMapDnsOrigin: m.DNSOrigin, policyprogMapDnsConfig: m.DNSConfig,
		policyprogMapDnsOriginLost: m.DNSOriginLost, policyprogMapPolicyEventBudget: m.Budget.Map,
		policyprogMapPolicyEndpointsGen: m.EndpointsGen,
	} {
		if dm != nil {
			repl[name] = dm
		}
	}
	return bpf.LoadPrograms(spec, repl, "policy programs")
}

// Programs of packet-level enforcement, attached with tcx to the host side
// of each pod's interface: FromPod on its ingress (the packets the pod
// sends), ToPod on its egress (the packets it receives).
const (
	FromPod = policyprogProgPolicyFromPod
	ToPod   = policyprogProgPolicyToPod
)

// InterfaceMaps are the maps the interface programs use, all owned (and
// pinned) by the agent: those of Maps but the sockets' storage, and the
// interfaces' own.
type InterfaceMaps struct {
	Policy    *ebpf.Map
	Endpoints *ebpf.Map
	Stats     *ebpf.Map
	IPCache   *ebpf.Map
	Prefixes  *ebpf.Map
	Events    *ebpf.Map
	// Budget bounds each endpoint's share of Events (see Maps.Budget).
	Budget EventBudget
	// Ifaces maps pod interfaces to pods (bpf.PolicyIfacesMapSpec).
	Ifaces *ebpf.Map
	// Flows holds each interface's flows (bpf.PolicyIfaceFlowsMapSpec).
	Flows *ebpf.Map
	// Frags remembers first fragments (bpf.PolicyIfaceFragsMapSpec).
	Frags *ebpf.Map
	// IfaceStats counts packet-level verdicts and drops
	// (bpf.PolicyIfaceStatsMapSpec).
	IfaceStats *ebpf.Map
	// DNSConfig says where the DNS proxy is (bpf.DNSConfigMap): the
	// queries the socket hooks sent there pass. Nil: a map of the
	// object's own, with no proxy.
	DNSConfig *ebpf.Map
}

// LoadInterface loads FromPod and ToPod, and only them, on m (see Load).
// The caller owns the returned programs, keyed by program name.
func LoadInterface(m InterfaceMaps) (map[string]*ebpf.Program, error) {
	spec, err := Spec()
	if err != nil {
		return nil, err
	}
	for name := range spec.Programs {
		if name != FromPod && name != ToPod {
			delete(spec.Programs, name)
		}
	}
	// Only the socket programs use these; nothing would replace them.
	for _, name := range []string{policyprogMapPolicySk, policyprogMapDnsSk, policyprogMapDnsOrigin, policyprogMapDnsOriginLost,
		policyprogMapPolicyCgroupCache, policyprogMapPolicyEndpointsGen} {
		delete(spec.Maps, name)
	}
	repl := map[string]*ebpf.Map{
		policyprogMapPolicy:           m.Policy,
		policyprogMapPolicyEndpoints:  m.Endpoints,
		policyprogMapPolicyStats:      m.Stats,
		policyprogMapIpcache:          m.IPCache,
		policyprogMapPolicyPrefixes:   m.Prefixes,
		policyprogMapPolicyEvents:     m.Events,
		policyprogMapPolicyIfaces:     m.Ifaces,
		policyprogMapPolicyIfaceFlows: m.Flows,
		policyprogMapPolicyIfaceFrags: m.Frags,
		policyprogMapPolicyIfaceStats: m.IfaceStats,
	}
	if m.DNSConfig != nil {
		repl[policyprogMapDnsConfig] = m.DNSConfig
	}
	if err := m.Budget.apply(spec); err != nil {
		return nil, err
	}
	if m.Budget.Map != nil {
		repl[policyprogMapPolicyEventBudget] = m.Budget.Map
	}
	return bpf.LoadPrograms(spec, repl, "pod interface programs")
}

// Defaults of EventBudget: what an endpoint may emit into policy_events a
// second, and at once, on each CPU, before its events are dropped (and
// counted as its losses in bpf.PolicyEventBudgetMap).
const (
	DefaultEventsPerSecond = 2000
	DefaultEventsBurst     = 512
)

// EventBudget bounds each endpoint's share of policy_events: the ring is
// one for every endpoint, so without a bound one pod's flood of denials
// would fill it and the other pods' verdicts would be lost.
type EventBudget struct {
	// Map holds the endpoints' budgets and losses
	// (bpf.PolicyEventBudgetMapSpec); nil: the programs' own, unpinned.
	Map *ebpf.Map
	// PerSecond and Burst are the rate and burst per endpoint and CPU;
	// 0: DefaultEventsPerSecond, DefaultEventsBurst.
	PerSecond, Burst uint32
}

// apply sets the budget's rates in the programs' spec.
func (b EventBudget) apply(spec *ebpf.CollectionSpec) error {
	for name, v := range map[string]uint32{
		policyprogVarEventsPerSec: cmp.Or(b.PerSecond, DefaultEventsPerSecond),
		policyprogVarEventsBurst:  cmp.Or(b.Burst, DefaultEventsBurst),
	} {
		vs := spec.Variables[name]
		if vs == nil {
			return fmt.Errorf("load policy programs: object has no variable %s", name)
		}
		if err := vs.Set(v); err != nil {
			return fmt.Errorf("load policy programs: set %s: %w", name, err)
		}
	}
	return nil
}
