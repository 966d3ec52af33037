package operator

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the operator's Prometheus metrics.
type metrics struct {
	leader        prometheus.Gauge
	identities    prometheus.Gauge
	labelSetsUsed prometheus.Gauge
	created       prometheus.Counter
	deleted       prometheus.Counter
	apiErrors     *prometheus.CounterVec
	gcRuns        prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "apiary_operator_leader", Help: "1 while this replica leads and writes Identities"}),
		identities: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "apiary_operator_identities", Help: "Identities in the cluster, as the leader sees them"}),
		labelSetsUsed: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "apiary_operator_label_sets_in_use", Help: "Distinct label sets of pods"}),
		created: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "apiary_operator_identities_created_total", Help: "Identities this replica created"}),
		deleted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "apiary_operator_identities_deleted_total", Help: "Unused Identities this replica deleted"}),
		apiErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "apiary_operator_identity_api_errors_total", Help: "Failed Identity writes, by verb"}, []string{"verb"}),
		gcRuns: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "apiary_operator_identity_gc_runs_total", Help: "Collections of unused Identities this replica ran while leading, each followed by a full reconcile"}),
	}
	for _, c := range []prometheus.Collector{m.leader, m.identities, m.labelSetsUsed, m.created, m.deleted, m.apiErrors, m.gcRuns} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
