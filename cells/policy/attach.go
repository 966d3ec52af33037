package policy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/cgrouplink"
	"github.com/apiary-net/apiary/bpf/policyprog"
	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/reconcilers"
)

// LinksDir is the subdirectory of --bpf-pin-dir holding the pinned links
// (shared with the socket load balancer; each hook's pin is named after
// it).
const LinksDir = "links"

// orderCheckInterval is how often the attacher checks, besides at once
// when another feature attaches to the root (cgroups.Root.Attached), that
// its connect and sendmsg programs still run after every other program of
// their hooks (the socket load balancer's, which may be attached after
// them): policy must see the backend, not the service address. The
// periodic check catches programs attached by another process.
const orderCheckInterval = time.Minute

// attacher loads the enforcement programs on the agent's maps and keeps
// them attached to the cgroup root through pinned links.
type attacher struct {
	log     *slog.Logger
	cfg     Config
	pinDir  string
	root    cgroups.Root
	ops     *reconcilers.Policy
	ipcache ipcache.Map
	dns     *dnsMaps
	opened  <-chan struct{}

	mu     sync.Mutex
	links  map[string]link.Link
	progs  map[string]*ebpf.Program
	sock   *ebpf.Map // policy_sk, the sockets' flows
	stats  *ebpf.Map
	events *ebpf.Map
	// budget is policy_event_budget: each endpoint's share of events,
	// and its losses.
	budget *ebpf.Map
	// attached is closed once the programs are attached (the event
	// reader starts then).
	attached chan struct{}
}

func (a *attacher) linksDir() string { return filepath.Join(a.pinDir, LinksDir) }

// run attaches (or, with --enable-policy=never, detaches), then keeps the
// program order right. A failure returns, and the job runs it again after
// attachRetry's backoff.
func (a *attacher) run(ctx context.Context, health cell.Health) error {
	select {
	case <-a.opened:
	case <-ctx.Done():
		return nil
	}
	var msg string
	var err error
	if a.cfg.EnablePolicy == ModeNever {
		msg, err = a.detach()
	} else {
		msg, err = a.attach()
	}
	if err != nil {
		a.log.Error("Policy enforcement programs; retrying", "error", err)
		health.Degraded("Attaching the policy programs failed; retrying", err)
		return fmt.Errorf("policy programs: %w", err)
	}
	a.log.Info(msg)
	health.OK(msg)
	if a.cfg.EnablePolicy == ModeNever {
		<-ctx.Done()
		return nil
	}
	ticker := time.NewTicker(orderCheckInterval)
	defer ticker.Stop()
	for {
		if err := a.keepLast(); err != nil {
			health.Degraded("Policy programs may run before the socket load balancer", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
	}
}

// attachRetry is how a failed attach or detach is retried: after 1 s,
// doubling up to a minute, so that a fixed privilege or mount is picked up
// soon and a lasting failure does not fill the log.
func attachRetry() job.RetryBackoff {
	return &job.ExponentialBackoff{Min: time.Second, Max: time.Minute}
}

// attach loads the programs and puts them into the pinned links.
func (a *attacher) attach() (string, error) {
	a.close()
	cgroup, err := a.root.Prepare()
	if err != nil {
		return "", err
	}
	cgID, err := cgroups.ID(cgroup)
	if err != nil {
		return "", err
	}
	spec, err := policyprog.Spec()
	if err != nil {
		return "", err
	}
	sockSpec, err := bpf.PolicySockMapSpec(spec)
	if err != nil {
		return "", err
	}
	sock, err := bpf.OpenPinnedMap(a.log, sockSpec, a.pinDir, nil)
	if err != nil {
		return "", err
	}
	stats, err := bpf.OpenPinnedMap(a.log, bpf.PolicyStatsMapSpec(), a.pinDir, nil)
	if err != nil {
		sock.Close()
		return "", err
	}
	events, err := bpf.OpenPinnedMap(a.log, bpf.PolicyEventsMapSpec(bpf.DefaultPolicyEventsSize), a.pinDir, nil)
	if err != nil {
		sock.Close()
		stats.Close()
		return "", err
	}
	budget, err := bpf.OpenPinnedMap(a.log, bpf.PolicyEventBudgetMapSpec(eventBudgetEndpoints), a.pinDir, nil)
	if err != nil {
		sock.Close()
		stats.Close()
		events.Close()
		return "", err
	}
	closeMaps := func() {
		sock.Close()
		stats.Close()
		events.Close()
		budget.Close()
	}
	dnsSock, dnsOrigin, dnsConfig, err := a.dns.get()
	if err != nil {
		closeMaps()
		return "", err
	}
	dnsLost, err := a.dns.lostMap()
	if err != nil {
		closeMaps()
		return "", err
	}
	var progs map[string]*ebpf.Program
	endpointsGen := a.ops.EndpointsGen()
	err = a.ops.Maps(func(policy, endpoints *ebpf.Map) error {
		return a.ipcache.WithMap(func(ipc, prefixes *ebpf.Map) error {
			progs, err = policyprog.Load(policyprog.Maps{
				Policy: policy, Endpoints: endpoints, EndpointsGen: endpointsGen, Sock: sock.Map, Stats: stats.Map, IPCache: ipc, Prefixes: prefixes,
				Events: events.Map, Budget: policyprog.EventBudget{Map: budget.Map},
				DNSSock: dnsSock, DNSOrigin: dnsOrigin, DNSConfig: dnsConfig, DNSOriginLost: dnsLost,
			})
			return err
		})
	})
	if err != nil {
		closeMaps()
		return "", err
	}
	if err := os.MkdirAll(a.linksDir(), 0o750); err != nil {
		closeMaps()
		closePrograms(progs)
		return "", fmt.Errorf("links directory: %w", err)
	}
	links := map[string]link.Link{}
	var done []string
	for _, h := range policyprog.Hooks {
		l, how, err := cgrouplink.Attach(a.log, filepath.Join(a.linksDir(), h.Name), h.Attach, progs[h.Program], cgroup, cgID)
		if err != nil {
			for _, l := range links {
				l.Close()
			}
			closeMaps()
			closePrograms(progs)
			return "", fmt.Errorf("attach %s to %s: %w", h.Name, cgroup, err)
		}
		links[h.Name] = l
		done = append(done, h.Name+" "+how)
	}
	a.mu.Lock()
	a.links, a.progs, a.sock, a.stats, a.events, a.budget = links, progs, sock.Map, stats.Map, events.Map, budget.Map
	a.mu.Unlock()
	// The shared flow LRU of earlier versions: no program uses it now.
	if err := bpf.RemovePinnedMap(a.pinDir, bpf.PolicyFlowsMap); err != nil {
		a.log.Warn("Could not remove the old flows map", "error", err)
	}
	select {
	case <-a.attached:
	default:
		close(a.attached)
	}
	mode := ""
	if a.cfg.PolicyAuditMode {
		mode = " in audit mode"
	}
	return fmt.Sprintf("Enforcing policy%s on cgroup %s: %s (links pinned in %s)",
		mode, cgroup, strings.Join(done, ", "), a.linksDir()), nil
}

// keepLast moves the connect4 and sendmsg4 programs after any program
// attached after them (the socket load balancer's).
func (a *attacher) keepLast() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	cgroup := a.root.Path()
	for _, h := range policyprog.Hooks {
		if !policyprog.RunsLast(h.Attach) {
			continue
		}
		l := a.links[h.Name]
		if l == nil {
			continue
		}
		last, err := cgrouplink.RunsLast(l, cgroup, h.Attach)
		if err != nil || last {
			if err != nil {
				return err
			}
			continue
		}
		nl, err := cgrouplink.MoveLast(filepath.Join(a.linksDir(), h.Name), h.Attach, a.progs[h.Program], cgroup)
		if err != nil {
			return fmt.Errorf("move %s after the other programs of %s: %w", h.Name, cgroup, err)
		}
		l.Close()
		a.links[h.Name] = nl
		a.log.Info("Moved a policy program after the other programs of its hook", "hook", h.Name, "cgroup", cgroup)
	}
	return nil
}

// detach removes the pinned links and the maps only the programs use.
func (a *attacher) detach() (string, error) {
	a.close()
	gone, err := cgrouplink.DetachAll(a.linksDir(), policyprog.Hooks)
	if err != nil {
		return "", err
	}
	ifaces, err := detachIfaces(a.pinDir)
	if err != nil {
		return "", err
	}
	if len(ifaces) > 0 {
		gone = append(gone, fmt.Sprintf("%d pod interface links", len(ifaces)))
	}
	for _, name := range []string{bpf.PolicySockMap, bpf.PolicyFlowsMap, bpf.PolicyStatsMap, bpf.PolicyEventsMap,
		bpf.PolicyEventBudgetMap, bpf.DNSOriginMap, bpf.DNSConfigMap, bpf.DNSOriginLostMap} {
		if err := bpf.RemovePinnedMap(a.pinDir, name); err != nil {
			return "", err
		}
	}
	if len(gone) == 0 {
		return "Disabled (--" + EnableFlag + "=never); nothing attached", nil
	}
	return "Disabled (--" + EnableFlag + "=never); detached " + strings.Join(gone, ", "), nil
}

// close drops this process's handles; pinned links stay attached.
func (a *attacher) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, l := range a.links {
		l.Close()
	}
	a.links = nil
	closePrograms(a.progs)
	a.progs = nil
	for _, m := range []*ebpf.Map{a.sock, a.stats, a.events, a.budget} {
		if m != nil {
			m.Close()
		}
	}
	a.sock, a.stats, a.events, a.budget = nil, nil, nil, nil
}

func closePrograms(progs map[string]*ebpf.Program) {
	for _, p := range progs {
		p.Close()
	}
}

// eventsReader returns a reader of policy_events, once the programs are
// attached.
func (a *attacher) eventsReader(ctx context.Context) (*ringbuf.Reader, error) {
	select {
	case <-a.attached:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.events == nil {
		return nil, errors.New("policy_events not open")
	}
	rd, err := ringbuf.NewReader(a.events)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", bpf.PolicyEventsMap, err)
	}
	return rd, nil
}

// sharedMaps returns policy_events and policy_stats, which the interface
// programs share with the socket-level ones, once those are attached.
func (a *attacher) sharedMaps() (events, stats *ebpf.Map, err error) {
	select {
	case <-a.attached:
	default:
		return nil, nil, errors.New("the socket-level policy programs are not attached yet")
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.events == nil || a.stats == nil {
		return nil, nil, errors.New("policy_events and policy_stats are not open")
	}
	return a.events, a.stats, nil
}

// eventBudgetEndpoints sizes policy_event_budget: an endpoint beyond it
// (more than a node has) emits unbounded.
const eventBudgetEndpoints = 65536

// budgetMap returns policy_event_budget, which the interface programs
// share with the socket-level ones (nil before those are attached: the
// interface programs are loaded only after).
func (a *attacher) budgetMap() *ebpf.Map {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.budget
}

// budgetLost returns how many events the endpoints lost to their budgets
// of policy_events, by endpoint ID (summed over CPUs).
func (a *attacher) budgetLost() map[uint32]uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := map[uint32]uint64{}
	if a.budget == nil {
		return out
	}
	var id uint32
	var perCPU []bpf.PolicyEventBudget
	it := a.budget.Iterate()
	for it.Next(&id, &perCPU) {
		for _, b := range perCPU {
			out[id] += b.Lost
		}
	}
	return out
}

// lost returns how many events found policy_events full.
func (a *attacher) lost() uint64 {
	counts, err := a.verdicts()
	if err != nil {
		return 0
	}
	return counts[bpf.PolicyStatsLost]
}

// verdicts returns the counts of policy_stats, summed over CPUs, by
// direction and verdict index, then the events lost.
func (a *attacher) verdicts() ([bpf.PolicyStatsEntries]uint64, error) {
	var out [bpf.PolicyStatsEntries]uint64
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.stats == nil {
		return out, nil
	}
	err := sumPerCPU(a.stats, bpf.PolicyStatsMap, out[:])
	return out, err
}

// sumPerCPU fills out with the counters of the per-CPU array m (named
// name), each summed over the CPUs.
func sumPerCPU(m *ebpf.Map, name string, out []uint64) error {
	for i := range out {
		var perCPU []uint64
		if err := m.Lookup(uint32(i), &perCPU); err != nil {
			return fmt.Errorf("read %s: %w", name, err)
		}
		out[i] = 0
		for _, v := range perCPU {
			out[i] += v
		}
	}
	return nil
}
