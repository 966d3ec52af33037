// Package policy enforces network policy: it computes, for every endpoint
// (pod) of this node, the entries of its policy from the policies' rules,
// the identities their selectors select and the endpoints' identities; it
// keeps them in the policy-entries and endpoint-policy tables, reconciles
// them into the pinned policy and policy_endpoints maps, and attaches the
// cgroup programs (bpf/policyprog) that decide connections and packets
// with those maps. See docs/policy.md.
package policy

import (
	"fmt"
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/iflink"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the read-only policy-entries, endpoint-policy and
// policy-status tables, the verdict Monitor and the DNS proxy's gate, and
// enforces the policy.
var Cell = cell.Module(
	"policy",
	"Policy enforcement per endpoint",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(
		tables.NewPolicyEntriesTable,
		tables.NewEndpointPolicyTable,
		tables.NewPodInterfacesTable,
		tables.NewPolicyStatusTable,
		newVerdictCounter,
		newOps,
		newProgress,
		newMapsOpened,
		newDNSMaps,
		newAttacher,
	),
	cell.Provide(
		NewMonitor,
		newMonitorHandler,
	),
	cell.Provide(
		statedb.RWTable[*tables.PolicyEntry].ToTable,
		statedb.RWTable[*tables.EndpointPolicy].ToTable,
		statedb.RWTable[*tables.PodInterface].ToTable,
		statedb.RWTable[*tables.PolicyStatus].ToTable,
		newGate,
		newInterceptor,
	),
	cell.Invoke(
		registerReconcilers,
		registerController,
		registerEvents,
		registerPodInterfaces,
		registerMetrics,
		registerVerdictWriter,
	),
)

// Flag names.
const (
	EnableFlag = "enable-policy"
	// UnclassifiedFlag says what happens to a pod cgroup under the
	// kubelet's tree that the agent has not registered, or whose
	// identity is not known yet.
	UnclassifiedFlag = "unclassified-pods"
	AuditFlag        = "policy-audit-mode"
	MapMaxFlag       = "bpf-policy-map-max"
	LocalhostFlag    = "allow-localhost"
	// PodInterfacesFlag turns the packet-level programs on pods'
	// interfaces on or off.
	PodInterfacesFlag   = "policy-pod-interfaces"
	InterfaceFlowsFlag  = "policy-interface-flows"
	InterfaceAttachFlag = "policy-interface-attach"
	// ShareMinFlag is how many identities a peer selector selects from
	// which its allows go into policy sets shared by endpoints.
	ShareMinFlag      = "policy-share-min-identities"
	minInterfaceFlows = 64
	maxInterfaceFlows = 1 << 20
	minPolicyMap      = 256
	maxPolicyMap      = 16 << 20
	endpointsMax      = 65536
)

// Config is the policy cell's configuration.
type Config struct {
	// EnablePolicy is ModeDefault, ModeAlways or ModeNever.
	EnablePolicy string
	// PolicyAuditMode denies nothing; what would be denied is counted.
	PolicyAuditMode bool
	// BPFPolicyMapMax is the capacity of the policy map, shared by every
	// endpoint of the node.
	BPFPolicyMapMax uint32
	// UnclassifiedPods is UnclassifiedDeny or UnclassifiedAllow.
	UnclassifiedPods string
	// AllowLocalhost is LocalhostAlways or LocalhostPolicy.
	AllowLocalhost string
	// PolicyPodInterfaces enforces policy at the packet level too, on the host
	// side of each pod's interface.
	PolicyPodInterfaces bool
	// PolicyInterfaceFlows is the capacity of each pod interface's flow map.
	PolicyInterfaceFlows uint32
	// PolicyInterfaceAttach is how the interface programs are attached:
	// auto, tcx or tc (an iflink.Mode).
	PolicyInterfaceAttach string
	// PolicyShareMinIdentities is how many identities a peer selector
	// selects from which its allows are kept in policy sets that the
	// endpoints with the same such rules share (0: never).
	PolicyShareMinIdentities uint32
}

// --unclassified-pods values.
const (
	// UnclassifiedDeny: a pod cgroup under the kubelet's tree that the
	// agent has not registered, or whose identity is not known yet, is
	// denied both ways, also while the agent is not running.
	UnclassifiedDeny = "deny"
	// UnclassifiedAllow: such a pod runs unenforced until it is
	// classified.
	UnclassifiedAllow = "allow"
)

// Values of --allow-localhost.
const (
	// LocalhostAlways lets the node (the reserved:host identity) reach
	// its pods whatever their ingress policy says, unless a policy denies
	// the host: as the reference does in Kubernetes, where kubelet's
	// probes come from the node.
	LocalhostAlways = "always"
	// LocalhostPolicy treats the node as any other peer.
	LocalhostPolicy = "policy"
)

var defaultConfig = Config{
	EnablePolicy: ModeDefault, BPFPolicyMapMax: bpf.DefaultPolicyMapMaxEntries, UnclassifiedPods: UnclassifiedDeny,
	AllowLocalhost: LocalhostAlways, PolicyPodInterfaces: true, PolicyInterfaceFlows: bpf.DefaultPolicyIfaceFlows,
	PolicyInterfaceAttach: string(iflink.ModeAuto), PolicyShareMinIdentities: 16,
}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.String(EnableFlag, def.EnablePolicy,
		"Policy enforcement: default (an endpoint is enforced in a direction once a policy with rules there selects it), always (every endpoint, deny unless allowed), never (nothing is enforced or attached)")
	fs.Bool(AuditFlag, def.PolicyAuditMode,
		"Deny nothing: what policy would deny is allowed and counted as audited")
	fs.String(UnclassifiedFlag, def.UnclassifiedPods,
		"Pods under the kubelet's cgroup tree (kubepods, kubepods.slice under --cgroup-root) that the agent has not classified yet: deny (both ways, until their pod and identity are known; the pinned programs keep denying while the agent is down) or allow (they run unenforced meanwhile)")
	fs.Uint32(MapMaxFlag, def.BPFPolicyMapMax,
		"Capacity of the policy map in entries, shared by every endpoint of the node; a full map is an error on the endpoints whose entries do not fit")
	fs.String(LocalhostFlag, def.AllowLocalhost,
		"Traffic from the node to its pods: always (allowed whatever the pods' ingress policy, unless a policy denies the host; kubelet's probes keep working) or policy (the node is a peer like any other)")
	fs.Bool(PodInterfacesFlag, def.PolicyPodInterfaces,
		"Also enforce policy on every packet at the host side of each pod's veth (tcx): packet sockets, sockets made outside the pod's cgroup and forged source addresses meet the same verdicts as its sockets; false leaves the socket hooks only")
	fs.Uint32(InterfaceFlowsFlag, def.PolicyInterfaceFlows,
		"Flows each pod interface remembers (an LRU of its own), so that replies of allowed flows pass; a pod with more forgets its oldest, whose next packets are judged again")
	fs.String(InterfaceAttachFlag, def.PolicyInterfaceAttach,
		"How the programs go on pods' interfaces: auto (tcx links, pinned; tc filters on kernels without tcx), tcx or tc")
	fs.Uint32(ShareMinFlag, def.PolicyShareMinIdentities,
		"A peer selector that selects at least this many identities has its allows kept once in a policy set shared by the endpoints with the same such rules, instead of an entry per identity on each endpoint (0: never)")
}

func (c Config) validate() error {
	switch c.EnablePolicy {
	case ModeDefault, ModeAlways, ModeNever:
	default:
		return fmt.Errorf("--%s=%q: want default, always or never", EnableFlag, c.EnablePolicy)
	}
	switch c.UnclassifiedPods {
	case UnclassifiedDeny, UnclassifiedAllow:
	default:
		return fmt.Errorf("--%s=%q: want deny or allow", UnclassifiedFlag, c.UnclassifiedPods)
	}
	switch c.AllowLocalhost {
	case LocalhostAlways, LocalhostPolicy:
	default:
		return fmt.Errorf("--%s=%q: want always or policy", LocalhostFlag, c.AllowLocalhost)
	}
	if _, err := iflink.ParseMode(c.PolicyInterfaceAttach); err != nil {
		return fmt.Errorf("--%s=%w", InterfaceAttachFlag, err)
	}
	if c.PolicyInterfaceFlows < minInterfaceFlows || c.PolicyInterfaceFlows > maxInterfaceFlows {
		return fmt.Errorf("--%s=%d: want %d to %d", InterfaceFlowsFlag, c.PolicyInterfaceFlows, minInterfaceFlows, maxInterfaceFlows)
	}
	if c.BPFPolicyMapMax < minPolicyMap || c.BPFPolicyMapMax > maxPolicyMap {
		return fmt.Errorf("--%s=%d: want %d to %d", MapMaxFlag, c.BPFPolicyMapMax, minPolicyMap, maxPolicyMap)
	}
	return nil
}

func newOps(log *slog.Logger, cfg Config) (*reconcilers.Policy, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return reconcilers.NewPolicy(log, MapMaxFlag), nil
}

type reconcilerParams struct {
	cell.In

	Params    reconciler.Params
	Entries   statedb.RWTable[*tables.PolicyEntry]
	Endpoints statedb.RWTable[*tables.EndpointPolicy]
	Ops       *reconcilers.Policy
	Resync    bpffs.Resync
	Config    Config
	DNSMaps   *reconcilers.DNSMaps
	Registry  prometheus.Registerer
}

func registerReconcilers(p reconcilerParams) error {
	// Prune resyncs the maps (--bpf-map-resync-interval).
	p.Ops.ResyncWith(p.Resync.DriftReport())
	if p.Config.EnablePolicy != ModeNever {
		// Each endpoint with DNS rules gets its map in dns_origin.
		p.Ops.SetEndpointMaps(p.DNSMaps)
		lost := prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "dns", Name: "origins_lost_total",
			Help: "Intercepted DNS queries whose resolver the programs could not tell the DNS proxy (the endpoint has no map in dns_origin yet, or the write failed): the proxy asks its upstream for them",
		}, func() float64 { n, _ := p.DNSMaps.LostOrigins(); return float64(n) })
		if err := p.Registry.Register(lost); err != nil {
			return err
		}
	}
	_, err := reconcilers.RegisterPolicy(p.Params, p.Ops, p.Entries, p.Endpoints,
		reconciler.WithPruning(p.Resync.PruneInterval()))
	return err
}

type controllerParams struct {
	cell.In

	Log            *slog.Logger
	Config         Config
	DB             *statedb.DB
	Jobs           job.Group
	PinDir         bpffs.PinDir
	Maps           bpffs.Maps // the policy maps: the kernel's, or a test's in memory
	Root           cgroups.Root
	Lifecycle      cell.Lifecycle
	Ops            *reconcilers.Policy
	Entries        statedb.RWTable[*tables.PolicyEntry]
	EndpointPolicy statedb.RWTable[*tables.EndpointPolicy]
	Policies       statedb.Table[*tables.Policy]
	Selectors      statedb.Table[*tables.Selector]
	Endpoints      statedb.Table[*tables.Endpoint]
	IPCache        statedb.Table[*tables.IPCacheEntry]
	Progress       *progress
	Opened         mapsOpened
	Status         statedb.RWTable[*tables.PolicyStatus]
	Registry       prometheus.Registerer

	// Interfaces are the pod-interfaces rows: a pod whose interface
	// cannot be found is denied (FailClosed).
	Interfaces statedb.RWTable[*tables.PodInterface]
	// FQDN says whether the DNS proxy intercepts, which a
	// ClusterNetworkPolicy domainNames rule needs; absent (no fqdn
	// cell), it does not.
	FQDN fqdn.Config `optional:"true"`
}

func registerController(p controllerParams) error {
	c := newController(p)
	for _, m := range []prometheus.Collector{c.computeSeconds, c.writeSeconds} {
		if err := p.Registry.Register(m); err != nil {
			return err
		}
	}
	c.Jobs.Add(job.OneShot("compute", c.run))
	// Jobs, the reconcilers among them, stop before this.
	c.Lifecycle.Append(cell.Hook{OnStop: func(cell.HookContext) error { return c.Ops.Close() }})
	return nil
}

// newGate returns the DNS proxy's gate on the policy map.
type gateParams struct {
	cell.In

	DB         *statedb.DB
	Config     Config
	IPCache    statedb.Table[*tables.IPCacheEntry]
	Identities statedb.Table[*tables.Identity]
	Selectors  statedb.Table[*tables.Selector]
	Entries    statedb.RWTable[*tables.PolicyEntry]
	Endpoints  statedb.RWTable[*tables.EndpointPolicy]
	Progress   *progress
}

func newGate(p gateParams) fqdn.Gate {
	return &gate{
		db: p.DB, ipcache: p.IPCache, identities: p.Identities, selectors: p.Selectors,
		entries: p.Entries, endpoints: p.Endpoints, progress: p.Progress, mode: p.Config.EnablePolicy,
	}
}
