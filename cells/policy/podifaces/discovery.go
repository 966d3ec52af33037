// Package podifaces finds the host side of each local pod's veth (through
// the network namespaces of the processes in its cgroup) and keeps the
// pod-interfaces table, on which the policy cell reconciles the interface
// programs and their maps. A pod whose interface cannot be found fails
// closed. See docs/policy.md#socket-level-and-packet-level.
package podifaces

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/vishvananda/netlink"

	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/internal/podnet"
	"github.com/apiary-net/apiary/tables"
)

// RescanInterval is how often the interfaces of every pod are looked
// for again, besides when an endpoint or a host interface changes: a pod's
// first process may start after both.
const RescanInterval = 10 * time.Second

// Finder finds a pod's veths: podnet.Finder, or a test's.
type Finder interface {
	Find(cgroupDir string, addrs []netip.Addr) ([]podnet.HostVeth, error)
}

// NewDiscovery returns the discovery that keeps interfaces (the table it
// alone writes) from the endpoints whose cgroups are below root.
func NewDiscovery(log *slog.Logger, db *statedb.DB, root cgroups.Root, endpoints statedb.Table[*tables.Endpoint],
	interfaces statedb.RWTable[*tables.PodInterface], finder Finder) *Discovery {
	return &Discovery{log: log, db: db, root: root, endpoints: endpoints, interfaces: interfaces, finder: finder}
}

// Discovery keeps the pod-interfaces table: for each endpoint with a
// cgroup and a network namespace of its own, the host side of its veth.
//
// An interface given to a pod stays the pod's until the endpoint is gone
// or the interface is (or the endpoint's cgroup changes): a later scan
// that finds nothing, fails, or finds another candidate never takes it
// away, so that nothing a pod does in its namespaces (unshare -n, a
// crafted veth pair) moves enforcement off its interface. An interface
// held by one pod is never given to another.
type Discovery struct {
	log        *slog.Logger
	db         *statedb.DB
	root       cgroups.Root
	endpoints  statedb.Table[*tables.Endpoint]
	interfaces statedb.RWTable[*tables.PodInterface]
	finder     Finder

	// found is what Find returned for each endpoint, by name, when it
	// found veths, the host's namespace or no process yet: a rescan for a
	// change of other endpoints does not look again at those whose rows
	// are unchanged (each pod's processes and namespace, for a label
	// change of one of them). A full rescan does, as a pod's veth comes
	// with a link event. Other errors are retried at every scan.
	found map[string]ifaceFound
	// held is the interface each endpoint was given, by name: read from
	// the table's rows at the start of each scan (the table is the
	// record; this job its only writer), then what the scan gives.
	held map[string]heldIface
	// disagree is the last disagreement of Find with an endpoint's held
	// interface that was logged, so that it is logged once.
	disagree map[string]string
}

// ifaceFound is the result of Find for an endpoint's row.
type ifaceFound struct {
	revision statedb.Revision
	veths    []podnet.HostVeth
	hostNet  bool
	err      string // ErrNoProcess's
}

// heldIface is the interface an endpoint was given.
type heldIface struct {
	cgroupID uint64
	veth     podnet.HostVeth
}

// ifaceScan is what a scan found: how many rows have an interface, how
// many not, and the endpoints denied for want of one (fail closed), with
// why.
type ifaceScan struct {
	found, missing int
	failClosed     map[string]string
}

// Run rescans when the endpoints change, when a host interface comes or
// goes (a pod's veth), and every RescanInterval.
func (d *Discovery) Run(ctx context.Context, health cell.Health) error {
	links := make(chan netlink.LinkUpdate, 64)
	linkDone := make(chan struct{})
	defer close(linkDone)
	linkEvents := links
	if err := netlink.LinkSubscribeWithOptions(links, linkDone, netlink.LinkSubscribeOptions{
		ErrorCallback: func(err error) {
			if ctx.Err() == nil {
				d.log.Warn("Host interface events", "error", err)
			}
		},
	}); err != nil {
		d.log.Warn("Cannot follow the host's interfaces; looking for pods' interfaces periodically only", "error", err)
		linkEvents = nil
	}
	ticker := time.NewTicker(RescanInterval)
	defer ticker.Stop()
	full := true
	for {
		_, watch := d.endpoints.AllWatch(d.db.ReadTxn())
		res := d.scan(full)
		if len(res.failClosed) == 0 {
			health.OK(formatIfaceHealth(res))
		} else {
			first := slices.Min(slices.Collect(maps.Keys(res.failClosed)))
			health.Degraded(formatIfaceHealth(res), fmt.Errorf("%s: %s", first, res.failClosed[first]))
		}
		full = false
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		case _, ok := <-linkEvents:
			if !ok {
				linkEvents = nil
			}
			// A veth comes with its peer and addresses in a burst.
			drain(linkEvents)
			full = true
		case <-ticker.C:
			full = true
		}
	}
}

func drain(ch <-chan netlink.LinkUpdate) {
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		default:
			return
		}
	}
}

func formatIfaceHealth(res ifaceScan) string {
	msg := "Enforcing on " + strconv.Itoa(res.found) + " pod interfaces"
	if res.missing > 0 {
		msg += "; " + strconv.Itoa(res.missing) + " pods without one yet (see " + tables.PodInterfacesTableName + ")"
	}
	if len(res.failClosed) > 0 {
		names := slices.Sorted(maps.Keys(res.failClosed))
		msg += "; failing closed (denied both ways) on " + strconv.Itoa(len(names)) + " pods whose interface cannot be found: " + strings.Join(names, ", ")
	}
	return msg
}

// failClosedSuffix ends the row error of an endpoint denied for want of
// an interface.
const failClosedSuffix = "; denied both ways until its interface is found (fail closed)"

// scan updates the table from the endpoints. full looks for every
// endpoint's interface again; otherwise only for the endpoints not found
// before or whose rows changed.
func (d *Discovery) scan(full bool) ifaceScan {
	rtxn := d.db.ReadTxn()
	if full || d.found == nil {
		d.found = map[string]ifaceFound{}
	}
	if d.disagree == nil {
		d.disagree = map[string]string{}
	}
	d.held = map[string]heldIface{}
	for row := range d.interfaces.All(rtxn) {
		if row.Ifindex != 0 {
			d.held[row.Name] = heldIface{cgroupID: row.CgroupID,
				veth: podnet.HostVeth{Name: row.Interface, Ifindex: row.Ifindex, Netns: row.Netns}}
		}
	}
	type pod struct {
		ep *tables.Endpoint
		f  ifaceFound
		// failErr: Find failed otherwise than with no process yet or the
		// host's namespace.
		failErr string
	}
	var pods []pod
	for ep, rev := range d.endpoints.All(rtxn) {
		if ep.HostNetwork || ep.CgroupID == 0 {
			continue
		}
		p := pod{ep: ep}
		f, ok := d.found[ep.Name]
		if !ok || f.revision != rev {
			veths, err := d.finder.Find(filepath.Join(d.root.Path(), ep.Cgroup), ep.IPs)
			switch {
			case errors.Is(err, podnet.ErrHostNetwork):
				f = ifaceFound{revision: rev, hostNet: true}
			case errors.Is(err, podnet.ErrNoProcess):
				f = ifaceFound{revision: rev, err: err.Error()}
			case err != nil:
				delete(d.found, ep.Name)
				p.failErr = err.Error()
			default:
				f = ifaceFound{revision: rev, veths: veths}
			}
			if p.failErr == "" {
				d.found[ep.Name] = f
			}
		}
		p.f = f
		pods = append(pods, p)
	}
	cgroupIDs := make(map[string]uint64, len(pods))
	for _, p := range pods {
		cgroupIDs[p.ep.Name] = p.ep.CgroupID
	}
	d.forgetHeld(cgroupIDs)
	owner := map[int]string{}
	for name, h := range d.held {
		owner[h.veth.Ifindex] = name
	}
	// Pods that hold an interface first, then those whose best candidate
	// carries their address: when two pods claim one interface in one
	// scan, the one the host routes to through it gets it.
	rank := func(p pod) int {
		switch {
		case d.held[p.ep.Name] != heldIface{}:
			return 0
		case len(p.f.veths) > 0 && p.f.veths[0].CarriesAddr:
			return 1
		}
		return 2
	}
	slices.SortStableFunc(pods, func(a, b pod) int { return cmp.Compare(rank(a), rank(b)) })

	res := ifaceScan{failClosed: map[string]string{}}
	want := map[string]*tables.PodInterface{}
	for _, p := range pods {
		ep := p.ep
		row := &tables.PodInterface{
			Name: ep.Name, CgroupID: ep.CgroupID, Addrs: slices.Clone(ep.IPs), Status: reconciler.StatusPending(),
		}
		if h, ok := d.held[ep.Name]; ok {
			d.noteDisagreement(ep.Name, h, p.f, p.failErr)
			row.Interface, row.Ifindex, row.Netns = h.veth.Name, h.veth.Ifindex, h.veth.Netns
			res.found++
			want[row.Name] = row
			continue
		}
		switch {
		case p.f.hostNet:
			// The host's: the socket hooks are all there is.
			continue
		case p.failErr != "":
			row.Error = p.failErr
		case p.f.err != "":
			// No process: nothing to deny yet.
			row.Error = p.f.err
			res.missing++
			want[row.Name] = row
			continue
		default:
			row.Error = d.give(row, p.f.veths, owner)
		}
		if row.Error != "" {
			row.Error += failClosedSuffix
			row.FailClosed = true
			res.failClosed[row.Name] = row.Error
			res.missing++
		} else {
			res.found++
		}
		want[row.Name] = row
	}
	d.write(want)
	return res
}

// forgetHeld drops the held interfaces of endpoints that are gone (or
// whose cgroup changed: another pod by the same name) and of interfaces
// that are gone. An interface that cannot be listed is kept.
func (d *Discovery) forgetHeld(cgroups map[string]uint64) {
	for name, h := range d.held {
		if cg, ok := cgroups[name]; !ok || cg != h.cgroupID {
			delete(d.held, name)
			delete(d.disagree, name)
		}
	}
	if len(d.held) == 0 {
		return
	}
	links, err := netlink.LinkList()
	if err != nil {
		d.log.Warn("List the host's interfaces; pods keep their interfaces", "error", err)
		return
	}
	names := make(map[int]string, len(links))
	for _, l := range links {
		names[l.Attrs().Index] = l.Attrs().Name
	}
	for name, h := range d.held {
		if got, ok := names[h.veth.Ifindex]; !ok || got != h.veth.Name {
			d.log.Info("Pod interface gone", "endpoint", name, "interface", h.veth.Name, "ifindex", h.veth.Ifindex)
			delete(d.held, name)
			delete(d.disagree, name)
		}
	}
}

// give gives row the best of veths no other pod holds, and returns why
// none could be given ("" when one was).
func (d *Discovery) give(row *tables.PodInterface, veths []podnet.HostVeth, owner map[int]string) string {
	var taken []string
	for _, v := range veths {
		if o := owner[v.Ifindex]; o != "" && o != row.Name {
			taken = append(taken, v.Name+" ("+strconv.Itoa(v.Ifindex)+") is "+o+"'s")
			continue
		}
		d.held[row.Name] = heldIface{cgroupID: row.CgroupID, veth: v}
		owner[v.Ifindex] = row.Name
		row.Interface, row.Ifindex, row.Netns = v.Name, v.Ifindex, v.Netns
		return ""
	}
	return "interface conflict: " + strings.Join(taken, ", ") + ", which had it first"
}

// noteDisagreement logs, once, that Find says other than an endpoint's
// held interface: the pod changed its namespaces (or the interface went
// and the link event is on its way). The held interface stays.
func (d *Discovery) noteDisagreement(name string, h heldIface, f ifaceFound, failErr string) {
	var says string
	switch {
	case failErr != "":
		says = failErr
	case f.hostNet:
		says = podnet.ErrHostNetwork.Error()
	case f.err != "":
		says = f.err
	case !slices.ContainsFunc(f.veths, func(v podnet.HostVeth) bool { return v.Ifindex == h.veth.Ifindex }):
		says = "other interfaces: " + f.veths[0].Name
	}
	if says == d.disagree[name] {
		return
	}
	d.disagree[name] = says
	if says != "" {
		d.log.Warn("A pod's namespaces no longer show its interface; it keeps it until the pod or the interface is gone",
			"endpoint", name, "interface", h.veth.Name, "ifindex", h.veth.Ifindex, "found", says)
	}
}

// write makes the table what want says.
func (d *Discovery) write(want map[string]*tables.PodInterface) {
	wtxn := d.db.WriteTxn(d.interfaces)
	defer wtxn.Abort()
	for old := range d.interfaces.All(wtxn) {
		if _, ok := want[old.Name]; !ok {
			if _, _, err := d.interfaces.Delete(wtxn, old); err != nil {
				d.log.Error("Delete a pod interface row", "endpoint", old.Name, "error", err)
			}
		}
	}
	for _, row := range want {
		old, _, ok := d.interfaces.Get(wtxn, tables.PodInterfaceNameIndex.Query(row.Name))
		if ok && sameInterface(old, row) {
			continue
		}
		if row.Ifindex != 0 && (!ok || old.Ifindex != row.Ifindex) {
			d.log.Info("Pod interface", "endpoint", row.Name, "interface", row.Interface, "ifindex", row.Ifindex)
		}
		if row.FailClosed && (!ok || old.Error != row.Error) {
			d.log.Warn("No interface for a pod; denying it", "endpoint", row.Name, "error", row.Error)
		}
		if _, _, err := d.interfaces.Insert(wtxn, row); err != nil {
			d.log.Error("Write a pod interface row", "endpoint", row.Name, "error", err)
		}
	}
	wtxn.Commit()
}

// sameInterface tells whether a and b say the same, status aside.
func sameInterface(a, b *tables.PodInterface) bool {
	return a.CgroupID == b.CgroupID && a.Interface == b.Interface && a.Ifindex == b.Ifindex &&
		a.Netns == b.Netns && slices.Equal(a.Addrs, b.Addrs) && a.Error == b.Error && a.FailClosed == b.FailClosed
}
