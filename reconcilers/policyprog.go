package reconcilers

import (
	"log/slog"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
)

// PolicyProgMaps are the maps only the policy programs write, opened
// through a bpf.Opener for the programs to be loaded on: policy_sk (each
// socket's flow), policy_stats (the decisions by direction and verdict,
// and the events lost), policy_events (the verdict ring) and
// policy_event_budget (each endpoint's share of the ring). The agent
// reads the counters. A pin of another size or layout is replaced empty.
// Not safe for concurrent use: the attacher serializes the calls.
type PolicyProgMaps struct {
	sock, stats, events, budget bpf.Map
}

// PolicyProgMapsPinned are the pins of the maps, which a detach removes.
var PolicyProgMapsPinned = []string{bpf.PolicySockMap, bpf.PolicyStatsMap, bpf.PolicyEventsMap, bpf.PolicyEventBudgetMap}

// OpenPolicyProgMaps opens (or creates) the maps pinned in pinDir:
// policy_sk from sockSpec (the programs' own definition), the budget map
// with room for budgetEndpoints endpoints.
func OpenPolicyProgMaps(log *slog.Logger, opener bpf.Opener, pinDir string, sockSpec *ebpf.MapSpec, budgetEndpoints uint32) (*PolicyProgMaps, error) {
	opened, err := bpf.OpenMaps(opener, log, pinDir, sockSpec, bpf.PolicyStatsMapSpec(),
		bpf.PolicyEventsMapSpec(bpf.DefaultPolicyEventsSize), bpf.PolicyEventBudgetMapSpec(budgetEndpoints))
	if err != nil {
		return nil, err
	}
	return &PolicyProgMaps{sock: opened[0], stats: opened[1], events: opened[2], budget: opened[3]}, nil
}

// PolicyProgramMaps are the kernel's maps of PolicyProgMaps, for loading
// the programs on them.
type PolicyProgramMaps struct {
	Sock, Stats, Events, Budget *ebpf.Map
}

// Programs returns the maps as the kernel's; maps in memory are an error.
func (m *PolicyProgMaps) Programs() (PolicyProgramMaps, error) {
	var out PolicyProgramMaps
	if err := bpf.ToKernelMaps(bpf.Into(&out.Sock, m.sock), bpf.Into(&out.Stats, m.stats), bpf.Into(&out.Events, m.events), bpf.Into(&out.Budget, m.budget)); err != nil {
		return PolicyProgramMaps{}, err
	}
	return out, nil
}

// Verdicts returns the counts of policy_stats, summed over CPUs, by
// direction and verdict index, then the events lost.
func (m *PolicyProgMaps) Verdicts() ([bpf.PolicyStatsEntries]uint64, error) {
	var out [bpf.PolicyStatsEntries]uint64
	err := bpf.SumPerCPU(m.stats, bpf.PolicyStatsMap, out[:])
	return out, err
}

// BudgetLost returns how many events the endpoints lost to their budgets
// of policy_events, by endpoint ID (summed over CPUs). Only the kernel's
// map has per-CPU values to read.
func (m *PolicyProgMaps) BudgetLost() map[uint32]uint64 {
	out := map[uint32]uint64{}
	km, err := bpf.KernelMap(m.budget)
	if err != nil {
		return out
	}
	var id uint32
	var perCPU []bpf.PolicyEventBudget
	it := km.Iterate()
	for it.Next(&id, &perCPU) {
		for _, b := range perCPU {
			out[id] += b.Lost
		}
	}
	return out
}

// Close closes the maps; the pins stay.
func (m *PolicyProgMaps) Close() {
	for _, x := range []bpf.Map{m.sock, m.stats, m.events, m.budget} {
		x.Close()
	}
}
