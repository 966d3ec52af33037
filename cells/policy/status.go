package policy

import (
	"context"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// The policy-status table shows what enforcing each policy on this node
// found: a row per row of the policies table, with the verdicts the
// datapath reported for it (so that an unused policy and a busy deny show
// at a glance) and the warnings of computing it. The policies table is
// the controller's input: writing these there would wake the controller
// with every count.

// verdictCounter collects the verdicts the datapath reports per policy
// until the status job adds them to the rows, at most once per
// flushInterval.
type verdictCounter struct {
	mu      sync.Mutex
	pending map[string]tables.VerdictCounts
	signal  chan struct{}
}

// flushInterval bounds how often the counts are written.
const flushInterval = time.Second

func newVerdictCounter() *verdictCounter {
	return &verdictCounter{pending: map[string]tables.VerdictCounts{}, signal: make(chan struct{}, 1)}
}

// Add counts c more verdicts of the policy called name. It never blocks.
func (v *verdictCounter) Add(name string, c tables.VerdictCounts) {
	v.mu.Lock()
	v.pending[name] = v.pending[name].Add(c)
	v.mu.Unlock()
	select {
	case v.signal <- struct{}{}:
	default:
	}
}

func (v *verdictCounter) take() map[string]tables.VerdictCounts {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := v.pending
	v.pending = map[string]tables.VerdictCounts{}
	return out
}

type statusParams struct {
	cell.In

	DB      *statedb.DB
	Jobs    job.Group
	Status  statedb.RWTable[*tables.PolicyStatus]
	Counter *verdictCounter
}

func registerVerdictWriter(p statusParams) {
	p.Jobs.Add(job.OneShot("verdicts", func(ctx context.Context, _ cell.Health) error {
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-p.Counter.signal:
			}
			writeVerdicts(p.DB, p.Status, p.Counter.take())
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(flushInterval):
			}
		}
	}))
}

// writeVerdicts adds counts to the policies' rows; counts of a policy
// without a row (gone meanwhile) are dropped.
func writeVerdicts(db *statedb.DB, status statedb.RWTable[*tables.PolicyStatus], counts map[string]tables.VerdictCounts) {
	if len(counts) == 0 {
		return
	}
	wtxn := db.WriteTxn(status)
	defer wtxn.Abort()
	for name, c := range maps.All(counts) {
		row, _, found := status.Get(wtxn, tables.PolicyStatusNameIndex.Query(name))
		if !found {
			continue
		}
		next := *row
		next.Verdicts = row.Verdicts.Add(c)
		// Only Verdicts differs; Warnings is shared with the old row,
		// which is never modified.
		if _, _, err := status.Insert(wtxn, &next); err != nil {
			return // the table rejects nothing of its own rows
		}
	}
	wtxn.Commit()
}

// statusRows keeps the policy-status rows in step with the policies
// table and the engine's warnings; the controller calls it after each
// computation.
type statusRows struct {
	db     *statedb.DB
	status statedb.RWTable[*tables.PolicyStatus]
	// added and deleted are the policies that came or went since the last
	// sync; warnings what the last sync wrote.
	added, deleted map[string]struct{}
	warnings       map[string][]string
}

func newStatusRows(db *statedb.DB, status statedb.RWTable[*tables.PolicyStatus]) *statusRows {
	return &statusRows{db: db, status: status, added: map[string]struct{}{}, deleted: map[string]struct{}{}, warnings: map[string][]string{}}
}

// policy records that the policy name came (or changed) or went.
func (s *statusRows) policy(name string, deleted bool) {
	if deleted {
		delete(s.added, name)
		s.deleted[name] = struct{}{}
		return
	}
	delete(s.deleted, name)
	s.added[name] = struct{}{}
}

// sync writes the rows of the policies that came or went and those whose
// warnings (policy name → sorted warnings) changed, in one transaction if
// any.
func (s *statusRows) sync(warnings map[string][]string) error {
	changed := map[string]struct{}{}
	for name, ws := range warnings {
		if !slices.Equal(s.warnings[name], ws) {
			changed[name] = struct{}{}
		}
	}
	for name := range s.warnings {
		if _, ok := warnings[name]; !ok {
			changed[name] = struct{}{}
		}
	}
	if len(s.added) == 0 && len(s.deleted) == 0 && len(changed) == 0 {
		return nil
	}
	wtxn := s.db.WriteTxn(s.status)
	defer wtxn.Abort()
	for name := range s.deleted {
		if _, _, err := s.status.Delete(wtxn, &tables.PolicyStatus{Name: name}); err != nil {
			return err
		}
	}
	for name := range changed {
		s.added[name] = struct{}{}
	}
	for name := range s.added {
		if _, gone := s.deleted[name]; gone {
			continue
		}
		row := &tables.PolicyStatus{Name: name}
		if old, _, found := s.status.Get(wtxn, tables.PolicyStatusNameIndex.Query(name)); found {
			if slices.Equal(old.Warnings, warnings[name]) {
				continue
			}
			row.Verdicts = old.Verdicts
		}
		row.Warnings = slices.Clone(warnings[name])
		if _, _, err := s.status.Insert(wtxn, row); err != nil {
			return err
		}
	}
	wtxn.Commit()
	clear(s.added)
	clear(s.deleted)
	s.warnings = maps.Clone(warnings)
	return nil
}
