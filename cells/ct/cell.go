// Package ct owns the conntrack maps: ct4_global (TCP) and ct_any4_global
// (other protocols), plus ct6_global and ct_any6_global with --enable-ipv6
// (a node flag, see node.Config).
//
// The cell sizes the maps from flags or from the node's memory and writes
// one row per map into the ct-maps table. The reconciler (reconcilers.CTMaps)
// converges the rows into pinned maps: a pin of the right size is reused as
// it is, one of another size is replaced by a map holding its live entries,
// so that a resize keeps connections. The cell's garbage collector, a job
// that counts as maintenance of the maps it owns, deletes expired entries.
//
// See docs/conntrack.md for sizing, resizing and GC tuning.
package ct

import (
	"fmt"
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the read-only ct-maps table, Maps, and the ct/dump and
// ct/gc script commands; it keeps the conntrack maps pinned and collects
// their expired entries.
var Cell = cell.Module(
	"ct",
	"Conntrack maps sizing resize and garbage collection",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(
		newDesiredMaps,
		tables.NewCTMapsTable,
		newCTMaps,
		newCTMetrics,
		newGC,
	),
	cell.Provide(
		statedb.RWTable[*tables.CTMap].ToTable,
		func(m *reconcilers.CTMaps) Maps { return m },
		scriptCommands,
	),
	cell.Invoke(
		insertDesired,
		registerReconciler,
		registerGC,
	),
)

// Maps gives other cells, such as the datapath loader, the conntrack maps
// this cell keeps pinned. A map is open once its ct-maps row is Done.
type Maps interface {
	// Use calls fn with the open map called name (e.g. bpf.CT4GlobalMap),
	// or returns an error matching reconcilers.ErrCTMapNotOpen. fn must not
	// keep the map after it returns, as a resize replaces and closes it.
	Use(name string, fn func(bpf.Map) error) error
}

// desiredMaps are the rows the configuration asks for.
type desiredMaps []*tables.CTMap

func newDesiredMaps(cfg Config, nc node.Config, log *slog.Logger) (desiredMaps, error) {
	mem, err := totalMemory()
	if err != nil {
		return nil, err
	}
	tcp, other, err := mapSizes(cfg, mem)
	if err != nil {
		return nil, err
	}
	log.Info("Conntrack map sizes",
		"tcp", tcp.entries, "tcpSizedBy", tcp.sizedBy, "other", other.entries, "otherSizedBy", other.sizedBy,
		"totalMemory", mem, "ipv6", nc.EnableIPv6)

	var rows desiredMaps
	for _, name := range bpf.CTMapNames(nc.EnableIPv6) {
		size := other
		if name == bpf.CT4GlobalMap || name == bpf.CT6GlobalMap {
			size = tcp
		}
		rows = append(rows, &tables.CTMap{
			Name:       name,
			MaxEntries: size.entries,
			SizedBy:    size.sizedBy,
			Status:     reconciler.StatusPending(),
		})
	}
	return rows, nil
}

// newCTMaps returns the reconciler's operations, which also hold the open
// maps until the hive stops. opener is the kernel's pins in the agent,
// maps in memory in a test's hive.
func newCTMaps(log *slog.Logger, opener bpffs.Maps, pinDir bpffs.PinDir, lc cell.Lifecycle) *reconcilers.CTMaps {
	maps := reconcilers.NewCTMaps(log, opener, string(pinDir))
	lc.Append(cell.Hook{
		// Jobs, the reconciler and the GC among them, stop before this.
		OnStop: func(cell.HookContext) error { return maps.Close() },
	})
	return maps
}

// insertDesired writes the desired rows before anything starts, so that the
// reconciler's first prune sees them.
func insertDesired(db *statedb.DB, table statedb.RWTable[*tables.CTMap], rows desiredMaps) error {
	wtxn := db.WriteTxn(table)
	defer wtxn.Abort()
	for _, row := range rows {
		if _, _, err := table.Insert(wtxn, row); err != nil {
			return fmt.Errorf("insert %s: %w", row.Name, err)
		}
	}
	wtxn.Commit()
	return nil
}

func registerReconciler(p reconciler.Params, table statedb.RWTable[*tables.CTMap], maps *reconcilers.CTMaps) error {
	_, err := reconciler.Register(p, table,
		(*tables.CTMap).Clone, (*tables.CTMap).SetStatus, (*tables.CTMap).GetStatus,
		maps, nil,
		// The rows only change at start; reopening the maps periodically
		// would find nothing to do.
		reconciler.WithRefreshing(0, nil),
	)
	return err
}

func registerGC(jobs job.Group, g *gc) {
	jobs.Add(job.OneShot("gc", g.run))
}
