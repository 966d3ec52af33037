package nodeport

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/cells/lb"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// maglevPruneInterval is how often lb_maglev is searched for tables no
// frontend wants (the first prune, once the table is initialized, removes
// those of frontends gone while the agent was down).
const maglevPruneInterval = 5 * time.Minute

// Backend selection for new flows from outside (--lb-algorithm).
const (
	AlgorithmRandom = "random"
	AlgorithmMaglev = "maglev"
)

// newMaglevOps returns the Maglev reconciler's operations, nil unless
// --lb-algorithm=maglev with the programs enabled.
func newMaglevOps(log *slog.Logger, cfg Config, maps lb.Maps) (*reconcilers.Maglev, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if !cfg.maglev() {
		return nil, nil
	}
	return reconcilers.NewMaglev(log, cfg.LBMaglevTableSize, maps.Maps)
}

// maglevParams are what the Maglev table's writer and reconciler need.
type maglevParams struct {
	cell.In

	RP        reconciler.Params
	Jobs      job.Group
	Cfg       Config
	DB        *statedb.DB
	Frontends statedb.Table[*tables.Frontend]
	Table     statedb.RWTable[*tables.Maglev]
	Ops       *reconcilers.Maglev
	Attacher  *attacher
}

// registerMaglev writes the nodeport-maglev table from the frontends
// table and reconciles it into lb_maglev, with --lb-algorithm=maglev.
func registerMaglev(p maglevParams) error {
	if p.Ops == nil {
		return nil
	}
	_, err := reconciler.Register(p.RP, p.Table,
		(*tables.Maglev).Clone, (*tables.Maglev).SetStatus, (*tables.Maglev).GetStatus,
		p.Ops, nil,
		reconciler.WithPruning(maglevPruneInterval),
	)
	if err != nil {
		return fmt.Errorf("maglev reconciler: %w", err)
	}
	w := &maglevWriter{db: p.DB, frontends: p.Frontends, table: p.Table, attached: p.Attacher.attached}
	// Pruning waits for the writer's first pass, so that a restart does
	// not remove the tables it is about to write again (registered now,
	// before the reconciler can see the table as initialized).
	wtxn := p.DB.WriteTxn(p.Table)
	w.initialized = p.Table.RegisterInitializer(wtxn, "maglev-tables")
	wtxn.Commit()
	p.Jobs.Add(job.OneShot("maglev-tables", w.run))
	return nil
}

// desiredMaglev is the Maglev table a frontend asks for: every
// north-south frontend once the load balancer gave it an ID; nil for the
// others (cluster IPs are balanced at the socket).
func desiredMaglev(fe *tables.Frontend) *tables.Maglev {
	switch fe.Type {
	case tables.FrontendNodePort, tables.FrontendLoadBalancer, tables.FrontendExternalIP:
	default:
		return nil
	}
	if fe.ID == 0 {
		return nil
	}
	m := &tables.Maglev{Frontend: fe.Address, ID: fe.ID}
	for _, b := range fe.Backends {
		if b.State == tables.BackendActive {
			m.Backends = append(m.Backends, b.Address)
		}
	}
	slices.SortFunc(m.Backends, tables.L4Addr.Compare)
	return m
}

// maglevWriter keeps the nodeport-maglev table in step with the frontends
// table, one change at a time.
type maglevWriter struct {
	db        *statedb.DB
	frontends statedb.Table[*tables.Frontend]
	table     statedb.RWTable[*tables.Maglev]
	// attached is closed once lb_maglev is open.
	attached    <-chan struct{}
	initialized func(statedb.WriteTxn)
}

func (w *maglevWriter) run(ctx context.Context, health cell.Health) error {
	// Until the map is open, nothing could be written or pruned: the
	// table is initialized (and the first prune runs) only after.
	health.OK("waiting for the programs' maps")
	select {
	case <-ctx.Done():
		return nil
	case <-w.attached:
	}
	wtxn := w.db.WriteTxn(w.frontends)
	changes, err := w.frontends.Changes(wtxn)
	wtxn.Commit()
	if err != nil {
		return fmt.Errorf("watch frontends: %w", err)
	}
	defer changes.Close()
	for {
		seq, watch := changes.Next(w.db.ReadTxn())
		wtxn := w.db.WriteTxn(w.table)
		for ch := range seq {
			fe := ch.Object
			var want *tables.Maglev
			if !ch.Deleted {
				want = desiredMaglev(fe)
			}
			old, _, had := w.table.Get(wtxn, tables.MaglevFrontendIndex.Query(fe.Address))
			switch {
			case want == nil && had:
				w.table.Delete(wtxn, old)
			case want == nil:
			case had && old.ID == want.ID && slices.Equal(old.Backends, want.Backends):
				// Unchanged (the frontend's status moved, say).
			default:
				want.Status = reconciler.StatusPending()
				w.table.Insert(wtxn, want)
			}
		}
		if w.initialized != nil {
			w.initialized(wtxn)
			w.initialized = nil
		}
		wtxn.Commit()
		health.OK(fmt.Sprintf("%d Maglev tables", w.table.NumObjects(w.db.ReadTxn())))
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		}
	}
}
