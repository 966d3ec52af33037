package selectors

import (
	"context"
	"maps"
	"slices"
	"sync"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// PolicyWarnings carries what policy enforcement finds wrong with valid
// policies without making them invalid (a port name that stands for two
// numbers), to the Warnings of their rows in the policies table: policy
// enforcement sets them, the selectors cell, which owns the table, writes
// them.
type PolicyWarnings struct {
	mu      sync.Mutex
	current map[string][]string
	signal  chan struct{}
}

func newPolicyWarnings() *PolicyWarnings {
	return &PolicyWarnings{current: map[string][]string{}, signal: make(chan struct{}, 1)}
}

// Set replaces the warnings of every policy by byPolicy (policy name →
// sorted warnings); a policy it does not name has none. It never blocks.
func (w *PolicyWarnings) Set(byPolicy map[string][]string) {
	next := make(map[string][]string, len(byPolicy))
	for name, ws := range byPolicy {
		if len(ws) > 0 {
			next[name] = slices.Clone(ws)
		}
	}
	w.mu.Lock()
	same := maps.EqualFunc(w.current, next, slices.Equal)
	w.current = next
	w.mu.Unlock()
	if same {
		return
	}
	select {
	case w.signal <- struct{}{}:
	default:
	}
}

// get returns the warnings of a policy.
func (w *PolicyWarnings) get(name string) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.current[name]
}

type warningsParams struct {
	cell.In

	DB       *statedb.DB
	Jobs     job.Group
	Policies statedb.RWTable[*tables.Policy]
	Warnings *PolicyWarnings
}

func registerWarnings(p warningsParams) {
	p.Jobs.Add(job.OneShot("warnings", func(ctx context.Context, _ cell.Health) error {
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-p.Warnings.signal:
			}
			if err := writeWarnings(p.DB, p.Policies, p.Warnings); err != nil {
				return err
			}
		}
	}))
}

// writeWarnings brings the Warnings of every policy row in line with w.
// (A row written later by the controller takes its warnings from w too.)
func writeWarnings(db *statedb.DB, policies statedb.RWTable[*tables.Policy], w *PolicyWarnings) error {
	wtxn := db.WriteTxn(policies)
	defer wtxn.Abort()
	for row := range policies.All(wtxn) {
		ws := w.get(row.Name)
		if slices.Equal(row.Warnings, ws) {
			continue
		}
		next := *row
		next.Warnings = ws
		if _, _, err := policies.Insert(wtxn, &next); err != nil {
			return err
		}
	}
	wtxn.Commit()
	return nil
}
