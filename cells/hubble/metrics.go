package hubble

import (
	"strconv"
	"strings"

	flowpb "github.com/cilium/cilium/api/v1/flow"
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are Hubble's metrics under Hubble's names and labels, so that
// dashboards built for the reference read them.
type metrics struct {
	flows  *prometheus.CounterVec
	drops  *prometheus.CounterVec
	dnsQ   *prometheus.CounterVec
	dnsR   *prometheus.CounterVec
	policy *prometheus.CounterVec
	lost   *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer, c Config) (*metrics, error) {
	m := &metrics{
		flows: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "hubble", Name: "flows_processed_total", Help: "Total number of flows processed",
		}, []string{"protocol", "type", "subtype", "verdict"}),
		drops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "hubble", Name: "drop_total", Help: "Number of drops",
		}, []string{"reason", "protocol"}),
		dnsQ: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "hubble", Name: "dns_queries_total", Help: "Number of DNS queries observed",
		}, []string{"rcode", "qtypes", "ips_returned"}),
		dnsR: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "hubble", Name: "dns_responses_total", Help: "Number of DNS responses observed",
		}, []string{"rcode", "qtypes", "ips_returned"}),
		policy: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "hubble", Name: "policy_verdicts_total", Help: "Total number of Cilium network policy verdicts",
		}, []string{"direction", "match", "action"}),
		lost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "hubble", Name: "lost_events_total", Help: "Number of lost events",
		}, []string{"source"}),
	}
	if !c.EnableHubble {
		return m, nil
	}
	for _, col := range []prometheus.Collector{m.flows, m.drops, m.dnsQ, m.dnsR, m.policy, m.lost} {
		if err := reg.Register(col); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// observe counts f.
func (m *metrics) observe(f *flowpb.Flow) {
	proto := l4Name(f)
	typ, sub := "L3_L4", ""
	switch f.GetEventType().GetType() {
	case eventTypeDrop:
		typ = "Drop"
	case eventTypePolicyVerdict:
		typ = "PolicyVerdict"
	case eventTypeAccessLog:
		typ, sub, proto = "L7", "DNS", "DNS"
	}
	m.flows.WithLabelValues(proto, typ, sub, f.GetVerdict().String()).Inc()
	if f.GetVerdict() == flowpb.Verdict_DROPPED {
		m.drops.WithLabelValues(f.GetDropReasonDesc().String(), l4Name(f)).Inc()
	}
	if d := f.GetL7().GetDns(); d != nil {
		rcode := ""
		if f.GetL7().GetType() == flowpb.L7FlowType_RESPONSE {
			rcode = rcodeName(d.GetRcode())
		}
		labels := []string{rcode, strings.Join(d.GetQtypes(), ","), strconv.Itoa(len(d.GetIps()))}
		if f.GetL7().GetType() == flowpb.L7FlowType_REQUEST {
			m.dnsQ.WithLabelValues(labels...).Inc()
		} else {
			m.dnsR.WithLabelValues(labels...).Inc()
		}
	}
	if f.GetEventType().GetType() != eventTypeAccessLog {
		match := "none"
		if f.GetPolicyMatchType() == policyMatchL3L4 {
			match = "l3-l4"
		}
		action := map[flowpb.Verdict]string{
			flowpb.Verdict_FORWARDED: "forwarded", flowpb.Verdict_DROPPED: "dropped", flowpb.Verdict_AUDIT: "audit",
		}[f.GetVerdict()]
		m.policy.WithLabelValues(strings.ToLower(f.GetTrafficDirection().String()), match, action).Inc()
	}
}

func l4Name(f *flowpb.Flow) string {
	l4 := f.GetL4()
	switch {
	case l4.GetTCP() != nil:
		return "TCP"
	case l4.GetUDP() != nil:
		return "UDP"
	case l4.GetSCTP() != nil:
		return "SCTP"
	case l4.GetICMPv4() != nil:
		return "ICMPv4"
	case l4.GetICMPv6() != nil:
		return "ICMPv6"
	}
	return "Unknown"
}

func rcodeName(rc uint32) string {
	switch rc {
	case 0:
		return "No Error"
	case 2:
		return "Server Failure"
	case 3:
		return "Non-Existent Domain"
	case 5:
		return "Query Refused"
	}
	return strconv.Itoa(int(rc))
}
