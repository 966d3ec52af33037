package nodeport

import (
	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apiary-net/apiary/bpf/nodeport"
	"github.com/apiary-net/apiary/cells/metrics"
)

// statsCollector reads nodeport_stats and counts nodeport_nat4 when
// scraped.
type statsCollector struct {
	packets, entries *prometheus.Desc
	a                *attacher
}

func registerMetrics(reg prometheus.Registerer, a *attacher) error {
	if !a.cfg.EnableNodePort {
		return nil
	}
	return reg.Register(&statsCollector{
		packets: prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "nodeport", "packets_total"),
			"Packets of the nodeport programs by event: new_local, new_remote, forward, reply, and drop_* (no_backend, nat_full, nat_ports, no_snat_address, no_route, source_range); counted in the datapath",
			[]string{"event"}, nil),
		entries: prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "nodeport", "nat_entries"),
			"Entries in nodeport_nat4 (family 4) and nodeport_nat6 (family 6), two per translated flow, against --"+NATMaxFlag, []string{"family"}, nil),
		a: a,
	})
}

func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.packets
	ch <- c.entries
}

func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	c.a.mu.Lock()
	defer c.a.mu.Unlock()
	stats, nat, nat6 := c.a.own[nodeport.StatsMap], c.a.own[nodeport.NAT4Map], c.a.own[nodeport.NAT6Map]
	if stats == nil || nat == nil || nat6 == nil {
		return
	}
	st, err := nodeport.Stats(stats)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.packets, err)
		return
	}
	for _, name := range nodeport.StatNames {
		ch <- prometheus.MustNewConstMetric(c.packets, prometheus.CounterValue, float64(st[name]), name)
	}
	ch <- prometheus.MustNewConstMetric(c.entries, prometheus.GaugeValue, float64(countEntries[nodeport.NATKey, nodeport.NATEntry](nat)), "4")
	ch <- prometheus.MustNewConstMetric(c.entries, prometheus.GaugeValue, float64(countEntries[nodeport.NAT6Key, nodeport.NAT6Entry](nat6)), "6")
}

// countEntries counts a NAT map's entries.
func countEntries[K, V any](m *ebpf.Map) int {
	var (
		k K
		v V
		n int
	)
	for it := m.Iterate(); it.Next(&k, &v); {
		n++
	}
	return n
}
