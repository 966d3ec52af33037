// Package clusternodes follows the cluster's Node objects: the nodes table
// holds every node with its addresses, and the addresses of every node but
// this one are labelled reserved:remote-node (identity 6) in the prefixes
// table, so that policies can name them with the remote-node entity and
// traffic from another node's host is not taken for the world.
//
// The agent learns about other nodes only from their Node objects
// (status.addresses, InternalIP and ExternalIP), as every node shows them;
// see docs/kubernetes.md.
package clusternodes

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"

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
	c := &controller{params: p, known: map[string][]netip.Addr{}}
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
		if initDone {
			h.OK(fmt.Sprintf("%d nodes, %d remote", len(c.known)+c.localCount(), len(c.known)))
		}
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
	local := n.Name == c.Node.NodeName
	addrs := addresses(n, c.Node.EnableIPv6)
	if !local {
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
		if len(addrs) == 0 {
			c.Log.Warn("Node has no InternalIP or ExternalIP address: its host is not known as remote-node", "node", n.Name)
		}
	}
	wtxn := c.DB.WriteTxn(c.Table)
	defer wtxn.Abort()
	if _, _, err := c.Table.Insert(wtxn, &tables.Node{Name: n.Name, Local: local, Addresses: addrs}); err != nil {
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
	}
	wtxn := c.DB.WriteTxn(c.Table)
	defer wtxn.Abort()
	if _, _, err := c.Table.Delete(wtxn, &tables.Node{Name: name}); err != nil {
		return err
	}
	wtxn.Commit()
	return nil
}
