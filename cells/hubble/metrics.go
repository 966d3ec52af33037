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
	flows *prometheus.CounterVec
	drops *prometheus.CounterVec
	dnsQ  *prometheus.CounterVec
	dnsR  *prometheus.CounterVec
	// dnsTypes counts the answers' record types.
	dnsTypes *prometheus.CounterVec
	policy   *prometheus.CounterVec
	lost     *prometheus.CounterVec
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
		dnsTypes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "hubble", Name: "dns_response_types_total", Help: "Number of DNS response types",
		}, []string{"type", "qtypes"}),
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
	for _, col := range []prometheus.Collector{m.flows, m.drops, m.dnsQ, m.dnsR, m.dnsTypes, m.policy, m.lost} {
		if err := reg.Register(col); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// observe counts f as the reference's flow, drop, dns and policy
// handlers count a flow (pkg/hubble/metrics/*), with the same label
// values, so that the series dashboards query exist.
func (m *metrics) observe(f *flowpb.Flow) {
	proto := flowProtocol(f)
	var typ, sub string
	switch t := f.GetEventType().GetType(); t {
	case eventTypeAccessLog:
		typ = "L7"
		if f.GetL7().GetDns() != nil {
			sub = "DNS"
		}
	case eventTypeDrop:
		typ = "Drop"
	case eventTypePolicyVerdict:
		typ = "PolicyVerdict"
	default:
		typ, sub = "Unknown", strconv.Itoa(int(t))
	}
	m.flows.WithLabelValues(proto, typ, sub, f.GetVerdict().String()).Inc()

	if f.GetVerdict() == flowpb.Verdict_DROPPED {
		m.drops.WithLabelValues(f.GetDropReasonDesc().String(), proto).Inc()
	}

	if d := f.GetL7().GetDns(); d != nil {
		qtypes, ips := strings.Join(d.GetQtypes(), ","), strconv.Itoa(len(d.GetIps()))
		switch {
		case f.GetVerdict() == flowpb.Verdict_DROPPED:
			m.dnsQ.WithLabelValues("Policy denied", qtypes, ips).Inc()
		case !f.GetIsReply().GetValue():
			m.dnsQ.WithLabelValues("", qtypes, ips).Inc()
		default:
			m.dnsR.WithLabelValues(rcodeName(d.GetRcode()), qtypes, ips).Inc()
			for _, rr := range d.GetRrtypes() {
				m.dnsTypes.WithLabelValues(rr, qtypes).Inc()
			}
		}
	}

	direction, action := strings.ToLower(f.GetTrafficDirection().String()), strings.ToLower(f.GetVerdict().String())
	switch f.GetEventType().GetType() {
	case eventTypePolicyVerdict:
		// The host may connect to any local endpoint: not a verdict.
		if f.GetSource().GetIdentity() == hostIdentity {
			return
		}
		match := "none"
		if f.GetPolicyMatchType() == policyMatchL3L4 {
			match = "l3-l4"
		}
		m.policy.WithLabelValues(direction, match, action).Inc()
	case eventTypeAccessLog:
		if f.GetL7().GetDns() != nil {
			m.policy.WithLabelValues(direction, "l7/dns", action).Inc()
		}
	}
}

// hostIdentity is the reserved identity of the host.
const hostIdentity = 1

// flowProtocol names f's protocol as the reference's metrics do
// (pkg/hubble/api/v1.FlowProtocol).
func flowProtocol(f *flowpb.Flow) string {
	switch f.GetEventType().GetType() {
	case eventTypeAccessLog:
		if f.GetL7().GetDns() != nil {
			return "DNS"
		}
		return "Unknown L7"
	case eventTypeDrop, eventTypePolicyVerdict:
		l4 := f.GetL4()
		switch {
		case l4.GetTCP() != nil:
			return "TCP"
		case l4.GetUDP() != nil:
			return "UDP"
		case l4.GetICMPv4() != nil:
			return "ICMPv4"
		case l4.GetICMPv6() != nil:
			return "ICMPv6"
		case l4.GetSCTP() != nil:
			return "SCTP"
		}
		return "Unknown L4"
	}
	return "Unknown flow"
}

// rcodeNames are the reference's names of DNS response codes in its
// metrics (pkg/hubble/metrics/dns).
var rcodeNames = map[uint32]string{
	0: "No Error", 1: "Format Error", 2: "Server Failure", 3: "Non-Existent Domain", 4: "Not Implemented",
	5: "Query Refused", 6: "Name Exists when it should not", 7: "RR Set Exists when it should not",
	8: "RR Set that should exist does not", 9: "Not Authorized", 10: "Name not contained in zone",
	11: "DSO-TYPE Not Implemented", 16: "Bad OPT Version", 17: "Key not recognized",
	18: "Signature out of time window", 19: "Bad TKEY Mode", 20: "Duplicate key name",
	21: "Algorithm not supported", 22: "Bad Truncation", 23: "Bad/missing Server Cookie",
}

// rcodeName is the name of rc, "" for a code the reference does not name.
func rcodeName(rc uint32) string { return rcodeNames[rc] }
