package lb

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/apiary-net/apiary/tables"
)

// BenchmarkManyPorts: the frontends of one Service with 10,000 ports on a
// cluster IP and an external IP (20,000 frontends), and their backends
// (one endpoint, 10,000 slice ports), as the writer computes them: the
// cost a Service with many ports puts on the agent (issue 37's bad input).
func BenchmarkManyPorts(b *testing.B) {
	const n = 10000
	svc := &tables.Service{
		Name:        tables.ServiceName{Namespace: "default", Name: "many"},
		ClusterIPs:  []netip.Addr{netip.MustParseAddr("10.96.0.96")},
		ExternalIPs: []netip.Addr{netip.MustParseAddr("10.241.9.70")},
	}
	var backends []sliceBackend
	for i := range n {
		name := fmt.Sprintf("p%d", i)
		svc.Ports = append(svc.Ports, tables.ServicePort{Name: name, Port: uint16(10000 + i), Protocol: tables.TCP})
		backends = append(backends, sliceBackend{addr: tables.L4Addr{Addr: netip.MustParseAddr("10.241.1.11"), Port: 8080, Proto: tables.TCP}, portName: name})
	}
	for b.Loop() {
		t0 := time.Now()
		fes := desiredFrontends(svc, nil)
		t1 := time.Now()
		byPort := groupByPort(fes, backends) // as the writer does
		for _, fe := range fes {
			fe.Backends = backendsFor(fe, byPort.of(fe.PortName, backends), false, "")
			if len(fe.Backends) != 1 {
				b.Fatalf("%s has %d backends, want 1", fe.Address, len(fe.Backends))
			}
		}
		b.ReportMetric(float64(t1.Sub(t0).Milliseconds()), "ms-frontends")
		b.ReportMetric(float64(time.Since(t1).Milliseconds()), "ms-backends")
	}
}
