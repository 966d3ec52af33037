// Package lb is the load balancer: it turns Services and EndpointSlices into
// the services, frontends and backends tables, and keeps the lb4_* and lb6_*
// maps (services, backends, reverse NAT) and lb_affinity_match in line with
// the frontends.
//
// The reflector reads both kinds from the input sources (Kubernetes or
// --config-dir) and writes the three tables through one writer, a batch of
// events per write transaction, so that the tables are always consistent
// with each other. The reconciler (reconcilers.LB) writes only what
// changed, in an order that never lets the datapath pick a missing slot.
//
// See docs/load-balancing.md.
package lb

import (
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/spf13/pflag"
	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the read-only services, frontends and backends tables and
// Maps, and keeps the load-balancing maps pinned and up to date.
var Cell = cell.Module(
	"lb",
	"Load balancing of services to backends",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(
		tables.NewServicesTable,
		tables.NewFrontendsTable,
		tables.NewBackendsTable,
		newLBOps,
		newReflector,
	),
	cell.Provide(
		statedb.RWTable[*tables.Service].ToTable,
		statedb.RWTable[*tables.Frontend].ToTable,
		statedb.RWTable[*tables.Backend].ToTable,
		func(ops *reconcilers.LB) Maps { return ops },
		scriptCommands,
	),
	cell.Invoke(
		registerReflector,
		registerReconciler,
		registerMetrics,
	),
)

// MapMaxFlag sizes the load-balancing maps.
const MapMaxFlag = "bpf-lb-map-max"

// Config is the load balancer's configuration.
type Config struct {
	// BPFLBMapMax is the number of entries of each load-balancing map.
	BPFLBMapMax uint32
	// BPFLBPreallocate allocates the maps' entries up front.
	BPFLBPreallocate bool
	// K8sServiceProxyName is the value of the
	// service.kubernetes.io/service-proxy-name label of the services the
	// agent serves; empty, it serves those without the label.
	K8sServiceProxyName string
	// NodePortRange is the ports NodePort frontends may use, MIN-MAX.
	NodePortRange string
}

var defaultConfig = Config{BPFLBMapMax: 65536, NodePortRange: defaultNodePortRange.String()}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.Uint32(MapMaxFlag, def.BPFLBMapMax,
		"Entries of each load-balancing map (lb4_services and lb6_services hold one per frontend plus one per backend of each frontend and one per cluster IP); a change resizes the maps keeping their entries")
	fs.Bool("bpf-lb-preallocate", def.BPFLBPreallocate,
		"Allocate every entry of the load-balancing maps up front (about 80 B × --"+MapMaxFlag+" per map from the start) so that map updates allocate nothing and cost about 2.5 times less; a change re-creates the maps keeping their entries")
	fs.String("node-port-range", def.NodePortRange,
		"The ports a Service's nodePort may use, MIN-MAX (the API server's --service-node-port-range); a nodePort outside is reported on its Service and gets no frontend")
	fs.String("k8s-service-proxy-name", def.K8sServiceProxyName,
		"Serve only the Services whose "+serviceProxyNameLabel+" label has this value; empty, only those without the label (a Service labelled for another proxy is that proxy's, as kube-proxy leaves it)")
}

// Maps gives other cells, such as the datapath loader, the maps the load
// balancer keeps pinned.
type Maps interface {
	// Maps calls fn with the open maps. fn must not keep them.
	Maps(fn func(reconcilers.LBMaps) error) error
}

func newLBOps(log *slog.Logger, cfg Config, pinDir bpffs.PinDir, maps bpffs.Maps, backends statedb.RWTable[*tables.Backend], lc cell.Lifecycle) (*reconcilers.LB, error) {
	if cfg.BPFLBMapMax < 16 || cfg.BPFLBMapMax > 1<<24 {
		return nil, fmt.Errorf("--%s=%d is out of range 16-%d", MapMaxFlag, cfg.BPFLBMapMax, 1<<24)
	}
	ops := reconcilers.NewLB(log, reconcilers.LBConfig{
		PinDir:         string(pinDir),
		Maps:           maps.Opener,
		MaxEntries:     cfg.BPFLBMapMax,
		MaxEntriesFlag: MapMaxFlag,
		Preallocate:    cfg.BPFLBPreallocate,
	}, backends)
	lc.Append(cell.Hook{
		// Opened at start rather than at the first reconciliation, so that
		// pins the agent cannot use (another layout, see bpf.LayoutError)
		// stop it with a clear error instead of degrading it for good.
		OnStart: func(cell.HookContext) error {
			return ops.Maps(func(reconcilers.LBMaps) error { return nil })
		},
		// The reconciler, a job, stops before this.
		OnStop: func(cell.HookContext) error { return ops.Close() },
	})
	return ops, nil
}

func newReflector(
	log *slog.Logger, db *statedb.DB,
	services statedb.RWTable[*tables.Service],
	frontends statedb.RWTable[*tables.Frontend],
	backends statedb.RWTable[*tables.Backend],
	svcs k8s.Resource[*corev1.Service],
	slices k8s.Resource[*discoveryv1.EndpointSlice],
	nodeCfg node.Config,
	cfg Config,
) (*reflector, error) {
	nodePorts, err := parsePortRange(cfg.NodePortRange)
	if err != nil {
		return nil, fmt.Errorf("--node-port-range: %w", err)
	}
	r := &reflector{
		log: log,
		db:  db,
		w: &writer{services: services, frontends: frontends, backends: backends,
			conflicted: map[tables.ServiceName]struct{}{}, sliceRecords: map[tables.ServiceName][]sliceRecord{},
			nodeName: nodeCfg.NodeName, nodeIPs: nodePortAddrs(nodeCfg.NodeIPs)},
		services:     svcs,
		slices:       slices,
		sliceService: map[k8s.Key]tables.ServiceName{},
		proxyName:    cfg.K8sServiceProxyName,
		nodePorts:    nodePorts,
		problems:     map[string]string{},
		change:       newChange(),
	}
	// Registered before anything starts, so that the reconciler does not
	// prune the maps of a restarted agent before the sources are read.
	txn := db.WriteTxn(services, frontends, backends)
	r.initDone = []func(statedb.WriteTxn){
		services.RegisterInitializer(txn, "lb-sources"),
		frontends.RegisterInitializer(txn, "lb-sources"),
		backends.RegisterInitializer(txn, "lb-sources"),
	}
	txn.Commit()
	return r, nil
}

// nodePortAddrs returns the addresses of ips that NodePort frontends
// listen on: those of both families (node.Config has the IPv6 ones only
// with --enable-ipv6), but not link-local ones. A link-local address means
// something only with the interface (zone) it is on, which a frontend
// cannot say, and it is not where services are reached; the addresses
// found on the interfaces when --node-ips is empty are global unicast
// already, so this matters for the flag's.
func nodePortAddrs(ips []netip.Addr) []netip.Addr {
	var out []netip.Addr
	for _, ip := range ips {
		ip = ip.Unmap()
		if ip.IsLinkLocalUnicast() || ip.Zone() != "" {
			continue
		}
		out = append(out, ip)
	}
	return out
}

func registerReflector(jobs job.Group, r *reflector) {
	jobs.Add(job.OneShot("reflect-services", r.run))
}

// Reconciler round limits: up to roundSize frontends per round and
// roundsPerSecond rounds, i.e. a ceiling far above what the maps take.
const (
	roundSize       = 5000
	roundsPerSecond = 200
)

func registerReconciler(p reconciler.Params, frontends statedb.RWTable[*tables.Frontend], ops *reconcilers.LB, resync bpffs.Resync) error {
	// Prune resyncs the maps (--bpf-map-resync-interval); without resync
	// it only deletes strays, so half an hour is soon enough.
	ops.ResyncWith(resync.DriftReport())
	prune := 30 * time.Minute
	if resync.Interval > 0 {
		prune = resync.Interval
	}
	_, err := reconciler.Register(p, frontends,
		(*tables.Frontend).Clone, (*tables.Frontend).SetStatus, (*tables.Frontend).GetStatus,
		ops, ops,
		// Update works from a mirror of the maps, so a periodic refresh
		// would find nothing to do.
		reconciler.WithRefreshing(0, nil),
		reconciler.WithPruning(prune),
		reconciler.WithRetry(100*time.Millisecond, time.Minute),
		// Fewer, bigger rounds: the map writes of a round go out in one
		// batch per map and step, and a round costs a write transaction.
		// A lone change still goes out at once (burst 1).
		reconciler.WithRoundLimits(roundSize, rate.NewLimiter(roundsPerSecond, 1)),
	)
	return err
}
