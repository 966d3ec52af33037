package lb

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/internal/testenv"
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

// BenchmarkManyPortsHive: the same Service and EndpointSlice through the
// reflector, the tables and the reconciler into real maps, until its
// 20,000 frontends are Done.
func BenchmarkManyPortsHive(b *testing.B) {
	testenv.RequireRoot(b)
	const n = 10000
	svcs := newChanResource[*corev1.Service]()
	slices := newChanResource[*discoveryv1.EndpointSlice]()
	db, frontends, _, _ := startChanHive(b, testenv.BPFPinDir(b), svcs, slices, fmt.Sprintf("--%s=%d", MapMaxFlag, 65536))
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "many"},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.96", ExternalIPs: []string{"10.241.9.70"}}}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: "many-1", Labels: map[string]string{discoveryv1.LabelServiceName: "many"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{"10.241.1.11"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
	}
	for i := range n {
		name := fmt.Sprintf("p%d", i)
		svc.Spec.Ports = append(svc.Spec.Ports, corev1.ServicePort{Name: name, Port: int32(10000 + i), Protocol: corev1.ProtocolTCP})
		slice.Ports = append(slice.Ports, discoveryv1.EndpointPort{Name: ptr.To(name), Port: ptr.To(int32(8080)), Protocol: ptr.To(corev1.ProtocolTCP)})
	}
	svcs.ch <- k8s.Event[*corev1.Service]{Kind: k8s.Sync}
	slices.ch <- k8s.Event[*discoveryv1.EndpointSlice]{Kind: k8s.Sync}
	// changed is svc with its last port moved: an update of the Service,
	// which replaces two of its 20,000 frontends.
	changed := svc.DeepCopy()
	changed.Spec.Ports[n-1].Port = 9999
	var update time.Duration
	for b.Loop() {
		slices.ch <- k8s.Event[*discoveryv1.EndpointSlice]{Kind: k8s.Upsert, Key: k8s.KeyOf(slice), Object: slice}
		svcs.ch <- k8s.Event[*corev1.Service]{Kind: k8s.Upsert, Key: k8s.KeyOf(svc), Object: svc}
		waitFrontends(b, db, frontends, 2*n, true)
		b.StopTimer()
		t0 := time.Now()
		svcs.ch <- k8s.Event[*corev1.Service]{Kind: k8s.Upsert, Key: k8s.KeyOf(changed), Object: changed}
		waitFrontendAt(b, db, frontends, tables.L4Addr{Addr: netip.MustParseAddr("10.96.0.96"), Port: 9999, Proto: tables.TCP})
		waitFrontends(b, db, frontends, 2*n, true)
		update += time.Since(t0)
		svcs.ch <- k8s.Event[*corev1.Service]{Kind: k8s.Delete, Key: k8s.KeyOf(svc), Object: svc}
		slices.ch <- k8s.Event[*discoveryv1.EndpointSlice]{Kind: k8s.Delete, Key: k8s.KeyOf(slice), Object: slice}
		waitFrontends(b, db, frontends, 0, false)
		b.StartTimer()
	}
	b.ReportMetric(float64(update.Milliseconds())/float64(b.N), "update-ms")
}

// waitFrontendAt waits until the frontend at addr exists and is Done.
func waitFrontendAt(b testing.TB, db *statedb.DB, frontends statedb.Table[*tables.Frontend], addr tables.L4Addr) {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		if fe, _, ok := frontends.Get(db.ReadTxn(), tables.FrontendAddressIndex.Query(addr)); ok && fe.Status.Kind == reconciler.StatusKindDone {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	b.Fatalf("frontend %s not done in time", addr)
}
