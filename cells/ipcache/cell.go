// Package ipcache owns the prefixes table (labels by prefix and owner), the
// ipcache table (resolved labels and identity per prefix) and the ipcache
// BPF map they are reconciled into, and the policy-prefixes table (the
// prefixes policies name, with the identity an address outside the cluster
// inside them has) and its map.
//
// Other cells label prefixes through Prefixes; the cell itself labels the
// node's own addresses reserved:host. See docs/identities.md.
package ipcache

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"golang.org/x/time/rate"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides Prefixes, the read-only prefixes and ipcache tables and the
// ipcache/dump script command, and keeps the ipcache map.
var Cell = cell.Module(
	"ipcache",
	"Prefix labels identities and the ipcache map",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(
		tables.NewPrefixesTable,
		tables.NewIPCacheTable,
		newPolicyPrefixesTable,
		newOps,
		newPolicyPrefixesOps,
		newPrefixesImpl,
	),
	cell.Provide(
		statedb.RWTable[*tables.PrefixLabels].ToTable,
		statedb.RWTable[*tables.IPCacheEntry].ToTable,
		func(p *prefixes) Prefixes { return p },
		func(ops *reconcilers.IPCache, pp policyPrefixesOps) Map { return prefixMaps{ops, pp.IPCache} },
		scriptCommands,
	),
	cell.Invoke(
		registerReconciler,
		registerPolicyPrefixesReconciler,
		registerResolver,
		registerNodeIPs,
		registerMetrics,
	),
)

// Map gives the datapath loader the maps the cell keeps pinned.
type Map interface {
	// WithMap calls fn with the open ipcache and policy prefixes maps (an
	// error until the cell has started); fn must not keep them.
	WithMap(fn func(ipcache, prefixes *ebpf.Map) error) error
}

// prefixMaps implements Map.
type prefixMaps struct{ ipcache, prefixes *reconcilers.IPCache }

func (m prefixMaps) WithMap(fn func(ipcache, prefixes *ebpf.Map) error) error {
	return m.ipcache.WithMap(func(ipc *ebpf.Map) error {
		return m.prefixes.WithMap(func(pfx *ebpf.Map) error { return fn(ipc, pfx) })
	})
}

// policyPrefixesTable is the policy-prefixes table, a type of its own
// for hive (its rows are the ipcache's).
type policyPrefixesTable struct {
	statedb.RWTable[*tables.IPCacheEntry]
}

func newPolicyPrefixesTable(db *statedb.DB) (policyPrefixesTable, error) {
	t, err := tables.NewPolicyPrefixesTable(db)
	return policyPrefixesTable{t}, err
}

// policyPrefixesOps are the operations on the policy prefixes map.
type policyPrefixesOps struct{ *reconcilers.IPCache }

func newPolicyPrefixesOps(log *slog.Logger) policyPrefixesOps {
	return policyPrefixesOps{reconcilers.NewPolicyPrefixes(log)}
}

// OwnerNode owns the node's own addresses.
const OwnerNode = "node"

// Config is the ipcache cell's configuration.
type Config struct {
	// BPFIPCacheMapMax is the capacity of the ipcache map in prefixes.
	BPFIPCacheMapMax uint32
	// IPCacheChunkSize is how many prefixes are relabelled per write
	// transaction.
	IPCacheChunkSize int
}

var defaultConfig = Config{BPFIPCacheMapMax: bpf.DefaultIPCacheMaxEntries, IPCacheChunkSize: 512}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.Uint32("bpf-ipcache-map-max", def.BPFIPCacheMapMax,
		"Capacity of the ipcache map in prefixes; a change resizes the pinned map, keeping its entries")
	fs.Int("ipcache-chunk-size", def.IPCacheChunkSize,
		"Prefixes relabelled per transaction, which bounds how many old and new identities coexist during a mass relabel")
}

func newOps(log *slog.Logger) *reconcilers.IPCache {
	return reconcilers.NewIPCache(log)
}

func newPrefixesImpl(db *statedb.DB, table statedb.RWTable[*tables.PrefixLabels], ipc statedb.RWTable[*tables.IPCacheEntry]) *prefixes {
	return newPrefixes(db, table, ipc)
}

type resolverParams struct {
	cell.In

	Log       *slog.Logger
	DB        *statedb.DB
	Config    Config
	Node      node.Config
	PinDir    bpffs.PinDir
	Maps      bpffs.Maps
	Lifecycle cell.Lifecycle
	Jobs      job.Group
	Prefixes  *prefixes
	Table     statedb.RWTable[*tables.PrefixLabels]
	IPCache   statedb.RWTable[*tables.IPCacheEntry]
	Policy    policyPrefixesTable
	Alloc     *identity.Allocator
	Ops       *reconcilers.IPCache
	PolicyOps policyPrefixesOps
}

func registerResolver(p resolverParams) error {
	if p.Config.IPCacheChunkSize < 1 {
		return fmt.Errorf("--ipcache-chunk-size=%d: want at least 1", p.Config.IPCacheChunkSize)
	}
	if p.Config.BPFIPCacheMapMax < 1 {
		return fmt.Errorf("--bpf-ipcache-map-max=%d: want at least 1", p.Config.BPFIPCacheMapMax)
	}
	wtxn := p.DB.WriteTxn(p.IPCache, p.Policy)
	markInit := p.IPCache.RegisterInitializer(wtxn, "prefixes-resolved")
	markPolicyInit := p.Policy.RegisterInitializer(wtxn, "prefixes-resolved")
	wtxn.Commit()

	r := &resolver{
		log: p.Log, db: p.DB, prefixes: p.Prefixes, table: p.Table, alloc: p.Alloc,
		ipcache:   view{table: p.IPCache, hints: map[netip.Prefix]uint32{}},
		policy:    view{table: p.Policy.RWTable, hints: map[netip.Prefix]uint32{}},
		dualStack: p.Node.EnableIPv6, chunkSize: p.Config.IPCacheChunkSize,
		present: map[netip.Prefix]struct{}{}, failed: map[netip.Prefix]string{},
		markInitialized: func(wtxn statedb.WriteTxn) { markInit(wtxn); markPolicyInit(wtxn) },
	}
	// The old maps are read before the resolver's first write: their
	// identities are the hints that keep every prefix's number.
	p.Lifecycle.Append(cell.Hook{
		OnStart: func(cell.HookContext) error {
			var ids []uint32
			for _, m := range []struct {
				ops  *reconcilers.IPCache
				name string
				v    view
			}{{p.Ops, bpf.IPCacheMap, r.ipcache}, {p.PolicyOps.IPCache, bpf.PolicyPrefixesMap, r.policy}} {
				restored, err := m.ops.OpenWith(p.Maps, string(p.PinDir), p.Config.BPFIPCacheMapMax)
				if err != nil {
					return fmt.Errorf("open %s map: %w", m.name, err)
				}
				for _, e := range restored {
					m.v.hints[e.Prefix] = e.Identity
					ids = append(ids, e.Identity)
				}
				if len(restored) > 0 {
					p.Log.Info("Read the old prefix map", "map", m.name, "entries", len(restored))
				}
			}
			p.Alloc.Withhold(ids)
			return nil
		},
		// Jobs, the reconcilers among them, stop before this.
		OnStop: func(cell.HookContext) error { return errors.Join(p.Ops.Close(), p.PolicyOps.Close()) },
	})
	p.Jobs.Add(job.OneShot("resolve", r.run))
	return nil
}

func registerReconciler(rp reconciler.Params, table statedb.RWTable[*tables.IPCacheEntry], ops *reconcilers.IPCache, p *prefixes, resync bpffs.Resync) error {
	// Prune resyncs the map (--bpf-map-resync-interval).
	ops.ResyncWith(resync.DriftReport())
	rec, err := reconciler.Register(rp, table,
		(*tables.IPCacheEntry).Clone, (*tables.IPCacheEntry).SetStatus, (*tables.IPCacheEntry).GetStatus,
		ops, ops,
		// Update skips entries the operations already wrote, so a refresh
		// would only compare with their own record; the map itself is
		// compared and repaired by the prune's resync.
		reconciler.WithRefreshing(0, nil),
		reconciler.WithPruning(resync.PruneInterval()),
		// The DNS proxy holds answers until their addresses are in the
		// map, so a round must start as soon as a change lands; rounds
		// still grow on their own while the map is busy.
		reconciler.WithRoundLimits(1000, rate.NewLimiter(rate.Inf, 1)),
	)
	p.rec = rec
	return err
}

// registerPolicyPrefixesReconciler reconciles the policy-prefixes table
// into its map as the ipcache is, resynced with it.
func registerPolicyPrefixesReconciler(rp reconciler.Params, table policyPrefixesTable, ops policyPrefixesOps, p *prefixes, resync bpffs.Resync) error {
	ops.ResyncWith(resync.DriftReport())
	rec, err := reconciler.Register(rp, table.RWTable,
		(*tables.IPCacheEntry).Clone, (*tables.IPCacheEntry).SetStatus, (*tables.IPCacheEntry).GetStatus,
		ops.IPCache, ops.IPCache,
		reconciler.WithName(tables.PolicyPrefixesTableName),
		reconciler.WithRefreshing(0, nil),
		reconciler.WithPruning(resync.PruneInterval()),
		reconciler.WithRoundLimits(1000, rate.NewLimiter(rate.Inf, 1)),
	)
	p.policyRec = rec
	return err
}

// registerNodeIPs labels the node's addresses reserved:host in a start hook
// rather than a job, so they are in the prefixes table once the hive has
// started: whoever changes prefixes later and waits for the change finds the
// node's entries in the map too.
//
// With --node-ips empty, a job then follows the interfaces' addresses
// (nodeAddrs), so that those that come later are the host too.
func registerNodeIPs(lc cell.Lifecycle, jobs job.Group, log *slog.Logger, p *prefixes, nc node.Config) {
	var follow *nodeAddrs
	if nc.FollowAddresses {
		follow = newNodeAddrs(log, p, nc)
		jobs.Add(job.OneShot("follow-node-addresses", follow.run, job.WithRetry(-1, &job.ExponentialBackoff{Min: time.Second, Max: time.Minute})))
	}
	done := p.RegisterInitializer(OwnerNode)
	lc.Append(cell.Hook{OnStart: func(cell.HookContext) error {
		changes := make([]Change, 0, len(nc.NodeIPs))
		for _, ip := range nc.NodeIPs {
			changes = append(changes, Upsert(tables.HostPrefix(ip), OwnerNode, tables.LabelHost))
		}
		if _, err := p.Update(changes...); err != nil {
			return fmt.Errorf("label the node's addresses: %w", err)
		}
		done()
		if follow != nil {
			close(follow.started) // the job changes the labels from here on
		}
		return nil
	}})
}

func registerMetrics(reg prometheus.Registerer, ops *reconcilers.IPCache, db *statedb.DB, table statedb.Table[*tables.IPCacheEntry]) error {
	updates := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "ipcache", Name: "map_updates_total",
		Help: "Entries written to the ipcache map",
	}, func() float64 { u, _ := ops.Writes(); return float64(u) })
	deletes := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "ipcache", Name: "map_deletes_total",
		Help: "Entries deleted from the ipcache map",
	}, func() float64 { _, d := ops.Writes(); return float64(d) })
	entries := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: metrics.Namespace, Subsystem: "ipcache", Name: "prefixes",
		Help: "Prefixes in the ipcache table",
	}, func() float64 { return float64(table.NumObjects(db.ReadTxn())) })
	for _, c := range []prometheus.Collector{updates, deletes, entries} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
