// Package health implements cell.Health for the agent. Every module reports
// into its own scope (a dotted path such as "lb.job-reconcile"); the latest
// level, message and error of each open scope live in the statedb table
// "health", which /healthz, `apiary db show health` and the `health` script
// command read.
package health

import (
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/internal/textcut"
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
	cell.Invoke(func(lc cell.Lifecycle, r *Registry) {
		lc.Append(cell.Hook{OnStop: func(cell.HookContext) error { r.Flush(); return nil }})
	}),
)

// ModuleDecorator gives each module a health scope named after its id. Pass it
// in hive.Options.ModuleDecorators.
func ModuleDecorator(h cell.Health, id cell.ModuleID) cell.Health {
	return h.NewScope(string(id))
}

// DefaultCoalesce is how long a scope's message may lag behind its reports
// when only the message changes. Many scopes report counts once per round;
// writing each of them at once would write the health table every round, which
// under a burst of events costs a tenth of the agent's CPU.
const DefaultCoalesce = time.Second

// MaxTextLen bounds the message and the error text stored per scope. Longer
// ones are cut (at a character boundary) and end in "… (N more bytes)", so
// that /healthz and the log stay small whatever a module reports; modules
// are expected to summarise well below this.
const MaxTextLen = 4096

// Registry records the status of every open scope in the health table.
// A change of level or error is written at once; a change of message alone
// is written at most once per coalesce interval per scope, the latest one
// winning.
type Registry struct {
	log      *slog.Logger
	db       *statedb.DB
	table    statedb.RWTable[*tables.HealthStatus]
	now      func() time.Time
	coalesce time.Duration

	mu sync.Mutex
	// written is when each scope's row was last written.
	written map[string]time.Time
	// pending holds the messages held back by coalescing, by scope.
	pending map[string]string
	flush   *time.Timer
}

// NewRegistry creates the health table in db and returns its registry.
func NewRegistry(log *slog.Logger, db *statedb.DB) (*Registry, error) {
	tbl, err := tables.NewHealthTable(db)
	if err != nil {
		return nil, fmt.Errorf("create health table: %w", err)
	}
	return &Registry{
		log: log, db: db, table: tbl, now: time.Now, coalesce: DefaultCoalesce,
		written: map[string]time.Time{},
		pending: map[string]string{},
	}, nil
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
		errStr = textcut.Cut(err.Error(), MaxTextLen)
	}
	msg = textcut.Cut(msg, MaxTextLen)
	r.mu.Lock()
	defer r.mu.Unlock()
	// Most reports repeat the last one: a read costs no table lock.
	old, _, found := r.table.Get(r.db.ReadTxn(), tables.HealthScopeIndex.Query(name))
	if !found {
		// A closed scope is gone for good; late reports are dropped.
		return
	}
	if old.Level == level && old.Error == errStr {
		if old.Message == msg {
			delete(r.pending, name)
			return
		}
		if wait := r.written[name].Add(r.coalesce).Sub(r.now()); wait > 0 {
			r.pending[name] = msg
			r.scheduleFlush(wait)
			return
		}
	}
	delete(r.pending, name)
	wtxn := r.db.WriteTxn(r.table)
	r.write(wtxn, old, level, msg, errStr)
	wtxn.Commit()
}

// write replaces old with the new status; msg and errStr are already
// truncated. The caller holds r.mu.
func (r *Registry) write(wtxn statedb.WriteTxn, old *tables.HealthStatus, level cell.Level, msg, errStr string) {
	s := *old
	s.Message, s.Error = msg, errStr
	if s.Level != level {
		s.Level, s.Since = level, r.now()
		switch level {
		case cell.StatusDegraded:
			r.log.Warn("Health degraded", "scope", s.Scope, "message", msg, "error", errStr)
		case cell.StatusOK:
			if old.Level == cell.StatusDegraded {
				r.log.Info("Health recovered", "scope", s.Scope, "message", msg)
			}
		}
	}
	r.table.Insert(wtxn, &s)
	r.written[s.Scope] = r.now()
}

// scheduleFlush makes sure the pending messages are written within wait.
// The caller holds r.mu.
func (r *Registry) scheduleFlush(wait time.Duration) {
	if r.flush == nil {
		r.flush = time.AfterFunc(wait, func() {
			r.mu.Lock()
			defer r.mu.Unlock()
			r.flushPending()
		})
		return
	}
	// With other messages pending, the armed timer fires within one
	// interval of this report too. Otherwise it has fired or its messages
	// were dropped, and it is re-armed.
	if len(r.pending) == 1 {
		r.flush.Reset(wait)
	}
}

// Flush writes every message held back by coalescing now, in one
// transaction. The agent flushes when it stops, so that its last words are
// in the table.
func (r *Registry) Flush() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.flush != nil {
		r.flush.Stop()
	}
	r.flushPending()
}

// flushPending writes every held-back message in one transaction. The caller
// holds r.mu.
func (r *Registry) flushPending() {
	if len(r.pending) == 0 {
		return
	}
	wtxn := r.db.WriteTxn(r.table)
	for name, msg := range r.pending {
		// Level and error are unchanged: a report changing them drops the
		// pending message.
		if old, _, found := r.table.Get(wtxn, tables.HealthScopeIndex.Query(name)); found {
			r.write(wtxn, old, old.Level, msg, old.Error)
		}
		delete(r.pending, name)
	}
	wtxn.Commit()
}

func (r *Registry) close(name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.pending, name)
	delete(r.written, name)
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
