package fqdn

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apiary-net/apiary/cells/metrics"
)

// fqdnMetrics are the fqdn cell's Prometheus metrics.
type fqdnMetrics struct {
	requests       *prometheus.CounterVec
	delayExceeded  prometheus.Counter
	holdSeconds    prometheus.Histogram
	breakerRefused prometheus.Counter
	evicted        prometheus.Counter
	gcRemoved      prometheus.Counter
	dropped        *prometheus.CounterVec
	queries        *prometheus.CounterVec
	refused        *prometheus.CounterVec
	untrusted      prometheus.Counter
	podRefused     prometheus.Counter
}

// Results of proxied requests.
const (
	resultForwarded = "forwarded" // answered from upstream, nothing to label
	resultLabelled  = "labelled"  // answered after labelling new addresses
	resultServFail  = "servfail"  // upstream failed or timed out
	resultDropped   = "dropped"   // the upstream's answer was unusable
	// resultUntrusted: learn's, for an answer from a resolver the node
	// does not trust (counted as forwarded).
	resultUntrusted = "untrusted"
)

func newFQDNMetrics(reg prometheus.Registerer) (*fqdnMetrics, error) {
	opts := func(name, help string) prometheus.Opts {
		return prometheus.Opts{Namespace: metrics.Namespace, Subsystem: "fqdn", Name: name, Help: help}
	}
	m := &fqdnMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts(opts("proxy_requests_total",
			"DNS requests the proxy answered, by result (forwarded, labelled, servfail, dropped)")), []string{"result"}),
		delayExceeded: prometheus.NewCounter(prometheus.CounterOpts(opts("proxy_response_delay_exceeded_total",
			"Answers released after --tofqdns-proxy-response-max-delay before the ipcache map had their addresses"))),
		holdSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "fqdn", Name: "proxy_hold_seconds",
			Help: "Time an answer with new addresses was held until the ipcache map had them",
			// 50 µs to about 3 s.
			Buckets: prometheus.ExponentialBuckets(0.00005, 3, 11),
		}),
		breakerRefused: prometheus.NewCounter(prometheus.CounterOpts(opts("identity_limit_refused_total",
			"Addresses left unlabelled because a new selector combination would pass --tofqdns-max-identities"))),
		evicted: prometheus.NewCounter(prometheus.CounterOpts(opts("evicted_ips_total",
			"Addresses evicted because a name had more than --tofqdns-max-ips-per-name"))),
		gcRemoved: prometheus.NewCounter(prometheus.CounterOpts(opts("gc_expired_ips_total",
			"Expired (name, address) pairs removed by garbage collection"))),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts(opts("proxy_dropped_answers_total",
			"Upstream answers dropped as unusable, by reason")), []string{"reason"}),
		queries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "dns", Name: "queries_total",
			Help: "DNS queries the proxy answered, by verdict (allowed: forwarded; denied: no DNS rule of the endpoint allows the name) and the answer's response code",
		}, []string{"verdict", "rcode"}),
		untrusted: prometheus.NewCounter(prometheus.CounterOpts(opts("untrusted_answers_total",
			"Answers for names FQDN selectors match from resolvers the node does not trust, passed on without labelling their addresses"))),
		podRefused: prometheus.NewCounter(prometheus.CounterOpts(opts("pod_limit_refused_ips_total",
			"Addresses of DNS answers not labelled because the pod that asked already brought --tofqdns-max-ips-per-pod addresses"))),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts(opts("proxy_refused_total",
			"Queries and TCP connections the proxy refused before looking at them, by reason (unknown-source, source-inflight, source-tcp-connections)")), []string{"reason"}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.delayExceeded, m.holdSeconds, m.breakerRefused, m.evicted, m.gcRemoved, m.dropped, m.queries, m.refused, m.untrusted, m.podRefused} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
