// Package ipam gives the agent its own IPs (the health and ingress IPs)
// through the delegated CNI IPAM plugin, with --ipam=delegated-plugin.
//
// For each enabled kind the cell calls the IPAM plugin named by the first
// ipam section of --cni-conf-file, with a fixed container ID per kind
// (apiary-health, apiary-ingress): a recorded IP is kept if CNI CHECK
// confirms it; otherwise CNI DEL (errors ignored) then CNI ADD, and the
// result is recorded durably in --state-dir before the IP is used. A kind
// that is disabled but still recorded is released with DEL. Failures are
// shown on the kind's agent-ips row and in health, and retried with backoff.
//
// Another agent, or a plugin an earlier agent left running when it was
// killed, holds the IPAM lock, which the cell waits for: so a kill -9 at any
// moment leaks no lease. See docs/ipam.md.
package ipam

import (
	"fmt"
	"log/slog"
	"os"
	"slices"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the read-only agent-ips table and allocates, keeps or
// releases the agent's own IPs at start.
//
// Consumers (the ipcache, the health and ingress endpoints) watch the
// table and use the IP of rows that are tables.AgentIPReady.
var Cell = cell.Module(
	"ipam",
	"Agent IPs through the delegated CNI IPAM plugin",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(
		Config.validate,
		tables.NewAgentIPsTable,
	),
	cell.Provide(statedb.RWTable[*tables.AgentIP].ToTable),
	cell.Invoke(start, publishPrefixes),
)

type startParams struct {
	cell.In

	Log    *slog.Logger
	Cfg    settings
	Node   node.Config
	DB     *statedb.DB
	Table  statedb.RWTable[*tables.AgentIP]
	Health cell.Health
	Jobs   job.Group
}

// start inserts the initial rows and, when there is
// anything to allocate or release, adds the job that does it.
func start(p startParams) error {
	recs, err := newRecords(p.Node.StateDir)
	if err != nil {
		return err
	}
	if !p.Cfg.enabled && !hasRecords(recs) {
		return nil
	}
	if p.Cfg.enabled {
		if _, err := os.Stat(p.Cfg.binDir); err != nil {
			// Not fatal: the directory may be mounted or filled later.
			p.Log.Warn("CNI bin dir not usable yet", "flag", "--"+CNIBinDirFlag, "error", err)
		}
	}
	wtxn := p.DB.WriteTxn(p.Table)
	defer wtxn.Abort()
	for _, row := range initialRows(p.Cfg, recs) {
		if _, _, err := p.Table.Insert(wtxn, row); err != nil {
			return fmt.Errorf("insert agent-ips row %s: %w", row.Kind, err)
		}
	}
	wtxn.Commit()

	a := &allocator{
		log:     p.Log,
		cfg:     p.Cfg,
		db:      p.DB,
		table:   p.Table,
		health:  p.Health,
		records: recs,
		plugins: &plugins{log: p.Log, binDir: p.Cfg.binDir, exec: &lockedExec{}},
		ipv6:    p.Node.EnableIPv6,
		done:    map[string]bool{},
		errs:    map[string]error{},
	}
	p.Jobs.Add(job.OneShot("agent-ips", a.run))
	return nil
}

// hasRecords reports whether any kind has a record, i.e. an IP to release.
func hasRecords(r *records) bool {
	return slices.ContainsFunc(allKinds, r.exists)
}
