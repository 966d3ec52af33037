package metrics_test

import (
	"context"
	"errors"
	"iter"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/apiary-net/apiary/cells/metrics"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// thing is the reconciled test object.
type thing struct {
	Name   string
	Status reconciler.Status
}

func (t *thing) TableHeader() []string { return []string{"Name", "Status"} }
func (t *thing) TableRow() []string    { return []string{t.Name, t.Status.String()} }

func (t *thing) clone() *thing { c := *t; return &c }

func (t *thing) setStatus(s reconciler.Status) *thing { t.Status = s; return t }

func (t *thing) getStatus() reconciler.Status { return t.Status }

var thingName = statedb.Index[*thing, string]{
	Name:       "name",
	FromObject: func(t *thing) index.KeySet { return index.NewKeySet(index.String(t.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// ops does nothing but fails updates of objects named "bad-*", so that the
// error metrics have something to count.
type ops struct{ updates atomic.Int64 }

func (o *ops) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, t *thing) error {
	o.updates.Add(1)
	if strings.HasPrefix(t.Name, "bad-") {
		return errors.New("bad thing")
	}
	return nil
}

func (o *ops) Delete(context.Context, statedb.ReadTxn, statedb.Revision, *thing) error { return nil }

func (o *ops) Prune(context.Context, statedb.ReadTxn, iter.Seq2[*thing, statedb.Revision]) error {
	return nil
}

// fixture is a started hive with the metrics cell, statedb, a table "things"
// and a reconciler for it in module "things".
type fixture struct {
	reg   *prometheus.Registry
	db    *statedb.DB
	table statedb.RWTable[*thing]
	r     reconciler.Reconciler[*thing]
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{}
	h := hive.New(
		cell.SimpleHealthCell,
		job.Cell,
		statedb.Cell,
		metrics.Cell,
		cell.Module("things", "Reconciled test things",
			cell.ProvidePrivate(func(r job.Registry, h cell.Health, l *slog.Logger) job.Group {
				return r.NewGroup(h, job.WithLogger(l))
			}),
			cell.Invoke(func(db *statedb.DB, reg *prometheus.Registry, p reconciler.Params) (err error) {
				f.db, f.reg = db, reg
				f.table, err = statedb.NewTable(db, "things", thingName)
				if err != nil {
					return err
				}
				f.r, err = reconciler.Register(p, f.table,
					(*thing).clone, (*thing).setStatus, (*thing).getStatus,
					&ops{}, nil,
					reconciler.WithPruning(time.Hour),
					reconciler.WithRetry(10*time.Millisecond, 10*time.Millisecond),
					reconciler.WithRefreshing(0, nil),
				)
				return err
			}),
		),
	)
	log := hivetest.Logger(t)
	require.NoError(t, h.Start(log, t.Context()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		assert.NoError(t, h.Stop(log, ctx))
	})
	return f
}

func (f *fixture) insert(t *testing.T, names ...string) statedb.Revision {
	t.Helper()
	wtxn := f.db.WriteTxn(f.table)
	defer wtxn.Abort()
	for _, n := range names {
		_, _, err := f.table.Insert(wtxn, &thing{Name: n, Status: reconciler.StatusPending()})
		require.NoError(t, err)
	}
	return f.table.Revision(wtxn.Commit())
}

func (f *fixture) delete(t *testing.T, name string) statedb.Revision {
	t.Helper()
	wtxn := f.db.WriteTxn(f.table)
	defer wtxn.Abort()
	_, _, err := f.table.Delete(wtxn, &thing{Name: name})
	require.NoError(t, err)
	return f.table.Revision(wtxn.Commit())
}

func (f *fixture) waitReconciled(t *testing.T, rev statedb.Revision) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, _, err := f.r.WaitUntilReconciled(ctx, rev)
	require.NoError(t, err)
}

// sample returns the value of the series of family name whose labels include
// want: a gauge's or counter's value, or a histogram's sample count.
func sample(t *testing.T, g prometheus.Gatherer, name string, want map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, lp := range m.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
			}
			for k, v := range want {
				if labels[k] != v {
					continue metrics
				}
			}
			// Checked by field rather than by dto.MetricType so that the
			// test needs no direct dependency on client_model.
			switch {
			case m.GetGauge() != nil:
				return m.GetGauge().GetValue(), true
			case m.GetCounter() != nil:
				return m.GetCounter().GetValue(), true
			case m.GetHistogram() != nil:
				return float64(m.GetHistogram().GetSampleCount()), true
			}
		}
	}
	return 0, false
}

func TestMetrics(t *testing.T) {
	f := newFixture(t)

	f.insert(t, "a", "b", "c")
	f.waitReconciled(t, f.insert(t, "bad-d"))
	f.waitReconciled(t, f.delete(t, "a"))
	f.r.Prune()

	tests := []struct {
		name   string
		labels map[string]string
		check  func(v float64) bool
		want   string
	}{
		{"apiary_statedb_table_objects", map[string]string{"table": "things"}, func(v float64) bool { return v == 3 }, "3 objects"},
		{"apiary_statedb_table_revision", map[string]string{"table": "things"}, func(v float64) bool { return v >= 5 }, ">= 5 (4 inserts, 1 delete)"},
		{"apiary_statedb_table_graveyard_objects", map[string]string{"table": "things"}, func(v float64) bool { return v >= 0 }, "present"},
		{"apiary_statedb_table_delete_trackers", map[string]string{"table": "things"}, func(v float64) bool { return v >= 1 }, ">= 1 (the reconciler's)"},
		{"apiary_statedb_write_txn_duration_seconds", map[string]string{"handle": "DB", "tables": "things"}, func(v float64) bool { return v >= 3 }, ">= 3 write txns"},
		{"apiary_statedb_write_txn_acquisition_seconds", map[string]string{"handle": "DB", "tables": "things"}, func(v float64) bool { return v >= 3 }, ">= 3 write txns"},
		{"apiary_statedb_write_txn_table_acquisition_seconds", map[string]string{"handle": "DB", "table": "things"}, func(v float64) bool { return v >= 3 }, ">= 3 write txns"},
		{"apiary_reconciler_duration_seconds", map[string]string{"module": "things", "op": "update"}, func(v float64) bool { return v >= 4 }, ">= 4 updates"},
		{"apiary_reconciler_duration_seconds", map[string]string{"module": "things", "op": "delete"}, func(v float64) bool { return v == 1 }, "1 delete"},
		{"apiary_reconciler_errors_total", map[string]string{"module": "things"}, func(v float64) bool { return v >= 1 }, ">= 1 failed update"},
		{"apiary_reconciler_current_errors", map[string]string{"module": "things"}, func(v float64) bool { return v == 1 }, "1 object failing"},
		{"apiary_reconciler_prune_total", map[string]string{"module": "things"}, func(v float64) bool { return v >= 1 }, ">= 1 prune"},
		{"apiary_reconciler_prune_errors_total", map[string]string{"module": "things"}, func(v float64) bool { return v == 0 }, "0"},
		{"apiary_reconciler_prune_current_errors", map[string]string{"module": "things"}, func(v float64) bool { return v == 0 }, "0"},
		{"apiary_reconciler_prune_duration_seconds", map[string]string{"module": "things"}, func(v float64) bool { return v >= 1 }, ">= 1 prune"},
		{"go_goroutines", nil, func(v float64) bool { return v > 0 }, "> 0"},
		{"process_open_fds", nil, func(v float64) bool { return v > 0 }, "> 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name+labelsSuffix(tt.labels), func(t *testing.T) {
			var last float64
			var found bool
			// Statuses are committed after WaitUntilReconciled returns and
			// prunes run asynchronously, so let the series settle.
			ok := assert.Eventually(t, func() bool {
				last, found = sample(t, f.reg, tt.name, tt.labels)
				return found && tt.check(last)
			}, 5*time.Second, 10*time.Millisecond)
			if !ok {
				t.Errorf("%s%s: found=%v value=%v, want %s", tt.name, labelsSuffix(tt.labels), found, last, tt.want)
			}
		})
	}
}

func labelsSuffix(labels map[string]string) string {
	if len(labels) == 0 {
		return ""
	}
	var parts []string
	for _, k := range []string{"handle", "table", "tables", "module", "op"} {
		if v, ok := labels[k]; ok {
			parts = append(parts, k+"="+v)
		}
	}
	return "{" + strings.Join(parts, ",") + "}"
}

// TestSeveralHives checks that nothing is registered globally: two hives
// with the metrics cell run side by side, each with its own registry.
func TestSeveralHives(t *testing.T) {
	a, b := newFixture(t), newFixture(t)
	require.NotSame(t, a.reg, b.reg)

	a.waitReconciled(t, a.insert(t, "x", "y"))
	b.waitReconciled(t, b.insert(t, "z"))

	require.Eventually(t, func() bool {
		va, _ := sample(t, a.reg, "apiary_statedb_table_objects", map[string]string{"table": "things"})
		vb, _ := sample(t, b.reg, "apiary_statedb_table_objects", map[string]string{"table": "things"})
		return va == 2 && vb == 1
	}, 5*time.Second, 10*time.Millisecond)

	mfs, err := a.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "apiary_statedb_table_objects" {
			assert.Len(t, mf.GetMetric(), 1, "one table, one series")
		}
	}
}

// TestReconcilerModuleLabel checks how reconciler names are folded into the
// module label.
func TestReconcilerModuleLabel(t *testing.T) {
	tests := []struct {
		id   cell.FullModuleID
		name string
		want string
	}{
		{cell.FullModuleID{"lb"}, "", "lb"},
		{cell.FullModuleID{"agent", "lb"}, "", "agent.lb"},
		{cell.FullModuleID{"lb"}, "backends", "lb/backends"},
	}
	for _, tt := range tests {
		t.Run(tt.want, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			m, err := metrics.NewReconcilerMetrics(reg)
			require.NoError(t, err)
			m.ReconciliationDuration(tt.id, tt.name, reconciler.OpUpdate, time.Millisecond)
			m.PruneError(tt.id, tt.name, errors.New("boom"))

			v, ok := sample(t, reg, "apiary_reconciler_duration_seconds", map[string]string{"module": tt.want, "op": "update"})
			assert.True(t, ok)
			assert.Equal(t, 1.0, v)
			v, ok = sample(t, reg, "apiary_reconciler_prune_current_errors", map[string]string{"module": tt.want})
			assert.True(t, ok)
			assert.Equal(t, 1.0, v)
		})
	}
}

// TestRegisterTwice checks that a name clash is an error, not a panic, so
// that it fails populate with context.
func TestRegisterTwice(t *testing.T) {
	reg := prometheus.NewRegistry()
	_, err := metrics.NewStateDBMetrics(reg)
	require.NoError(t, err)
	_, err = metrics.NewStateDBMetrics(reg)
	require.ErrorContains(t, err, "register statedb metrics")

	_, err = metrics.NewReconcilerMetrics(reg)
	require.NoError(t, err)
	_, err = metrics.NewReconcilerMetrics(reg)
	require.ErrorContains(t, err, "register reconciler metrics")
}
