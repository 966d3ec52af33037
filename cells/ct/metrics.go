package ct

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apiary-net/apiary/cells/metrics"
)

// ctMetrics are the conntrack cell's Prometheus metrics, all labelled by map
// name except the interval. They are updated after every garbage collection.
type ctMetrics struct {
	entries     *prometheus.GaugeVec
	maxEntries  *prometheus.GaugeVec
	pressure    *prometheus.GaugeVec
	deleted     *prometheus.CounterVec
	lastDeleted *prometheus.GaugeVec
	duration    *prometheus.HistogramVec
	interval    prometheus.Gauge
}

func newCTMetrics(reg prometheus.Registerer) (*ctMetrics, error) {
	opts := func(name, help string) prometheus.Opts {
		return prometheus.Opts{Namespace: metrics.Namespace, Subsystem: "ct", Name: name, Help: help}
	}
	mapLabel := []string{"map"}
	m := &ctMetrics{
		entries: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("entries",
			"Entries in the conntrack map after the last garbage collection")), mapLabel),
		maxEntries: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("max_entries",
			"Size of the conntrack map in entries")), mapLabel),
		pressure: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("map_pressure",
			"Fill ratio of the conntrack map after the last garbage collection (entries / max entries)")), mapLabel),
		deleted: prometheus.NewCounterVec(prometheus.CounterOpts(opts("gc_deleted_entries_total",
			"Expired entries deleted by garbage collection")), mapLabel),
		lastDeleted: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("gc_last_deleted_entries",
			"Expired entries deleted by the last garbage collection")), mapLabel),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "ct", Name: "gc_duration_seconds",
			Help: "Time a garbage collection of the conntrack map took",
			// 1 ms (a small map) to about 16 s (a full 16Mi map on a slow node).
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 8),
		}, mapLabel),
		interval: prometheus.NewGauge(prometheus.GaugeOpts(opts("gc_interval_seconds",
			"Time until the next conntrack garbage collection"))),
	}
	for _, c := range []prometheus.Collector{m.entries, m.maxEntries, m.pressure, m.deleted, m.lastDeleted, m.duration, m.interval} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// observe records one map's garbage collection.
func (m *ctMetrics) observe(r gcResult) {
	m.entries.WithLabelValues(r.name).Set(float64(r.alive()))
	m.maxEntries.WithLabelValues(r.name).Set(float64(r.maxEntries))
	m.pressure.WithLabelValues(r.name).Set(r.pressure())
	m.deleted.WithLabelValues(r.name).Add(float64(r.deleted))
	m.lastDeleted.WithLabelValues(r.name).Set(float64(r.deleted))
	m.duration.WithLabelValues(r.name).Observe(r.duration.Seconds())
}
