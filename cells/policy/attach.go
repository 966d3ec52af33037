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
	"github.com/apiary-net/apiary/cells/bpffs"
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
	maps    bpf.Opener
	root    cgroups.Root
	ops     *reconcilers.Policy
	ipcache ipcache.Map
	dns     *reconcilers.DNSMaps
	opened  <-chan struct{}

	mu    sync.Mutex
	links map[string]link.Link
	progs map[string]*ebpf.Program
	// own are the maps only the programs write (policy_sk, policy_stats,
	// policy_events, policy_event_budget), nil until attached.
	own *reconcilers.PolicyProgMaps
	// attached is closed once the programs are attached (the event
	// reader starts then).
	attached chan struct{}
}

type attachParams struct {
	cell.In

	Log       *slog.Logger
	Config    Config
	PinDir    bpffs.PinDir
	Maps      bpffs.Maps
	Root      cgroups.Root
	Jobs      job.Group
	Lifecycle cell.Lifecycle
	Ops       *reconcilers.Policy
	Opened    mapsOpened
	IPCache   ipcache.Map
	DNSMaps   *reconcilers.DNSMaps
}

// newAttacher returns the attacher, whose job attaches the programs (or,
// with --enable-policy=never, detaches them) and keeps them in order.
func newAttacher(p attachParams) *attacher {
	a := &attacher{
		log: p.Log, cfg: p.Config, pinDir: string(p.PinDir), maps: p.Maps, root: p.Root, ops: p.Ops,
		ipcache: p.IPCache, opened: p.Opened, attached: make(chan struct{}),
		dns: p.DNSMaps,
	}
	p.Jobs.Add(job.OneShot("attach", a.run, job.WithRetry(-1, attachRetry())))
	// The socket LB attached after the policy programs: back behind it at
	// once, before its first connection can be judged on a service
	// address.
	p.Root.OnAttach(func() {
		if err := a.keepLast(); err != nil {
			a.log.Error("Policy programs may run before the socket load balancer", "error", err)
		}
	})
	// The links stay pinned (and attached); only this process's handles
	// go.
	p.Lifecycle.Append(cell.Hook{OnStop: func(cell.HookContext) error { a.close(); return nil }})
	return a
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
	own, err := reconcilers.OpenPolicyProgMaps(a.log, a.maps, a.pinDir, sockSpec, eventBudgetEndpoints)
	if err != nil {
		return "", err
	}
	closeMaps := own.Close
	ownMaps, err := own.Programs()
	if err != nil {
		closeMaps()
		return "", err
	}
	dns, err := a.dns.Programs()
	if err != nil {
		closeMaps()
		return "", err
	}
	var progs map[string]*ebpf.Program
	endpointsGen := a.ops.EndpointsGen()
	err = a.ops.Maps(func(policy, endpoints *ebpf.Map) error {
		return a.ipcache.WithMap(func(ipc, prefixes *ebpf.Map) error {
			progs, err = policyprog.Load(policyprog.Maps{
				Policy: policy, Endpoints: endpoints, EndpointsGen: endpointsGen, Sock: ownMaps.Sock, Stats: ownMaps.Stats, IPCache: ipc, Prefixes: prefixes,
				Events: ownMaps.Events, Budget: policyprog.EventBudget{Map: ownMaps.Budget},
				DNSSock: dns.Sock, DNSOrigin: dns.Origin, DNSConfig: dns.Config, DNSOriginLost: dns.OriginLost,
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
	a.links, a.progs, a.own = links, progs, own
	a.mu.Unlock()
	// The shared flow LRU of earlier versions: no program uses it now.
	if err := a.maps.RemoveMap(a.pinDir, bpf.PolicyFlowsMap); err != nil {
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
	ifaces, err := detachIfaces(a.maps, a.pinDir)
	if err != nil {
		return "", err
	}
	if len(ifaces) > 0 {
		gone = append(gone, fmt.Sprintf("%d pod interface links", len(ifaces)))
	}
	pins := append([]string{bpf.PolicyFlowsMap}, reconcilers.PolicyProgMapsPinned...)
	for _, name := range append(pins, bpf.DNSOriginMap, bpf.DNSConfigMap, bpf.DNSOriginLostMap) {
		if err := a.maps.RemoveMap(a.pinDir, name); err != nil {
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
	if a.own != nil {
		a.own.Close()
		a.own = nil
	}
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
	if a.own == nil {
		return nil, errors.New("policy_events not open")
	}
	maps, err := a.own.Programs()
	if err != nil {
		return nil, err
	}
	rd, err := ringbuf.NewReader(maps.Events)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", bpf.PolicyEventsMap, err)
	}
	return rd, nil
}

// sharedMaps returns the maps the interface programs share with the
// socket-level ones (policy_events, policy_stats, policy_event_budget),
// once those are attached.
func (a *attacher) sharedMaps() (reconcilers.PolicyProgramMaps, error) {
	select {
	case <-a.attached:
	default:
		return reconcilers.PolicyProgramMaps{}, errors.New("the socket-level policy programs are not attached yet")
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.own == nil {
		return reconcilers.PolicyProgramMaps{}, errors.New("policy_events and policy_stats are not open")
	}
	return a.own.Programs()
}

// eventBudgetEndpoints sizes policy_event_budget: an endpoint beyond it
// (more than a node has) emits unbounded.
const eventBudgetEndpoints = 65536

// budgetLost returns how many events the endpoints lost to their budgets
// of policy_events, by endpoint ID (summed over CPUs).
func (a *attacher) budgetLost() map[uint32]uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.own == nil {
		return map[uint32]uint64{}
	}
	return a.own.BudgetLost()
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
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.own == nil {
		return [bpf.PolicyStatsEntries]uint64{}, nil
	}
	return a.own.Verdicts()
}
