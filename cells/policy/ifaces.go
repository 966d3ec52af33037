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
	for {
		_, watch := d.endpoints.AllWatch(d.db.ReadTxn())
		found, missing := d.scan()
		health.OK(formatIfaceHealth(found, missing))
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
		case <-ticker.C:
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
// an interface, and how many not.
func (d *ifaceDiscovery) scan() (found, missing int) {
	rtxn := d.db.ReadTxn()
	want := map[string]*tables.PodInterface{}
	for ep := range d.endpoints.All(rtxn) {
		if ep.HostNetwork || ep.CgroupID == 0 {
			continue
		}
		row := &tables.PodInterface{
			Name: ep.Name, CgroupID: ep.CgroupID, Addrs: slices.Clone(ep.IPs), Status: reconciler.StatusPending(),
		}
		v, err := d.finder.Find(filepath.Join(d.root.Path(), ep.Cgroup))
		switch {
		case errors.Is(err, podnet.ErrHostNetwork):
			// The host's: the socket hooks are all there is.
			continue
		case err != nil:
			row.Error = err.Error()
			missing++
		default:
			row.Interface, row.Ifindex, row.Netns = v.Name, v.Ifindex, v.Netns
			found++
		}
		want[row.Name] = row
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
