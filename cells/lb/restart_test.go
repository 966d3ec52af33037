package lb

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/internal/testenv"
)

// TestRestartWithSlicesLate restarts on the same maps with Services
// delivered well before their EndpointSlices, as an informer may: the load
// balancer waits for both kinds, so the restart writes nothing and no
// backend loses its slot or ID in between.
func TestRestartWithSlicesLate(t *testing.T) {
	pinDir := testenv.BPFPinDir(t)
	const n = 20
	feed := func(svcs *chanResource[*corev1.Service], slices *chanResource[*discoveryv1.EndpointSlice], pause time.Duration) {
		for i := range n {
			svc, _ := benchObjects(i, 3, false)
			svcs.ch <- k8s.Event[*corev1.Service]{Kind: k8s.Upsert, Key: k8s.KeyOf(svc), Object: svc}
		}
		svcs.ch <- k8s.Event[*corev1.Service]{Kind: k8s.Sync}
		time.Sleep(pause)
		for i := range n {
			_, slice := benchObjects(i, 3, false)
			slices.ch <- k8s.Event[*discoveryv1.EndpointSlice]{Kind: k8s.Upsert, Key: k8s.KeyOf(slice), Object: slice}
		}
		slices.ch <- k8s.Event[*discoveryv1.EndpointSlice]{Kind: k8s.Sync}
	}

	svcs, slices := newChanResource[*corev1.Service](), newChanResource[*discoveryv1.EndpointSlice]()
	db, frontends, ops, stop := startChanHive(t, pinDir, svcs, slices)
	feed(svcs, slices, 0)
	waitFrontends(t, db, frontends, n, true)
	// Per service: slot 0, three slots, the reverse NAT entry, three
	// backends and the wildcard's slot 0.
	if want := uint64(n * (1 + 3 + 1 + 3 + 1)); totalOps(ops) != want {
		t.Fatalf("first start: %d map operations, want %d", totalOps(ops), want)
	}

	// The next agent on the same pins, once the first has stopped (it holds
	// the pin directory until then).
	stop()
	svcs, slices = newChanResource[*corev1.Service](), newChanResource[*discoveryv1.EndpointSlice]()
	db, frontends, ops, _ = startChanHive(t, pinDir, svcs, slices)
	feed(svcs, slices, 300*time.Millisecond)
	waitFrontends(t, db, frontends, n, true)
	if got := totalOps(ops); got != 0 {
		t.Fatalf("restart with unchanged inputs made %d map operations, want 0", got)
	}
}
