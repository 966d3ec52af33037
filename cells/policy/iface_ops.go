package policy

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vishvananda/netlink"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/iflink"
	"github.com/apiary-net/apiary/bpf/podiface"
	"github.com/apiary-net/apiary/bpf/policyprog"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/policy/podifaces"
	"github.com/apiary-net/apiary/internal/podnet"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// IfaceLinksDir is the subdirectory of LinksDir holding the pinned tcx
// links of pod interfaces, two per interface: "<ifindex>_from_pod" and
// "<ifindex>_to_pod".
const IfaceLinksDir = "ifaces"

// ifaceOps reconciles the pod-interfaces table: each row with an interface
// gets its policy_ifaces entry, a flow map of its own in
// policy_iface_flows, and the interface programs attached to its host side
// through pinned tcx links. It is the only writer of these maps (besides
// apiary-cni's pending entries) and links; the map operations are
// reconcilers.PolicyIfaces'.
type ifaceOps struct {
	log     *slog.Logger
	cfg     Config
	pinDir  string
	mode    iflink.Mode
	a       *attacher
	policy  *reconcilers.Policy
	ipcache ipcache.Map
	maps    *reconcilers.PolicyIfaces

	mu    sync.Mutex
	progs map[string]*ebpf.Program
	// attached is the interface each endpoint's links are on, as this
	// process attached or found them.
	attached map[string]int
}

func (o *ifaceOps) linksDir() string {
	return filepath.Join(o.pinDir, LinksDir, IfaceLinksDir)
}

// hookOf is where prog goes on the host side of interface ifindex:
// FromPod on its ingress, ToPod on its egress.
func hookOf(ifindex int, prog string) iflink.Hook {
	return iflink.Hook{Ifindex: ifindex, Egress: prog == policyprog.ToPod}
}

// pin is the same path apiary-cni pins its links at, so that each adopts
// the other's.
func (o *ifaceOps) pin(ifindex int, prog string) string {
	return podiface.LinkPin(o.pinDir, ifindex, prog)
}

func pinSuffix(prog string) string { return podiface.PinSuffix(prog) }

// load opens the maps and loads the programs, once the socket-level
// programs (whose events and stats maps these share) are attached.
func (o *ifaceOps) load() error {
	if o.progs != nil {
		return nil
	}
	shared, err := o.a.sharedMaps()
	if err != nil {
		return err
	}
	if err := o.maps.Open(); err != nil {
		return err
	}
	own, err := o.maps.Programs()
	if err != nil {
		return err
	}
	dns, err := o.a.dns.Programs()
	if err != nil {
		return err
	}
	var progs map[string]*ebpf.Program
	err = o.policy.Maps(func(policy, endpoints *ebpf.Map) error {
		return o.ipcache.WithMap(func(ipc, prefixes *ebpf.Map) error {
			progs, err = policyprog.LoadInterface(policyprog.InterfaceMaps{
				Policy: policy, Endpoints: endpoints, Stats: shared.Stats, IPCache: ipc, Prefixes: prefixes, Events: shared.Events,
				Budget: policyprog.EventBudget{Map: shared.Budget},
				Ifaces: own.Ifaces, Flows: own.Flows, Frags: own.Frags, IfaceStats: own.Stats,
				DNSConfig: dns.Config,
			})
			return err
		})
	})
	if err != nil {
		return err
	}
	if err := os.MkdirAll(o.linksDir(), 0o750); err != nil {
		closePrograms(progs)
		return fmt.Errorf("links directory: %w", err)
	}
	o.progs = progs
	return nil
}

// Update implements reconciler.Operations.
func (o *ifaceOps) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, row *tables.PodInterface) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if old := o.attached[row.Name]; old != 0 && old != row.Ifindex {
		if err := o.releaseLocked(old); err != nil {
			return err
		}
		delete(o.attached, row.Name)
	}
	if row.Ifindex == 0 {
		return nil
	}
	if err := o.load(); err != nil {
		return err
	}
	addrErr, err := o.writeEntry(row)
	if err != nil {
		return err
	}
	fresh := false
	for _, prog := range []string{policyprog.FromPod, policyprog.ToPod} {
		outcome, err := iflink.Attach(o.pin(row.Ifindex, prog), hookOf(row.Ifindex, prog), o.progs[prog], o.mode)
		if err != nil {
			return fmt.Errorf("%s on %s: %w", prog, row.Interface, err)
		}
		fresh = fresh || outcome == iflink.Attached
	}
	if err := o.ensureFlows(row, fresh); err != nil {
		return err
	}
	o.attached[row.Name] = row.Ifindex
	return addrErr
}

// writeEntry writes the policy_ifaces entry of row's interface, over a
// different one (apiary-cni's pending entry among them). The error
// returned first is about the pod's addresses, after the entry was
// written without them (fail closed: the pod may send from none).
func (o *ifaceOps) writeEntry(row *tables.PodInterface) (addrErr, err error) {
	flags := uint32(0)
	if o.cfg.UnclassifiedPods == UnclassifiedDeny {
		flags |= bpf.PolicyIfaceUnclassifiedDeny
	}
	value, addrErr := bpf.NewPolicyIfaceValue(row.CgroupID, flags, row.Addrs)
	if addrErr != nil {
		value, _ = bpf.NewPolicyIfaceValue(row.CgroupID, flags, nil)
		addrErr = fmt.Errorf("the pod's addresses: %w; it may send from none", addrErr)
	}
	// The kernel's view of the pod's TCP connections (policy.c,
	// pod_connection) is asked in the namespace the host side's link
	// names, which the pod cannot change; without it, none is asked.
	value.SetNetns(podNetnsID(row.Ifindex))
	if err := o.maps.Put(row.Ifindex, value); err != nil {
		return nil, err
	}
	return addrErr, nil
}

// ensureFlows gives row's interface its flow and fragment maps: new ones
// when fresh. A new attachment is a new interface (or a new pod on a
// reused index): it starts with no flows and no fragments; links that were
// there already (an agent restart) keep theirs. Links apiary-cni made are
// not fresh, but the plugin removed the state of an index it took over.
func (o *ifaceOps) ensureFlows(row *tables.PodInterface, fresh bool) error {
	if err := o.maps.EnsureState(row.Ifindex, fresh); err != nil {
		return fmt.Errorf("%s: %w", row.Interface, err)
	}
	return nil
}

// adoptPending writes the pod's own entry over a pending one apiary-cni
// wrote after this agent had attached the pod's interface (the plugin
// and the agent raced on a new pod): without it the pod would stay
// denied until its row changed.
func (o *ifaceOps) adoptPending(row *tables.PodInterface) error {
	if row.Ifindex == 0 || o.attached[row.Name] != row.Ifindex || !o.maps.Pending(row.Ifindex) {
		return nil
	}
	o.log.Info("Pod interface: replacing the entry apiary-cni wrote", "endpoint", row.Name, "ifindex", row.Ifindex)
	if _, err := o.writeEntry(row); err != nil {
		return err
	}
	return o.ensureFlows(row, false)
}

// podNetnsID returns the id, in the host's network namespace, of the
// namespace at the other end of the host interface ifindex (its
// IFLA_LINK_NETNSID, which the kernel assigns when asked), or -1 when it
// has none: the interface is not a veth to another namespace.
func podNetnsID(ifindex int) int {
	link, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return -1
	}
	return link.Attrs().NetNsID
}

// Delete implements reconciler.Operations.
func (o *ifaceOps) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, row *tables.PodInterface) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	ifindex := o.attached[row.Name]
	if ifindex == 0 {
		ifindex = row.Ifindex
	}
	if ifindex == 0 {
		return nil
	}
	if err := o.releaseLocked(ifindex); err != nil {
		return err
	}
	delete(o.attached, row.Name)
	return nil
}

// releaseLocked is called when no pod is given interface ifindex any
// more: it detaches the programs and deletes the entries only if the
// interface is gone. An interface that still exists keeps them, its entry
// naming the pod's cgroup, which no endpoint has any more: the programs
// deny its packets as unclassified (--unclassified-pods=deny), as the
// chained CNI plugin's deny-until-classified program would; Prune removes
// them when the interface goes. Never detach an interface that exists
// only because the agent cannot attribute it: a pod could make that
// happen (unshare -n).
func (o *ifaceOps) releaseLocked(ifindex int) error {
	if hostInterfaceExists(ifindex) {
		return nil
	}
	return o.removeLocked(ifindex)
}

// removeLocked detaches the programs of interface ifindex and deletes its
// entries.
func (o *ifaceOps) removeLocked(ifindex int) error {
	var errs []error
	for _, prog := range []string{policyprog.FromPod, policyprog.ToPod} {
		if err := iflink.Detach(o.pin(ifindex, prog), hookOf(ifindex, prog)); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, o.maps.Remove(ifindex))
	return errors.Join(errs...)
}

// Prune implements reconciler.Operations. It removes only what belongs to
// no interface of the host any more (pinned links of deleted interfaces,
// their entries): an interface of a pod not listed yet (the endpoints are
// still being found after a restart) keeps its programs.
func (o *ifaceOps) Prune(_ context.Context, _ statedb.ReadTxn, rows iter.Seq2[*tables.PodInterface, statedb.Revision]) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	want := map[int]bool{}
	var errs []error
	for row := range rows {
		if row.Ifindex != 0 {
			want[row.Ifindex] = true
			errs = append(errs, o.adoptPending(row))
		}
	}
	entries, err := os.ReadDir(o.linksDir())
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	stale := map[int]bool{}
	for _, e := range entries {
		idx, _, ok := strings.Cut(e.Name(), "_")
		ifindex, err := strconv.Atoi(idx)
		if !ok || err != nil || want[ifindex] {
			continue
		}
		prog := policyprog.FromPod
		if strings.HasSuffix(e.Name(), pinSuffix(policyprog.ToPod)) {
			prog = policyprog.ToPod
		}
		if !hostInterfaceExists(ifindex) || !iflink.Live(filepath.Join(o.linksDir(), e.Name()), hookOf(ifindex, prog)) {
			stale[ifindex] = true
		}
	}
	listed, err := o.maps.Interfaces()
	errs = append(errs, err)
	for _, ifindex := range listed {
		if !want[ifindex] && !hostInterfaceExists(ifindex) {
			stale[ifindex] = true
		}
	}
	for ifindex := range stale {
		o.log.Info("Removing the programs of a pod interface that is gone", "ifindex", ifindex)
		errs = append(errs, o.removeLocked(ifindex))
	}
	return errors.Join(errs...)
}

func hostInterfaceExists(ifindex int) bool {
	_, err := netlink.LinkByIndex(ifindex)
	return err == nil
}

// detachIfaces removes the interface programs from every pod interface
// (pinned tcx links, and tc filters on the interfaces policy_ifaces lists)
// and the maps only they use: --enable-policy=never, or
// --policy-pod-interfaces=false.
func detachIfaces(opener bpf.Opener, pinDir string) ([]string, error) {
	dir := filepath.Join(pinDir, LinksDir, IfaceLinksDir)
	var gone []string
	var errs []error
	done := map[int]bool{}
	detach := func(ifindex int) {
		if done[ifindex] {
			return
		}
		done[ifindex] = true
		for _, prog := range []string{policyprog.FromPod, policyprog.ToPod} {
			pin := filepath.Join(dir, strconv.Itoa(ifindex)+pinSuffix(prog))
			if !iflink.Live(pin, hookOf(ifindex, prog)) {
				errs = append(errs, os.Remove(pin))
				continue
			}
			if err := iflink.Detach(pin, hookOf(ifindex, prog)); err != nil {
				errs = append(errs, err)
				continue
			}
			gone = append(gone, strconv.Itoa(ifindex)+pinSuffix(prog))
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	for _, e := range entries {
		idx, _, _ := strings.Cut(e.Name(), "_")
		if ifindex, err := strconv.Atoi(idx); err == nil {
			detach(ifindex)
		}
	}
	// What can be read: an unreadable map must not keep its pin (and
	// the other pins) from going.
	listed, _ := reconcilers.PinnedPolicyInterfaces(opener, pinDir)
	for _, ifindex := range listed {
		detach(ifindex)
	}
	for i, err := range errs {
		if errors.Is(err, os.ErrNotExist) {
			errs[i] = nil
		}
	}
	errs = append(errs, unpinPrograms(pinDir))
	for _, name := range reconcilers.PolicyIfacesPinned {
		errs = append(errs, opener.RemoveMap(pinDir, name))
	}
	return gone, errors.Join(errs...)
}

// close drops this process's handles; the pinned links stay attached.
func (o *ifaceOps) close() {
	o.mu.Lock()
	defer o.mu.Unlock()
	closePrograms(o.progs)
	o.progs = nil
	o.maps.Close()
}

type podIfaceParams struct {
	cell.In

	Jobs             job.Group
	Lifecycle        cell.Lifecycle
	Registry         prometheus.Registerer
	DB               *statedb.DB
	ReconcilerParams reconciler.Params
	PodEndpoints     statedb.Table[*tables.Endpoint]
	Interfaces       statedb.RWTable[*tables.PodInterface]
	Attacher         *attacher
}

// registerPodInterfaces starts packet-level enforcement on pods'
// interfaces (--policy-pod-interfaces): the discovery of their interfaces
// (podifaces), the reconciler that attaches the interface programs and
// writes their maps, and the programs pinned for apiary-cni; or removes
// what an earlier run attached when it is off.
func registerPodInterfaces(p podIfaceParams) error {
	a := p.Attacher
	switch {
	case a.cfg.EnablePolicy == ModeNever:
		return nil // the attacher detaches everything
	case !a.cfg.PolicyPodInterfaces:
		p.Jobs.Add(job.OneShot("pod-interfaces-off", func(context.Context, cell.Health) error {
			gone, err := detachIfaces(a.maps, a.pinDir)
			if len(gone) > 0 {
				a.log.Info("Packet-level enforcement off (--"+PodInterfacesFlag+"=false): detached", "links", gone)
			}
			return err
		}))
		return nil
	}
	finder, err := podnet.NewFinder()
	if err != nil {
		return fmt.Errorf("pod interfaces: %w", err)
	}
	d := podifaces.NewDiscovery(a.log, p.DB, a.root, p.PodEndpoints, p.Interfaces, finder)
	p.Jobs.Add(job.OneShot("pod-interfaces", d.Run))
	ops := &ifaceOps{
		log: a.log, cfg: a.cfg, pinDir: a.pinDir, mode: iflink.Mode(a.cfg.PolicyInterfaceAttach),
		a: a, policy: a.ops, ipcache: a.ipcache,
		maps:     reconcilers.NewPolicyIfaces(a.log, a.maps, a.pinDir, endpointsMax, a.cfg.PolicyInterfaceFlows),
		attached: map[string]int{},
	}
	p.Jobs.Add(job.OneShot("pod-interface-programs", ops.publish, job.WithRetry(-1, attachRetry())))
	if err := registerIfaceReconciler(p.ReconcilerParams, ops, p.Interfaces); err != nil {
		return err
	}
	p.Lifecycle.Append(cell.Hook{OnStop: func(cell.HookContext) error { ops.close(); return nil }})
	return p.Registry.Register(newDecisionsCollector("interface_",
		"Decisions of the programs on pods' interfaces (packets of flows they do not know yet), by direction and verdict; counted in the datapath",
		func() ([]uint64, error) { c, err := ops.maps.Stats(); return c[:], err },
		&dropsDesc{
			help: "Packets dropped on pods' interfaces whatever the policy: reason spoofed (a source not the pod's own), not-ip (neither IP nor ARP), unparsable (IP whose headers cannot be read to the ports) or fragment-unknown (a later fragment whose first one the interface does not know: denied, or pushed out by the pod's newer ones)",
			reasons: map[int]string{
				bpf.PolicyIfaceStatsSpoofed: "spoofed", bpf.PolicyIfaceStatsNotIP: "not-ip",
				bpf.PolicyIfaceStatsUnparsable: "unparsable", bpf.PolicyIfaceStatsFragUnknown: "fragment-unknown",
			},
		}))
}

// registerIfaceReconciler registers the reconciler of the pod-interfaces
// table.
func registerIfaceReconciler(params reconciler.Params, ops *ifaceOps, table statedb.RWTable[*tables.PodInterface]) error {
	_, err := reconciler.Register(params, table,
		(*tables.PodInterface).Clone, (*tables.PodInterface).SetStatus, (*tables.PodInterface).GetStatus,
		ops, nil, reconciler.WithRefreshing(0, nil), reconciler.WithPruning(podifaces.RescanInterval))
	if err != nil {
		return fmt.Errorf("register %s reconciler: %w", tables.PodInterfacesTableName, err)
	}
	return nil
}
