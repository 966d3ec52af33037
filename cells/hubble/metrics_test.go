package hubble

import (
	"testing"
	"time"

	flowpb "github.com/cilium/cilium/api/v1/flow"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/apiary-net/apiary/cells/policy"
)

// TestMetrics: the flows are counted under the reference's names and with
// its label values (pkg/hubble/metrics' flow, drop, dns and policy
// handlers), so that its dashboards find the series.
func TestMetrics(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m, err := newMetrics(reg, Config{EnableHubble: true})
	if err != nil {
		t.Fatal(err)
	}
	fs := testFlows(t)
	for _, name := range []string{"allowed", "denied", "spoofed", "dns-query", "dns-answer"} {
		m.observe(fs[name])
	}
	c := newConverter("node-1", nil, nil, nil, lbTables{})
	refused := c.flows(policy.Verdict{Time: time.Now(), Type: policy.VerdictTypeDNS, Endpoint: "shop/web-1", Direction: "egress",
		Src: "10.0.0.5:3334", Dst: "10.96.0.10:53", Proto: "UDP", Verdict: policy.VerdictDenied,
		DNS: &policy.DNSVerdict{Query: "www.denied.com.", QType: "AAAA", RCode: "REFUSED"}})
	m.observe(refused[0])
	// The host's connection to a pod is no policy verdict.
	m.observe(&flowpb.Flow{Verdict: flowpb.Verdict_FORWARDED, TrafficDirection: flowpb.TrafficDirection_INGRESS,
		EventType: &flowpb.CiliumEventType{Type: eventTypePolicyVerdict}, Source: &flowpb.Endpoint{Identity: hostIdentity},
		L4: &flowpb.Layer4{Protocol: &flowpb.Layer4_TCP{TCP: &flowpb.TCP{}}}})
	// Nor is a translation, which only the flows count.
	m.observe(&flowpb.Flow{Verdict: flowpb.Verdict_TRANSLATED, EventType: &flowpb.CiliumEventType{Type: 7, SubType: 2}})

	for _, tc := range []struct {
		vec    *prometheus.CounterVec
		labels []string
		want   float64
	}{
		{m.flows, []string{"TCP", "PolicyVerdict", "", "FORWARDED"}, 2},
		{m.flows, []string{"UDP", "PolicyVerdict", "", "DROPPED"}, 1},
		{m.flows, []string{"UDP", "Drop", "", "DROPPED"}, 1},
		{m.flows, []string{"DNS", "L7", "DNS", "FORWARDED"}, 2},
		{m.flows, []string{"DNS", "L7", "DNS", "DROPPED"}, 1},
		{m.flows, []string{"Unknown flow", "Unknown", "7", "TRANSLATED"}, 1},
		{m.drops, []string{"POLICY_DENIED", "UDP"}, 1},
		{m.drops, []string{"INVALID_SOURCE_IP", "UDP"}, 1},
		{m.drops, []string{"POLICY_DENIED", "DNS"}, 1},
		{m.dnsQ, []string{"", "A", "0"}, 1},
		{m.dnsQ, []string{"Policy denied", "AAAA", "0"}, 1},
		{m.dnsR, []string{"No Error", "A", "1"}, 1},
		{m.dnsTypes, []string{"A", "A"}, 1},
		{m.policy, []string{"egress", "l3-l4", "forwarded"}, 1},
		{m.policy, []string{"ingress", "none", "dropped"}, 1},
		{m.policy, []string{"ingress", "none", "forwarded"}, 0},
		{m.policy, []string{"egress", "l7/dns", "forwarded"}, 2},
		{m.policy, []string{"egress", "l7/dns", "dropped"}, 1},
	} {
		if got := counterValue(t, tc.vec.WithLabelValues(tc.labels...)); got != tc.want {
			t.Errorf("%v: %v, want %v", tc.labels, got, tc.want)
		}
	}
	// The spoofed packet's drop is no policy verdict: the policy counter
	// has series of the two socket verdicts and the DNS flows only.
	ch := make(chan prometheus.Metric, 100)
	m.policy.Collect(ch)
	if n := len(ch); n != 5 {
		t.Errorf("policy_verdicts_total series: %d, want 5 (the zero one asked for above included)", n)
	}
	if _, err := reg.Gather(); err != nil {
		t.Error(err)
	}
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}
