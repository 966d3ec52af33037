package policy

import (
	"github.com/cilium/hive/cell"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/reconcilers"
)

// decisionsCollector exports, when scraped, the counts a policy program
// keeps in its per-CPU stats map (read): decisions by direction and
// verdict, and, if drops is set, the drops by reason. The socket-level
// programs' and the interface programs' are both one.
type decisionsCollector struct {
	read      func() ([]uint64, error)
	decisions *prometheus.Desc
	drops     *prometheus.Desc
	// dropReasons names the reason of each counter index of drops.
	dropReasons map[int]string
}

// dropsDesc describes the drop counters of a stats map.
type dropsDesc struct {
	help    string
	reasons map[int]string // counter index → reason
}

// newDecisionsCollector returns the collector of
// apiary_policy_<prefix>decisions_total (and, with drops,
// apiary_policy_<prefix>drops_total) from the counters read returns.
func newDecisionsCollector(prefix, help string, read func() ([]uint64, error), drops *dropsDesc) *decisionsCollector {
	c := &decisionsCollector{
		read: read,
		decisions: prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "policy", prefix+"decisions_total"),
			help, []string{"direction", "verdict"}, nil),
	}
	if drops != nil {
		c.drops = prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "policy", prefix+"drops_total"),
			drops.help, []string{"reason"}, nil)
		c.dropReasons = drops.reasons
	}
	return c
}

// Describe implements prometheus.Collector.
func (c *decisionsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.decisions
	if c.drops != nil {
		ch <- c.drops
	}
}

// Collect implements prometheus.Collector.
func (c *decisionsCollector) Collect(ch chan<- prometheus.Metric) {
	counts, err := c.read()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.decisions, err)
		return
	}
	names := [...]string{bpf.PolicyVerdictAllowed: "allowed", bpf.PolicyVerdictDenied: "denied", bpf.PolicyVerdictAudited: "audited"}
	for d, dir := range []string{"ingress", "egress"} {
		for v, verdict := range names {
			ch <- prometheus.MustNewConstMetric(c.decisions, prometheus.CounterValue,
				float64(counts[d*bpf.PolicyVerdicts+v]), dir, verdict)
		}
	}
	for i, reason := range c.dropReasons {
		ch <- prometheus.MustNewConstMetric(c.drops, prometheus.CounterValue, float64(counts[i]), reason)
	}
}

type metricsParams struct {
	cell.In

	Registry prometheus.Registerer
	Attacher *attacher
	Ops      *reconcilers.Policy
}

// registerMetrics exports the verdict counters of the datapath and the
// policy map's writes.
func registerMetrics(p metricsParams) error {
	a, ops := p.Attacher, p.Ops
	collectors := []prometheus.Collector{
		newDecisionsCollector("",
			"Decisions of the policy programs (connections, and packets of flows not yet known), by direction and verdict (audited: would have been denied); counted in the datapath, exact",
			func() ([]uint64, error) { c, err := a.verdicts(); return c[:], err }, nil),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "events_lost_total",
			Help: "Verdict events the policy programs could not hand to the agent (a full ring buffer)",
		}, func() float64 { return float64(a.lost()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "events_over_budget_total",
			Help: "Verdict events the policy programs dropped because their endpoint exceeded its share of the ring (per endpoint in the pinned policy_event_budget map)",
		}, func() float64 {
			var n uint64
			for _, lost := range a.budgetLost() {
				n += lost
			}
			return float64(n)
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "map_updates_total",
			Help: "Entries written to the policy and policy_endpoints maps",
		}, func() float64 { u, _ := ops.Writes(); return float64(u) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "map_deletes_total",
			Help: "Entries deleted from the policy and policy_endpoints maps",
		}, func() float64 { _, d := ops.Writes(); return float64(d) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "map_entries",
			Help: "Entries in the policy map",
		}, func() float64 { return float64(ops.Entries()) }),
	}
	for _, c := range collectors {
		if err := p.Registry.Register(c); err != nil {
			return err
		}
	}
	return nil
}
