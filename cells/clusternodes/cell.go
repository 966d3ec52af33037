// Package clusternodes follows the cluster's Node objects: the nodes table
// holds every node with its addresses, and the addresses of every node but
// this one are labelled reserved:remote-node (identity 6) in the prefixes
// table, so that policies can name them with the remote-node entity and
// traffic from another node's host is not taken for the world.
//
// The agent learns about other nodes only from their Node objects
// (status.addresses, InternalIP and ExternalIP), as every node shows them;
// see docs/kubernetes.md.
//
// A Node object is not trusted to speak for this node: an address another
// Node claims that is this node's own (--node-ips or the addresses found
// at start, or its own Node object's) or lies in one of this node's pod
// CIDRs is not labelled remote-node, so that a wrong or hostile Node
// cannot make this node's host or pods the remote-node entity. Such a
// conflict, and another Node's pod CIDR overlapping this node's, is
// logged and shown in the nodes table (Conflicts) and the module's health
// message until it is gone. Nor does a Node speak for a pod: where a pod
// owns an address a Node claims, the ipcache resolver keeps the pod's
// labels and drops the remote-node one (cells/ipcache, normalize).
package clusternodes

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"

	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the read-only nodes table and keeps it and the remote
// nodes' prefixes in step with the Node objects.
var Cell = cell.Module(
	"clusternodes",
	"Cluster nodes and the remote-node identity of their addresses",

	cell.ProvidePrivate(
		tables.NewNodesTable,
		func(p k8s.ResourceParams) k8s.Resource[*corev1.Node] { return k8s.NewResource(p, k8s.NodeKind) },
	),
	cell.Provide(statedb.RWTable[*tables.Node].ToTable),
	cell.Invoke(registerController),
)

type params struct {
	cell.In

	Log      *slog.Logger
	DB       *statedb.DB
	Jobs     job.Group
	Node     node.Config
	Table    statedb.RWTable[*tables.Node]
	Prefixes ipcache.Prefixes
	Nodes    k8s.Resource[*corev1.Node]
}

func registerController(p params) {
	// The ipcache map is not pruned of an earlier run's remote-node
	// entries before the nodes are known again.
	done := p.Prefixes.RegisterInitializer("nodes")
	wtxn := p.DB.WriteTxn(p.Table)
	markInit := p.Table.RegisterInitializer(wtxn, "nodes-synced")
	wtxn.Commit()
	c := &controller{params: p, known: map[string][]netip.Addr{}, remote: map[string]*corev1.Node{}, conflicts: map[string][]string{}}
	p.Jobs.Add(job.OneShot("nodes", func(ctx context.Context, h cell.Health) error {
		return c.run(ctx, h, func() {
			done()
			wtxn := p.DB.WriteTxn(p.Table)
			markInit(wtxn)
			wtxn.Commit()
		})
	}))
}

type controller struct {
	params
	// known are the remote nodes' labelled addresses.
	known map[string][]netip.Addr
	// remote are the other nodes' Node objects, judged again when this
	// node's own Node object changes.
	remote map[string]*corev1.Node
	// local is this node's Node object; nil until it is seen.
	local *corev1.Node
	// conflicts are what each remote node claims of this node's.
	conflicts map[string][]string
}

func (c *controller) run(ctx context.Context, h cell.Health, synced func()) error {
	h.OK("Waiting for the Node objects")
	initDone := false
	for ev := range c.Nodes.Events(ctx) {
		switch ev.Kind {
		case k8s.Sync:
			if !initDone {
				initDone = true
				synced()
			}
		case k8s.Upsert:
			if err := c.upsert(ev.Object); err != nil {
				h.Degraded("node "+ev.Key.Name, err)
				continue
			}
		case k8s.Delete:
			if err := c.delete(ev.Key.Name); err != nil {
				h.Degraded("node "+ev.Key.Name, err)
				continue
			}
		}
		if !initDone {
			continue
		}
		msg := fmt.Sprintf("%d nodes, %d remote", len(c.known)+c.localCount(), len(c.known))
		if conflicts := c.conflictsMsg(); conflicts != "" {
			// Reported, not degraded: /healthz is the DaemonSet's
			// liveness probe, and one Node object (which a node's own
			// kubelet writes) must not restart every agent; the claims
			// are already left out.
			msg += "; " + conflicts
		}
		h.OK(msg)
	}
	return nil
}

func (c *controller) localCount() int {
	if _, _, found := c.Table.Get(c.DB.ReadTxn(), tables.NodeNameIndex.Query(c.Node.NodeName)); found {
		return 1
	}
	return 0
}

// addresses returns the node's InternalIP and ExternalIP addresses of the
// families the agent runs, in the status's order, without repeats;
// hostnames and what does not parse are left out.
func addresses(n *corev1.Node, ipv6 bool) []netip.Addr {
	var out []netip.Addr
	for _, a := range n.Status.Addresses {
		if a.Type != corev1.NodeInternalIP && a.Type != corev1.NodeExternalIP {
			continue
		}
		ip, err := netip.ParseAddr(a.Address)
		if err != nil || ip.Zone() != "" {
			continue
		}
		ip = ip.Unmap()
		if (ip.Is6() && !ipv6) || !ip.IsGlobalUnicast() && !ip.IsPrivate() || slices.Contains(out, ip) {
			continue
		}
		out = append(out, ip)
	}
	return out
}

func (c *controller) upsert(n *corev1.Node) error {
	if n.Name == c.Node.NodeName {
		c.local = n
		if err := c.insertRow(&tables.Node{Name: n.Name, Local: true, Addresses: addresses(n, c.Node.EnableIPv6), Labels: maps.Clone(n.Labels)}); err != nil {
			return err
		}
		// What this node owns may have changed: judge the others again.
		var errs []error
		for _, name := range slices.Sorted(maps.Keys(c.remote)) {
			errs = append(errs, c.upsertRemote(c.remote[name]))
		}
		return errors.Join(errs...)
	}
	c.remote[n.Name] = n
	return c.upsertRemote(n)
}

// upsertRemote labels a remote node's addresses remote-node, less those
// that are this node's own or in its pod CIDRs.
func (c *controller) upsertRemote(n *corev1.Node) error {
	var addrs, conflicts = []netip.Addr(nil), []string(nil)
	for _, a := range addresses(n, c.Node.EnableIPv6) {
		if why := c.ownedHere(a); why != "" {
			conflicts = append(conflicts, fmt.Sprintf("%s is %s", a, why))
			continue
		}
		addrs = append(addrs, a)
	}
	conflicts = append(conflicts, c.podCIDRConflicts(n)...)
	if !slices.Equal(conflicts, c.conflicts[n.Name]) && len(conflicts) > 0 {
		c.Log.Warn("Node object claims what is this node's: not labelled remote-node",
			"node", n.Name, "conflicts", strings.Join(conflicts, "; "))
	}
	if len(conflicts) > 0 {
		c.conflicts[n.Name] = conflicts
	} else {
		delete(c.conflicts, n.Name)
	}
	owner := tables.RemoteNodeOwner(n.Name)
	var changes []ipcache.Change
	for _, old := range c.known[n.Name] {
		if !slices.Contains(addrs, old) {
			changes = append(changes, ipcache.Delete(netip.PrefixFrom(old, old.BitLen()), owner))
		}
	}
	for _, a := range addrs {
		changes = append(changes, ipcache.Upsert(netip.PrefixFrom(a, a.BitLen()), owner, tables.LabelRemoteNode))
	}
	if _, err := c.Prefixes.Update(changes...); err != nil {
		return fmt.Errorf("label the addresses of node %s remote-node: %w", n.Name, err)
	}
	c.known[n.Name] = addrs
	if len(addrs) == 0 && len(conflicts) == 0 {
		c.Log.Warn("Node has no InternalIP or ExternalIP address: its host is not known as remote-node", "node", n.Name)
	}
	return c.insertRow(&tables.Node{Name: n.Name, Addresses: addrs, Conflicts: conflicts, Labels: maps.Clone(n.Labels)})
}

// ownedHere says why a is this node's ("" when it is not): one of its
// addresses, or in one of its pod CIDRs.
func (c *controller) ownedHere(a netip.Addr) string {
	if slices.Contains(c.Node.NodeIPs, a) {
		return "this node's address"
	}
	if c.local == nil {
		return ""
	}
	if slices.Contains(addresses(c.local, true), a) {
		return "this node's address"
	}
	for _, p := range podCIDRs(c.local) {
		if p.Contains(a) {
			return "in this node's pod CIDR " + p.String()
		}
	}
	return ""
}

// podCIDRConflicts lists the pod CIDRs of n that overlap this node's.
// Nothing is labelled from pod CIDRs (pods are labelled by their own
// addresses); the overlap is reported because the underlying CNI cannot
// route both nodes' pods.
func (c *controller) podCIDRConflicts(n *corev1.Node) []string {
	if c.local == nil {
		return nil
	}
	var out []string
	for _, p := range podCIDRs(n) {
		for _, own := range podCIDRs(c.local) {
			if p.Overlaps(own) {
				out = append(out, fmt.Sprintf("pod CIDR %s overlaps this node's %s", p, own))
			}
		}
	}
	return out
}

// podCIDRs returns the node's spec.podCIDRs (or spec.podCIDR), those that
// parse.
func podCIDRs(n *corev1.Node) []netip.Prefix {
	raw := n.Spec.PodCIDRs
	if len(raw) == 0 && n.Spec.PodCIDR != "" {
		raw = []string{n.Spec.PodCIDR}
	}
	var out []netip.Prefix
	for _, r := range raw {
		if p, err := netip.ParsePrefix(r); err == nil {
			out = append(out, p.Masked())
		}
	}
	return out
}

// conflictsMsg is what the module's health says while any Node claims
// what is this node's ("" when none does).
func (c *controller) conflictsMsg() string {
	if len(c.conflicts) == 0 {
		return ""
	}
	var msgs []string
	for _, name := range slices.Sorted(maps.Keys(c.conflicts)) {
		msgs = append(msgs, fmt.Sprintf("node %s: %s", name, strings.Join(c.conflicts[name], "; ")))
	}
	return fmt.Sprintf("Node objects claim this node's addresses or pod CIDRs, not labelled remote-node: %s", strings.Join(msgs, "; "))
}

func (c *controller) insertRow(row *tables.Node) error {
	wtxn := c.DB.WriteTxn(c.Table)
	defer wtxn.Abort()
	if _, _, err := c.Table.Insert(wtxn, row); err != nil {
		return err
	}
	wtxn.Commit()
	return nil
}

func (c *controller) delete(name string) error {
	if name != c.Node.NodeName {
		if _, err := c.Prefixes.DeleteOwner(tables.RemoteNodeOwner(name)); err != nil {
			return fmt.Errorf("remove the addresses of node %s: %w", name, err)
		}
		delete(c.known, name)
		delete(c.remote, name)
		delete(c.conflicts, name)
	} else {
		c.local = nil
	}
	wtxn := c.DB.WriteTxn(c.Table)
	defer wtxn.Abort()
	if _, _, err := c.Table.Delete(wtxn, &tables.Node{Name: name}); err != nil {
		return err
	}
	wtxn.Commit()
	return nil
}
