package metrics

import (
	"fmt"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
)

// ReconcilerMetrics implements reconciler.Metrics with Prometheus collectors
// named apiary_reconciler_*. The "module" label is the reconciler's full
// module id (e.g. "lb"), followed by "/<name>" when the reconciler was
// registered with reconciler.WithName, the same key statedb's expvar metrics
// use.
type ReconcilerMetrics struct {
	duration      *prometheus.HistogramVec
	errors        *prometheus.CounterVec
	currentErrors *prometheus.GaugeVec

	pruneDuration      *prometheus.HistogramVec
	prunes             *prometheus.CounterVec
	pruneErrors        *prometheus.CounterVec
	pruneCurrentErrors *prometheus.GaugeVec
}

var _ reconciler.Metrics = (*ReconcilerMetrics)(nil)

const reconcilerSubsystem = "reconciler"

// NewReconcilerMetrics creates the reconciler collectors and registers them
// in reg.
func NewReconcilerMetrics(reg prometheus.Registerer) (*ReconcilerMetrics, error) {
	opts := func(name, help string) prometheus.Opts {
		return prometheus.Opts{Namespace: Namespace, Subsystem: reconcilerSubsystem, Name: name, Help: help}
	}
	histogram := func(name, help string, labels ...string) *prometheus.HistogramVec {
		o := opts(name, help)
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: o.Namespace, Subsystem: o.Subsystem, Name: o.Name, Help: o.Help,
			Buckets: durationBuckets,
		}, labels)
	}
	counter := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts(opts(name, help)), []string{"module"})
	}
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts(opts(name, help)), []string{"module"})
	}
	m := &ReconcilerMetrics{
		duration: histogram("duration_seconds",
			"Time spent in incremental reconciliation operations (op is update or delete; one observation per object or per batch)",
			"module", "op"),
		errors: counter("errors_total",
			"Failed update and delete operations, retries included"),
		currentErrors: gauge("current_errors",
			"Objects currently failing to reconcile and queued for retry"),
		pruneDuration: histogram("prune_duration_seconds",
			"Time spent pruning the target of a reconciler", "module"),
		prunes: counter("prune_total",
			"Prune rounds run, successful or not"),
		pruneErrors: counter("prune_errors_total",
			"Prune rounds that failed"),
		pruneCurrentErrors: gauge("prune_current_errors",
			"1 if the last prune round failed, else 0"),
	}
	err := register(reg,
		m.duration, m.errors, m.currentErrors,
		m.pruneDuration, m.prunes, m.pruneErrors, m.pruneCurrentErrors,
	)
	if err != nil {
		return nil, fmt.Errorf("register reconciler metrics: %w", err)
	}
	return m, nil
}

// moduleLabel keys a reconciler by module and optional name.
func moduleLabel(id cell.FullModuleID, name string) string {
	if name == "" {
		return id.String()
	}
	return id.String() + "/" + name
}

// ReconciliationDuration implements reconciler.Metrics.
func (m *ReconcilerMetrics) ReconciliationDuration(id cell.FullModuleID, name, op string, d time.Duration) {
	m.duration.WithLabelValues(moduleLabel(id, name), op).Observe(d.Seconds())
}

// ReconciliationErrors implements reconciler.Metrics. It is called once per
// incremental round with the operations that failed in that round (retries
// included) and the number of objects still failing.
func (m *ReconcilerMetrics) ReconciliationErrors(id cell.FullModuleID, name string, new, current int) {
	module := moduleLabel(id, name)
	m.errors.WithLabelValues(module).Add(float64(new))
	m.currentErrors.WithLabelValues(module).Set(float64(current))
}

// PruneError implements reconciler.Metrics. The reconciler calls it after
// every prune, with a nil error on success.
func (m *ReconcilerMetrics) PruneError(id cell.FullModuleID, name string, err error) {
	module := moduleLabel(id, name)
	m.prunes.WithLabelValues(module).Inc()
	// Touch the error counter on success too, so the series exists (at 0)
	// from the first prune and rate() works without gaps.
	errs := m.pruneErrors.WithLabelValues(module)
	current := m.pruneCurrentErrors.WithLabelValues(module)
	if err != nil {
		errs.Inc()
		current.Set(1)
	} else {
		current.Set(0)
	}
}

// PruneDuration implements reconciler.Metrics.
func (m *ReconcilerMetrics) PruneDuration(id cell.FullModuleID, name string, d time.Duration) {
	m.pruneDuration.WithLabelValues(moduleLabel(id, name)).Observe(d.Seconds())
}
