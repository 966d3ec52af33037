// Package policy enforces network policy: it computes, for every endpoint
// (pod) of this node, the entries of its policy from the policies' rules,
// the identities their selectors select and the endpoints' identities; it
// keeps them in the policy-entries and endpoint-policy tables, reconciles
// them into the pinned policy and policy_endpoints maps, and attaches the
// cgroup programs (bpf/policyprog) that decide connections and packets
// with those maps. See docs/policy.md.
package policy

import (
	"context"
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
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/internal/podnet"
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
		registerAttacher,
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
	minInterfaceFlows   = 64
	maxInterfaceFlows   = 1 << 20
	minPolicyMap        = 256
	maxPolicyMap        = 16 << 20
	endpointsMax        = 65536
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
	PolicyInterfaceAttach: string(iflink.ModeAuto),
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
	DNSMaps   *dnsMaps
	Registry  prometheus.Registerer
}

func registerReconcilers(p reconcilerParams) error {
	// Prune resyncs the maps (--bpf-map-resync-interval).
	p.Ops.ResyncWith(p.Resync.DriftReport())
	if p.Config.EnablePolicy != ModeNever {
		// Each endpoint with DNS rules gets its map in dns_origin.
		p.Ops.SetEndpointMaps(&dnsOrigins{maps: p.DNSMaps})
		lost := prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "dns", Name: "origins_lost_total",
			Help: "Intercepted DNS queries whose resolver the programs could not tell the DNS proxy (the endpoint has no map in dns_origin yet, or the write failed): the proxy asks its upstream for them",
		}, func() float64 { n, _ := p.DNSMaps.lostOrigins(); return float64(n) })
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

// newDNSMaps returns the maps of DNS interception, opened on first use.
func newDNSMaps(log *slog.Logger, pinDir bpffs.PinDir, lc cell.Lifecycle) *dnsMaps {
	d := &dnsMaps{log: log, pinDir: string(pinDir)}
	lc.Append(cell.Hook{OnStop: func(cell.HookContext) error { d.close(); return nil }})
	return d
}

type interceptorParams struct {
	cell.In

	Config    Config
	DB        *statedb.DB
	Maps      *dnsMaps
	Endpoints statedb.RWTable[*tables.EndpointPolicy]
	Pods      statedb.Table[*tables.Endpoint]
	Ifaces    statedb.Table[*tables.PodInterface]
	Monitor   *Monitor
}

// newInterceptor returns the DNS proxy's side of DNS interception; none
// with --enable-policy=never, where no program runs.
func newInterceptor(p interceptorParams) fqdn.Interceptor {
	if p.Config.EnablePolicy == ModeNever {
		return nil
	}
	return &interceptor{maps: p.Maps, db: p.DB, endpoints: p.Endpoints, pods: p.Pods, ifaces: p.Ifaces, monitor: p.Monitor}
}

type attacherParams struct {
	cell.In

	Log        *slog.Logger
	Config     Config
	PinDir     bpffs.PinDir
	Root       cgroups.Root
	Jobs       job.Group
	Lifecycle  cell.Lifecycle
	Ops        *reconcilers.Policy
	Opened     mapsOpened
	IPCache    ipcache.Map
	Registry   prometheus.Registerer
	DB         *statedb.DB
	Identities statedb.Table[*tables.Identity]
	Endpoints  statedb.RWTable[*tables.EndpointPolicy]
	Policies   statedb.Table[*tables.Policy]
	Monitor    *Monitor
	Counter    *verdictCounter

	ReconcilerParams reconciler.Params
	PodEndpoints     statedb.Table[*tables.Endpoint]
	Interfaces       statedb.RWTable[*tables.PodInterface]
	DNSMaps          *dnsMaps
}

func registerAttacher(p attacherParams) error {
	a := &attacher{
		log: p.Log, cfg: p.Config, pinDir: string(p.PinDir), root: p.Root, ops: p.Ops,
		ipcache: p.IPCache, opened: p.Opened, attached: make(chan struct{}),
		dns: p.DNSMaps,
	}
	p.Jobs.Add(job.OneShot("attach", a.run, job.WithRetry(-1, attachRetry())))
	// The socket LB attached after the policy programs: back behind it at
	// once, before its first connection can be judged on a service
	// address.
	p.Root.OnAttach(func() {
		if err := a.keepLast(); err != nil {
			a.log.Error("Policy programs may run before the socket load balancer", "error", err)
		}
	})
	verdicts := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "policy", Name: "verdicts_total",
		Help: "Connections and flows the policy programs decided, by direction, verdict (audited: would have been denied) and the policy whose entry decided (empty: default deny or no policy); from the verdict events, so events lost are not counted",
	}, []string{"direction", "verdict", "policy"})
	if err := p.Registry.Register(verdicts); err != nil {
		return err
	}
	r := &eventReader{
		log: p.Log, db: p.DB, identities: p.Identities, endpoints: p.Endpoints, policies: p.Policies,
		monitor: p.Monitor, counter: p.Counter, verdicts: verdicts, lost: a.lost,
	}
	p.Jobs.Add(job.OneShot("events", func(ctx context.Context, _ cell.Health) error {
		if p.Config.EnablePolicy == ModeNever {
			return nil
		}
		rd, err := a.eventsReader(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		return r.run(ctx, rd)
	}))
	// The links stay pinned (and attached); only this process's handles
	// go.
	p.Lifecycle.Append(cell.Hook{OnStop: func(cell.HookContext) error { a.close(); return nil }})
	if err := registerPodInterfaces(p, a); err != nil {
		return err
	}
	return registerMetrics(p.Registry, a, p.Ops)
}

// registerPodInterfaces starts packet-level enforcement on pods'
// interfaces (--policy-pod-interfaces), or removes what an earlier run
// attached when it is off.
func registerPodInterfaces(p attacherParams, a *attacher) error {
	switch {
	case p.Config.EnablePolicy == ModeNever:
		return nil // the attacher detaches everything
	case !p.Config.PolicyPodInterfaces:
		p.Jobs.Add(job.OneShot("pod-interfaces-off", func(context.Context, cell.Health) error {
			gone, err := detachIfaces(string(p.PinDir))
			if len(gone) > 0 {
				p.Log.Info("Packet-level enforcement off (--"+PodInterfacesFlag+"=false): detached", "links", gone)
			}
			return err
		}))
		return nil
	}
	finder, err := podnet.NewFinder()
	if err != nil {
		return fmt.Errorf("pod interfaces: %w", err)
	}
	d := &ifaceDiscovery{
		log: p.Log, db: p.DB, root: p.Root, endpoints: p.PodEndpoints, interfaces: p.Interfaces, finder: finder,
	}
	p.Jobs.Add(job.OneShot("pod-interfaces", d.run))
	ops := &ifaceOps{
		log: p.Log, cfg: p.Config, pinDir: string(p.PinDir), mode: iflink.Mode(p.Config.PolicyInterfaceAttach),
		a: a, policy: p.Ops, ipcache: p.IPCache,
		attached: map[string]int{},
	}
	p.Jobs.Add(job.OneShot("pod-interface-programs", ops.publish, job.WithRetry(-1, attachRetry())))
	if err := registerIfaceReconciler(p.ReconcilerParams, ops, p.Interfaces); err != nil {
		return err
	}
	p.Lifecycle.Append(cell.Hook{OnStop: func(cell.HookContext) error { ops.close(); return nil }})
	return p.Registry.Register(&decisionsCollector{
		read: func() ([]uint64, error) { c, err := ops.stats(); return c[:], err },
		decisions: prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "policy", "interface_decisions_total"),
			"Decisions of the programs on pods' interfaces (packets of flows they do not know yet), by direction and verdict; counted in the datapath",
			[]string{"direction", "verdict"}, nil),
		drops: prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "policy", "interface_drops_total"),
			"Packets dropped on pods' interfaces whatever the policy: reason spoofed (a source not the pod's own), not-ip (neither IP nor ARP), unparsable (IP whose headers cannot be read to the ports) or fragment-unknown (a later fragment whose first one the interface does not know: denied, or pushed out by the pod's newer ones)",
			[]string{"reason"}, nil),
		dropReasons: map[int]string{
			bpf.PolicyIfaceStatsSpoofed: "spoofed", bpf.PolicyIfaceStatsNotIP: "not-ip",
			bpf.PolicyIfaceStatsUnparsable: "unparsable", bpf.PolicyIfaceStatsFragUnknown: "fragment-unknown",
		},
	})
}

// decisionsCollector exports, when scraped, the counts a policy program
// keeps in its stats map (read): decisions by direction and verdict, and,
// if drops is set, the drops by reason (dropReasons: index → reason).
type decisionsCollector struct {
	read        func() ([]uint64, error)
	decisions   *prometheus.Desc
	drops       *prometheus.Desc
	dropReasons map[int]string
}

func (c *decisionsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.decisions
	if c.drops != nil {
		ch <- c.drops
	}
}

func (c *decisionsCollector) Collect(ch chan<- prometheus.Metric) {
	counts, err := c.read()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.decisions, err)
		return
	}
	names := [...]string{bpf.PolicyVerdictAllowed: "allowed", bpf.PolicyVerdictDenied: "denied", bpf.PolicyVerdictAudited: "audited"}
	for d, dir := range []string{"ingress", "egress"} {
		for v, verdict := range names {
			ch <- prometheus.MustNewConstMetric(c.decisions, prometheus.CounterValue,
				float64(counts[d*bpf.PolicyVerdicts+v]), dir, verdict)
		}
	}
	for i, reason := range c.dropReasons {
		ch <- prometheus.MustNewConstMetric(c.drops, prometheus.CounterValue, float64(counts[i]), reason)
	}
}

// registerMetrics exports the verdict counters of the datapath and the
// policy map's writes.
func registerMetrics(reg prometheus.Registerer, a *attacher, ops *reconcilers.Policy) error {
	collectors := []prometheus.Collector{
		&decisionsCollector{
			read: func() ([]uint64, error) { c, err := a.verdicts(); return c[:], err },
			decisions: prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "policy", "decisions_total"),
				"Decisions of the policy programs (connections, and packets of flows not yet known), by direction and verdict (audited: would have been denied); counted in the datapath, exact",
				[]string{"direction", "verdict"}, nil),
		},
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "events_lost_total",
			Help: "Verdict events the policy programs could not hand to the agent (a full ring buffer)",
		}, func() float64 { return float64(a.lost()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "events_over_budget_total",
			Help: "Verdict events the policy programs dropped because their endpoint exceeded its share of the ring (per endpoint in the pinned policy_event_budget map)",
		}, func() float64 {
			var n uint64
			for _, lost := range a.budgetLost() {
				n += lost
			}
			return float64(n)
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "map_updates_total",
			Help: "Entries written to the policy and policy_endpoints maps",
		}, func() float64 { u, _ := ops.Writes(); return float64(u) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "map_deletes_total",
			Help: "Entries deleted from the policy and policy_endpoints maps",
		}, func() float64 { _, d := ops.Writes(); return float64(d) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "map_entries",
			Help: "Entries in the policy map",
		}, func() float64 { return float64(ops.Entries()) }),
	}
	for _, c := range collectors {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
