package selectors

import (
	"context"
	"maps"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// VerdictCounter adds the verdicts the datapath reports per policy to the
// policies table (the Allowed, Denied and Audited columns), so that an
// unused policy and a busy deny show at a glance. Policy enforcement,
// which reads the verdicts, adds them; the selectors cell owns the table
// and writes them at most once per flushInterval.
type VerdictCounter struct {
	mu      sync.Mutex
	pending map[string]tables.VerdictCounts
	signal  chan struct{}
}

// flushInterval bounds how often the counts are written.
const flushInterval = time.Second

func newVerdictCounter() *VerdictCounter {
	return &VerdictCounter{pending: map[string]tables.VerdictCounts{}, signal: make(chan struct{}, 1)}
}

// Add counts c more verdicts of the policy called name ("cnp/<ns>/<name>"
// or "ccnp/<name>"). It never blocks.
func (v *VerdictCounter) Add(name string, c tables.VerdictCounts) {
	v.mu.Lock()
	v.pending[name] = v.pending[name].Add(c)
	v.mu.Unlock()
	select {
	case v.signal <- struct{}{}:
	default:
	}
}

func (v *VerdictCounter) take() map[string]tables.VerdictCounts {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := v.pending
	v.pending = map[string]tables.VerdictCounts{}
	return out
}

type verdictsParams struct {
	cell.In

	DB       *statedb.DB
	Jobs     job.Group
	Policies statedb.RWTable[*tables.Policy]
	Counter  *VerdictCounter
}

func registerVerdicts(p verdictsParams) {
	p.Jobs.Add(job.OneShot("verdicts", func(ctx context.Context, _ cell.Health) error {
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-p.Counter.signal:
			}
			writeVerdicts(p.DB, p.Policies, p.Counter.take())
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
func writeVerdicts(db *statedb.DB, policies statedb.RWTable[*tables.Policy], counts map[string]tables.VerdictCounts) {
	if len(counts) == 0 {
		return
	}
	wtxn := db.WriteTxn(policies)
	defer wtxn.Abort()
	for name, c := range maps.All(counts) {
		row, _, found := policies.Get(wtxn, tables.PolicyNameIndex.Query(name))
		if !found {
			continue
		}
		next := *row
		next.Verdicts = row.Verdicts.Add(c)
		// Only Verdicts differs; the slices are shared with the old row,
		// which is never modified.
		if _, _, err := policies.Insert(wtxn, &next); err != nil {
			return // the table rejects nothing of its own rows
		}
	}
	wtxn.Commit()
}
