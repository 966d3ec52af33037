package policyprog

import (
	"testing"

	"github.com/apiary-net/apiary/bpf"
)

// TestEventBudget: policy_events is one ring for every endpoint. A pod
// floods it with denied connects while nobody reads; another pod's one
// denial afterwards is still in the ring, because the flooding pod's
// events beyond its budget are dropped and counted as its own losses
// (policy_event_budget), not the ring's (issue 35 item 11).
func TestEventBudget(t *testing.T) {
	const (
		flooder, other = testEndpoint, testEndpoint + 1
		floods         = 2000
		perSecond      = 50
		burst          = 32
	)
	// Room for 341 events (48 bytes each): the flood alone would fill it.
	d := newDatapathBudget(t, 16384, EventBudget{PerSecond: perSecond, Burst: burst})
	d.peers()
	d.endpoint(bpf.PolicyEnforceEgress) // the pod: default deny egress
	if err := d.putEndpoint(cgroupID(t, d.other),
		bpf.PolicyEndpointValue{EndpointID: other, Flags: bpf.PolicyEnforceEgress}); err != nil {
		t.Fatal(err)
	}

	flood := startChild(t, d.app)
	for i := range floods {
		if got := flood.do("tcp", peerC+":8080"); got != "EPERM" {
			t.Fatalf("flood connect %d: %s, want EPERM", i+1, got)
		}
	}
	victim := startChild(t, d.other)
	if got := victim.do("tcp", peerC+":8080"); got != "EPERM" {
		t.Fatalf("the other pod's connect: %s, want EPERM", got)
	}

	kept := map[uint32]uint64{}
	for d.reader().AvailableBytes() > 0 {
		kept[d.nextEvent().EndpointID]++
	}
	if kept[other] != 1 {
		t.Errorf("the other pod's denial: %d events in the ring, want 1 (the flood's: %d)", kept[other], kept[flooder])
	}
	if lost := d.lost(); lost != 0 {
		t.Errorf("%d events found the ring full, want none: the flood stays within its budget", lost)
	}
	lost := d.budgetLost()
	if lost[flooder] == 0 || lost[flooder]+kept[flooder] != floods {
		t.Errorf("the flooding pod: %d events kept and %d lost to its budget, want some lost and %d in all",
			kept[flooder], lost[flooder], floods)
	}
	if lost[other] != 0 {
		t.Errorf("the other pod lost %d events to its budget, want none", lost[other])
	}
}

// budgetLost returns the events each endpoint lost to its budget, summed
// over CPUs.
func (d *datapath) budgetLost() map[uint32]uint64 {
	d.t.Helper()
	out := map[uint32]uint64{}
	var id uint32
	var perCPU []bpf.PolicyEventBudget
	it := d.maps.Budget.Map.Iterate()
	for it.Next(&id, &perCPU) {
		for _, b := range perCPU {
			out[id] += b.Lost
		}
	}
	if err := it.Err(); err != nil {
		d.t.Fatal(err)
	}
	return out
}
