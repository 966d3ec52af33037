package reconcilers

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/podiface"
)

// PolicyIfaces are the maps of packet-level enforcement on pods'
// interfaces, opened through a bpf.Opener: policy_ifaces (each
// interface's pod: its cgroup, flags and addresses), policy_iface_flows
// and policy_iface_frags (maps of maps: each interface has a flow LRU and
// a fragment LRU of its own) and policy_iface_stats (the programs'
// counters). The pod-interfaces reconciler (cells/policy) makes its map
// operations through it; attaching the programs is the cell's. Safe for
// concurrent use.
//
// policy_ifaces is not a Mirror: apiary-cni writes pending entries into
// it while the agent is away or has not found a pod yet, so an entry is
// compared with what the map holds, not with a record.
type PolicyIfaces struct {
	log    *slog.Logger
	opener bpf.Opener
	pinDir string
	// max is how many interfaces the maps hold; flows how many flows
	// each interface's LRU does.
	max, flows uint32

	mu                          sync.Mutex
	ifaces, flowMaps, frags, st bpf.Map
}

// NewPolicyIfaces returns the maps pinned in pinDir, for up to max
// interfaces with flows flows each, none open yet.
func NewPolicyIfaces(log *slog.Logger, opener bpf.Opener, pinDir string, max, flows uint32) *PolicyIfaces {
	return &PolicyIfaces{log: log, opener: opener, pinDir: pinDir, max: max, flows: flows}
}

// PolicyIfacesPinned are the pins of the packet-level maps, which a
// detach removes.
var PolicyIfacesPinned = []string{bpf.PolicyIfacesMap, bpf.PolicyIfaceFlowsMap, bpf.PolicyIfaceFragsMap, bpf.PolicyIfaceStatsMap}

// Open opens (or creates) the maps unless they are open. A pin of another
// size or layout is replaced empty: the entries are written again by the
// reconciler, the flows are relearnt.
func (p *PolicyIfaces) Open() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ifaces != nil {
		return nil
	}
	opened, err := bpf.OpenMaps(p.opener, p.log, p.pinDir, bpf.PolicyIfacesMapSpec(p.max),
		bpf.PolicyIfaceFlowsMapSpec(p.max, p.flows), bpf.PolicyIfaceFragsMapSpec(p.max), bpf.PolicyIfaceStatsMapSpec())
	if err != nil {
		return err
	}
	p.ifaces, p.flowMaps, p.frags, p.st = opened[0], opened[1], opened[2], opened[3]
	return nil
}

// IsOpen tells whether Open succeeded (and Close has not run since).
func (p *PolicyIfaces) IsOpen() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ifaces != nil
}

// PolicyIfaceProgramMaps are the kernel's packet-level maps, for loading
// the interface programs on them.
type PolicyIfaceProgramMaps struct {
	Ifaces, Flows, Frags, Stats *ebpf.Map
}

// Programs returns the open maps as the kernel's; maps in memory, or maps
// not open, are an error.
func (p *PolicyIfaces) Programs() (PolicyIfaceProgramMaps, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ifaces == nil {
		return PolicyIfaceProgramMaps{}, p.errNotOpen()
	}
	var out PolicyIfaceProgramMaps
	if err := bpf.ToKernelMaps(bpf.Into(&out.Ifaces, p.ifaces), bpf.Into(&out.Flows, p.flowMaps), bpf.Into(&out.Frags, p.frags), bpf.Into(&out.Stats, p.st)); err != nil {
		return PolicyIfaceProgramMaps{}, err
	}
	return out, nil
}

func (p *PolicyIfaces) errNotOpen() error { return fmt.Errorf("%s not open", bpf.PolicyIfacesMap) }

// Put writes the policy_ifaces entry of interface ifindex unless the map
// holds it already (over a different one: apiary-cni's pending entry
// among them).
func (p *PolicyIfaces) Put(ifindex int, v bpf.PolicyIfaceValue) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ifaces == nil {
		return p.errNotOpen()
	}
	key := uint32(ifindex)
	var cur bpf.PolicyIfaceValue
	if err := p.ifaces.Lookup(key, &cur); err == nil && cur == v {
		return nil
	}
	if err := p.ifaces.Put(key, v); err != nil {
		return fmt.Errorf("write %s[%d]: %w", bpf.PolicyIfacesMap, key, err)
	}
	return nil
}

// Pending tells whether interface ifindex has no entry the agent wrote:
// none, or apiary-cni's pending one. Maps not open hold nothing to tell.
func (p *PolicyIfaces) Pending(ifindex int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ifaces == nil {
		return false
	}
	var cur bpf.PolicyIfaceValue
	err := p.ifaces.Lookup(uint32(ifindex), &cur)
	return err != nil || podiface.Pending(cur)
}

// EnsureState gives interface ifindex its flow and fragment maps: new
// ones when fresh (a new interface, or a new pod on a reused index, which
// must not inherit the old one's flows), the ones it has otherwise (an
// agent restart keeps them).
func (p *PolicyIfaces) EnsureState(ifindex int, fresh bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ifaces == nil {
		return p.errNotOpen()
	}
	key := uint32(ifindex)
	if err := ensureInner(p.flowMaps, key, fresh, bpf.PolicyIfaceFlowsInnerSpec(p.flows)); err != nil {
		return fmt.Errorf("the flow map: %w", err)
	}
	if err := ensureInner(p.frags, key, fresh, bpf.PolicyIfaceFragsInnerSpec()); err != nil {
		return fmt.Errorf("the fragment map: %w", err)
	}
	return nil
}

// ensureInner gives key a new inner map of outer, made from spec, when it
// has none (or one that cannot be read) or fresh says its old one is
// another pod's.
func ensureInner(outer bpf.Map, key uint32, fresh bool, spec *ebpf.MapSpec) error {
	if !fresh {
		if ok, _ := bpf.HasInner(outer, key); ok {
			return nil
		}
	}
	return bpf.PutInner(outer, key, spec)
}

// Remove deletes the entries of interface ifindex from policy_ifaces and
// its flow and fragment maps; maps not open hold none of this process's.
func (p *PolicyIfaces) Remove(ifindex int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ifaces == nil {
		return nil
	}
	var errs []error
	key := uint32(ifindex)
	for _, x := range []struct {
		m    bpf.Map
		name string
	}{{p.ifaces, bpf.PolicyIfacesMap}, {p.flowMaps, bpf.PolicyIfaceFlowsMap}, {p.frags, bpf.PolicyIfaceFragsMap}} {
		if err := x.m.Delete(key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("delete %d from %s: %w", ifindex, x.name, err))
		}
	}
	return errors.Join(errs...)
}

// Interfaces returns the interfaces policy_ifaces has entries for (none
// when it is not open).
func (p *PolicyIfaces) Interfaces() ([]int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ifaces == nil {
		return nil, nil
	}
	return pinnedInterfaces(p.ifaces)
}

func pinnedInterfaces(m bpf.Map) ([]int, error) {
	var out []int
	err := bpf.Walk(m, 1024, func(keys []uint32, _ []bpf.PolicyIfaceValue) error {
		for _, k := range keys {
			out = append(out, int(k))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", bpf.PolicyIfacesMap, err)
	}
	return out, nil
}

// PinnedPolicyInterfaces returns the interfaces the policy_ifaces pinned
// in pinDir (opened through opener) has entries for, whichever run wrote
// it; none when there is no such pin.
func PinnedPolicyInterfaces(opener bpf.Opener, pinDir string) ([]int, error) {
	m, err := opener.LoadMap(pinDir, bpf.PolicyIfacesMap)
	if err != nil {
		return nil, nil
	}
	defer m.Close()
	return pinnedInterfaces(m)
}

// Stats returns policy_iface_stats summed over the CPUs (zeros when it is
// not open).
func (p *PolicyIfaces) Stats() ([bpf.PolicyIfaceStatsEntries]uint64, error) {
	var out [bpf.PolicyIfaceStatsEntries]uint64
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.st == nil {
		return out, nil
	}
	err := bpf.SumPerCPU(p.st, bpf.PolicyIfaceStatsMap, out[:])
	return out, err
}

// Close closes the maps; the pins stay.
func (p *PolicyIfaces) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range []bpf.Map{p.ifaces, p.flowMaps, p.frags, p.st} {
		if m != nil {
			m.Close()
		}
	}
	p.ifaces, p.flowMaps, p.frags, p.st = nil, nil, nil, nil
}
