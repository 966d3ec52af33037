// Command lb-reference runs the reference's load-balancer control-plane
// benchmark (github.com/cilium/cilium v1.19.3, pkg/loadbalancer/benchmark)
// so that apiary's BenchmarkServices can be measured next to it in one run
// (scripts/lb-reference/compare.sh, `make bench-lb-reference`). It lives in
// a module of its own so that apiary's go.mod never requires the reference.
package main

import (
	"flag"
	"log/slog"

	"github.com/cilium/cilium/pkg/loadbalancer/benchmark"
)

func main() {
	services := flag.Int("services", 50000, "number of services, each with one EndpointSlice of one backend")
	iterations := flag.Int("iterations", 5, "insert and delete rounds, averaged")
	flag.Parse()
	benchmark.RunBenchmark(*services, *iterations, slog.LevelError, false)
}
