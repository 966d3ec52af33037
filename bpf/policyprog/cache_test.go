package policyprog

import (
	"testing"

	"github.com/apiary-net/apiary/bpf"
)

// TestEndpointCache: the programs remember what a cgroup's ancestor walk
// found until policy_endpoints_gen moves, and walk again once it has. A
// process first in no endpoint becomes one that denies everything; an
// entry written without moving the counter is not seen (the cache is in
// use), and is once the counter moves.
func TestEndpointCache(t *testing.T) {
	servers(t, [2]string{"tcp", peerC + ":8080"})
	d := newDatapath(t)
	d.peers()
	c := startChild(t, d.app)
	cg := cgroupID(t, d.pod)
	steps := []struct {
		name string
		do   func()
		want string
	}{
		{"no endpoint", func() {}, "ok"},
		{"endpoint denying egress", func() { d.endpoint(bpf.PolicyEnforceEgress) }, "EPERM"},
		{"entry changed, counter not moved", func() {
			if err := d.maps.Endpoints.Put(cg, bpf.PolicyEndpointValue{EndpointID: testEndpoint}); err != nil {
				t.Fatal(err)
			}
		}, "EPERM"},
		{"counter moved", func() {
			d.gen++
			if err := d.maps.EndpointsGen.Put(uint32(0), d.gen); err != nil {
				t.Fatal(err)
			}
		}, "ok"},
		{"entry deleted, counter moved", func() {
			if err := d.maps.Endpoints.Delete(cg); err != nil {
				t.Fatal(err)
			}
			d.endpoint(bpf.PolicyEnforceEgress)
		}, "EPERM"},
	}
	for _, s := range steps {
		s.do()
		// Twice: the first may walk, the second is served from the cache.
		for i := range 2 {
			if got := c.do("tcp", peerC+":8080"); got != s.want {
				t.Errorf("%s: connect %d: %s, want %s", s.name, i+1, got, s.want)
			}
		}
	}
}
