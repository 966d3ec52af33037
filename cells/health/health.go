// Package health implements cell.Health for the agent. Every module reports
// into its own scope (a dotted path such as "lb.job-reconcile"); the latest
// level, message and error of each open scope live in the statedb table
// "health", which /healthz, `apiary db show health` and the `health` script
// command read.
package health

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// Cell provides the root cell.Health, the *Registry that reads every scope and
// the read-only health table. Modules get their own scope through
// ModuleDecorator.
var Cell = cell.Module(
	"health",
	"Health of every module",

	cell.Provide(
		NewRegistry,
		func(r *Registry) cell.Health { return r.Root() },
		func(r *Registry) statedb.Table[*tables.HealthStatus] { return r.table },
		scriptCommands,
	),
)

// ModuleDecorator gives each module a health scope named after its id. Pass it
// in hive.Options.ModuleDecorators.
func ModuleDecorator(h cell.Health, id cell.ModuleID) cell.Health {
	return h.NewScope(string(id))
}

// Registry records the status of every open scope in the health table.
type Registry struct {
	log   *slog.Logger
	db    *statedb.DB
	table statedb.RWTable[*tables.HealthStatus]
	now   func() time.Time
}

// NewRegistry creates the health table in db and returns its registry.
func NewRegistry(log *slog.Logger, db *statedb.DB) (*Registry, error) {
	tbl, err := tables.NewHealthTable(db)
	if err != nil {
		return nil, fmt.Errorf("create health table: %w", err)
	}
	return &Registry{log: log, db: db, table: tbl, now: time.Now}, nil
}

// Root returns the root scope. It reports as "agent" (for code outside any
// module), and its sub-scopes are named without a prefix ("lb", not
// "agent.lb"), as they are the modules.
func (r *Registry) Root() cell.Health {
	s := r.scope("agent")
	s.childPrefix = ""
	return s
}

// All returns the status of every open scope, sorted by scope name.
func (r *Registry) All() []*tables.HealthStatus {
	return statedb.Collect(r.table.All(r.db.ReadTxn()))
}

// Unhealthy returns the degraded or stopped scopes, sorted by scope name.
func (r *Registry) Unhealthy() []*tables.HealthStatus {
	return statedb.Collect(statedb.Filter(r.table.All(r.db.ReadTxn()),
		func(s *tables.HealthStatus) bool { return !s.Healthy() }))
}

func (r *Registry) scope(name string) *scope {
	wtxn := r.db.WriteTxn(r.table)
	defer wtxn.Abort()
	if _, _, found := r.table.Get(wtxn, tables.HealthScopeIndex.Query(name)); !found {
		r.table.Insert(wtxn, &tables.HealthStatus{Scope: name, Level: cell.StatusUnknown, Since: r.now()})
		wtxn.Commit()
	}
	return &scope{r: r, name: name, childPrefix: name + "."}
}

func (r *Registry) report(name string, level cell.Level, msg string, err error) {
	errStr := ""
	if err != nil {
		errStr = err.Error()
	}
	// Most reports repeat the last one: a read costs no lock.
	if old, _, found := r.table.Get(r.db.ReadTxn(), tables.HealthScopeIndex.Query(name)); found &&
		old.Level == level && old.Message == msg && old.Error == errStr {
		return
	}
	wtxn := r.db.WriteTxn(r.table)
	defer wtxn.Abort()
	old, _, found := r.table.Get(wtxn, tables.HealthScopeIndex.Query(name))
	if !found {
		// A closed scope is gone for good; late reports are dropped.
		return
	}
	if old.Level == level && old.Message == msg && old.Error == errStr {
		return
	}
	s := *old
	s.Message, s.Error = msg, errStr
	if s.Level != level {
		s.Level, s.Since = level, r.now()
		switch level {
		case cell.StatusDegraded:
			r.log.Warn("Health degraded", "scope", name, "message", msg, "error", err)
		case cell.StatusOK:
			if old.Level == cell.StatusDegraded {
				r.log.Info("Health recovered", "scope", name, "message", msg)
			}
		}
	}
	r.table.Insert(wtxn, &s)
	wtxn.Commit()
}

func (r *Registry) close(name string) {
	wtxn := r.db.WriteTxn(r.table)
	r.table.Delete(wtxn, &tables.HealthStatus{Scope: name})
	wtxn.Commit()
}

// scope is one named health reporter.
type scope struct {
	r           *Registry
	name        string
	childPrefix string
}

func (s *scope) OK(msg string) { s.r.report(s.name, cell.StatusOK, msg, nil) }

func (s *scope) Stopped(reason string) { s.r.report(s.name, cell.StatusStopped, reason, nil) }

func (s *scope) Degraded(reason string, err error) {
	s.r.report(s.name, cell.StatusDegraded, reason, err)
}

func (s *scope) NewScope(name string) cell.Health { return s.r.scope(s.childPrefix + name) }

func (s *scope) Close() { s.r.close(s.name) }

func scriptCommands(r *Registry) hive.ScriptCmdOut {
	return hive.NewScriptCmd("health", healthCmd(r))
}
