package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// NewRegistry returns a registry holding the Go runtime and process
// collectors, so that every scrape carries go_* and process_* series
// alongside apiary's own.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return reg
}

// register registers every collector or returns the first error. Unlike
// MustRegister it lets a constructor fail populate instead of panicking when
// a name is taken twice in one registry.
func register(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// durationBuckets spans 1µs to about 4s in factors of 4: statedb write
// transactions and reconciler operations range from microseconds (in-memory
// no-ops) to seconds (large batches of BPF map writes).
var durationBuckets = prometheus.ExponentialBuckets(1e-6, 4, 12)
