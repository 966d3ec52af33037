// Package blockedports is the example feature of docs/extending.md: ports
// given with --example-blocked-ports become rows of a table, and a
// reconciler writes one entry per row into a pinned BPF map, which a
// datapath program would read to refuse the port. It is built and tested
// with the rest of the repository (its scripts run on maps in memory,
// without root), but it is not part of the agent: it is not listed in
// daemon/cells.go.
package blockedports

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the read-only table of blocked ports and the
// example/map-dump and example/map-ops script commands, and keeps the map
// in step with the table.
var Cell = cell.Module(
	"example",
	"Example feature blocked ports into a BPF map",

	cell.Config(Config{}),
	cell.ProvidePrivate(NewTable, newOps),
	cell.Provide(statedb.RWTable[*BlockedPort].ToTable, scriptCommands),
	// The reconciler is registered before the source, so that its first
	// round may come before the rows: testdata/restart.txtar then shows
	// what a missing initializer does.
	cell.Invoke(registerReconciler, registerSource),
)

// Config is the cell's configuration.
type Config struct {
	// ExampleBlockedPorts are "<port>/<proto>" entries, e.g. "8080/tcp".
	ExampleBlockedPorts []string
}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.StringSlice("example-blocked-ports", def.ExampleBlockedPorts, "Ports to refuse, as <port>/<protocol> (e.g. 8080/tcp)")
}

// parse turns the flag's entries into rows; a bad entry is an error that
// names it (the agent does not start).
func (c Config) parse() ([]*BlockedPort, error) {
	var rows []*BlockedPort
	for _, s := range c.ExampleBlockedPorts {
		port, proto, _ := strings.Cut(s, "/")
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil || n == 0 {
			return nil, fmt.Errorf("--example-blocked-ports: %q: want <port>/<protocol>, port 1-65535", s)
		}
		p, err := tables.ParseProto(proto)
		if err != nil {
			return nil, fmt.Errorf("--example-blocked-ports: %q: %w", s, err)
		}
		rows = append(rows, &BlockedPort{Port: uint16(n), Proto: p, Status: reconciler.StatusPending()})
	}
	return rows, nil
}

func newOps(lc cell.Lifecycle, pinDir bpffs.PinDir, maps bpffs.Maps) *ops {
	o := &ops{m: reconcilers.NewMirror[MapKey, uint8](MapName)}
	lc.Append(cell.Hook{
		OnStart: func(cell.HookContext) error { return o.open(maps, string(pinDir)) },
		OnStop:  func(cell.HookContext) error { return o.close() },
	})
	return o
}

// registerSource fills the table from the configuration. The initializer,
// registered before anything starts, holds the reconciler's prune back
// until the rows are in: without it the table counts as initialized from
// the start, and after a restart the first prune would find an empty
// table and delete every entry the last run wrote, leaving the datapath
// without them until the rows are written again.
func registerSource(cfg Config, db *statedb.DB, table statedb.RWTable[*BlockedPort], jobs job.Group) error {
	rows, err := cfg.parse()
	if err != nil {
		return err
	}
	wtxn := db.WriteTxn(table)
	done := table.RegisterInitializer(wtxn, "example-config")
	wtxn.Commit()
	jobs.Add(job.OneShot("fill", func(ctx context.Context, _ cell.Health) error {
		wtxn := db.WriteTxn(table)
		defer wtxn.Abort()
		for _, r := range rows {
			if _, _, err := table.Insert(wtxn, r); err != nil {
				return err
			}
		}
		done(wtxn)
		wtxn.Commit()
		return nil
	}))
	return nil
}

func registerReconciler(p reconciler.Params, table statedb.RWTable[*BlockedPort], o *ops) error {
	_, err := reconciler.Register(p, table,
		(*BlockedPort).Clone, (*BlockedPort).SetStatus, (*BlockedPort).GetStatus,
		o, nil,
	)
	return err
}

// scriptCommands provides example/map-dump (the map's entries, one per
// line) and example/map-ops (how many writes and deletes the reconciler
// made).
func scriptCommands(o *ops) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"example/map-dump": script.Command(
			script.CmdUsage{Summary: "Print the entries of " + MapName},
			func(s *script.State, _ ...string) (script.WaitFunc, error) {
				keys, err := o.dump()
				if err != nil {
					return nil, err
				}
				var lines []string
				for _, k := range keys {
					lines = append(lines, fmt.Sprintf("%d/%s\n", k.Port.Uint16(), tables.Proto(k.Proto)))
				}
				slices.Sort(lines)
				return func(*script.State) (string, string, error) { return strings.Join(lines, ""), "", nil }, nil
			}),
		"example/map-ops": script.Command(
			script.CmdUsage{Summary: "Print how many map writes and deletes the reconciler made"},
			func(s *script.State, _ ...string) (script.WaitFunc, error) {
				writes, deletes := o.counts()
				out := fmt.Sprintf("writes=%d deletes=%d\n", writes, deletes)
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
	})
}
