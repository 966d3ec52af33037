package policy

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/vishvananda/netlink"

	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/internal/podnet"
	"github.com/apiary-net/apiary/tables"
)

// ifaceRescanInterval is how often the interfaces of every pod are looked
// for again, besides when an endpoint or a host interface changes: a pod's
// first process may start after both.
const ifaceRescanInterval = 10 * time.Second

// ifaceFinder is podnet.Finder, or a test's.
type ifaceFinder interface {
	Find(cgroupDir string) (podnet.HostVeth, error)
}

// ifaceDiscovery keeps the pod-interfaces table: for each endpoint with a
// cgroup and a network namespace of its own, the host side of its veth.
type ifaceDiscovery struct {
	log        *slog.Logger
	db         *statedb.DB
	root       cgroups.Root
	endpoints  statedb.Table[*tables.Endpoint]
	interfaces statedb.RWTable[*tables.PodInterface]
	finder     ifaceFinder

	// found is what Find returned for each endpoint, by name, when it
	// found a veth, the host's namespace or no process yet: a rescan for a
	// change of other endpoints does not look again at those whose rows
	// are unchanged (each pod's processes and namespace, for a label
	// change of one of them). A full rescan does, as a pod's veth comes
	// with a link event. Other errors are retried at every scan.
	found map[string]ifaceFound
}

// ifaceFound is the result of Find for an endpoint's row.
type ifaceFound struct {
	revision statedb.Revision
	veth     podnet.HostVeth
	hostNet  bool
	err      string // ErrNoProcess's
}

// run rescans when the endpoints change, when a host interface comes or
// goes (a pod's veth), and every ifaceRescanInterval.
func (d *ifaceDiscovery) run(ctx context.Context, health cell.Health) error {
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
	ticker := time.NewTicker(ifaceRescanInterval)
	defer ticker.Stop()
	full := true
	for {
		_, watch := d.endpoints.AllWatch(d.db.ReadTxn())
		found, missing := d.scan(full)
		health.OK(formatIfaceHealth(found, missing))
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

func formatIfaceHealth(found, missing int) string {
	if missing == 0 {
		return "Enforcing on " + strconv.Itoa(found) + " pod interfaces"
	}
	return "Enforcing on " + strconv.Itoa(found) + " pod interfaces; " + strconv.Itoa(missing) + " pods without one yet (see " + tables.PodInterfacesTableName + ")"
}

// scan updates the table from the endpoints; it returns how many rows have
// an interface, and how many not. full looks for every endpoint's
// interface again; otherwise only for the endpoints not found before or
// whose rows changed.
func (d *ifaceDiscovery) scan(full bool) (found, missing int) {
	rtxn := d.db.ReadTxn()
	if full || d.found == nil {
		d.found = map[string]ifaceFound{}
	}
	want := map[string]*tables.PodInterface{}
	seen := map[string]struct{}{}
	for ep, rev := range d.endpoints.All(rtxn) {
		if ep.HostNetwork || ep.CgroupID == 0 {
			continue
		}
		seen[ep.Name] = struct{}{}
		row := &tables.PodInterface{
			Name: ep.Name, CgroupID: ep.CgroupID, Addrs: slices.Clone(ep.IPs), Status: reconciler.StatusPending(),
		}
		f, ok := d.found[ep.Name]
		if !ok || f.revision != rev {
			v, err := d.finder.Find(filepath.Join(d.root.Path(), ep.Cgroup))
			switch {
			case errors.Is(err, podnet.ErrHostNetwork):
				f = ifaceFound{revision: rev, hostNet: true}
			case errors.Is(err, podnet.ErrNoProcess):
				f = ifaceFound{revision: rev, err: err.Error()}
			case err != nil:
				delete(d.found, ep.Name)
				row.Error = err.Error()
				missing++
				want[row.Name] = row
				continue
			default:
				f = ifaceFound{revision: rev, veth: v}
			}
			d.found[ep.Name] = f
		}
		switch {
		case f.hostNet:
			// The host's: the socket hooks are all there is.
			continue
		case f.err != "":
			row.Error = f.err
			missing++
			want[row.Name] = row
			continue
		}
		row.Interface, row.Ifindex, row.Netns = f.veth.Name, f.veth.Ifindex, f.veth.Netns
		found++
		want[row.Name] = row
	}
	for name := range d.found {
		if _, ok := seen[name]; !ok {
			delete(d.found, name)
		}
	}
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
		if _, _, err := d.interfaces.Insert(wtxn, row); err != nil {
			d.log.Error("Write a pod interface row", "endpoint", row.Name, "error", err)
		}
	}
	wtxn.Commit()
	return found, missing
}

// sameInterface tells whether a and b say the same, status aside.
func sameInterface(a, b *tables.PodInterface) bool {
	return a.CgroupID == b.CgroupID && a.Interface == b.Interface && a.Ifindex == b.Ifindex &&
		a.Netns == b.Netns && slices.Equal(a.Addrs, b.Addrs) && a.Error == b.Error
}
