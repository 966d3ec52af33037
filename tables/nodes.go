package tables

import (
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// NodesTableName is the statedb name of the table of the cluster's nodes.
const NodesTableName = "nodes"

// Node is one node of the cluster as its Node object shows it: its name
// and the addresses of its status (InternalIP and ExternalIP). The
// addresses of every node but this one carry reserved:remote-node in the
// prefixes table, under the owner RemoteNodeOwner(name).
type Node struct {
	// Name is the Node object's name.
	Name string `json:"name" yaml:"name"`
	// Local is true for this agent's own node (--node-name), whose
	// addresses are reserved:host, not remote-node.
	Local bool `json:"local" yaml:"local"`
	// Addresses are the node's InternalIP and ExternalIP addresses, in
	// the order of the Node's status, of the families the agent runs.
	Addresses []netip.Addr `json:"addresses" yaml:"addresses"`
	// Conflicts are what a remote node's object claims of this node's:
	// its addresses or addresses in its pod CIDRs (left out of Addresses,
	// not remote-node), pod CIDRs overlapping its own.
	Conflicts []string `json:"conflicts,omitempty" yaml:"conflicts,omitempty"`
	// Labels are the Node object's labels, which ClusterNetworkPolicy
	// nodes peers select by.
	Labels map[string]string `json:"labels,omitempty" yaml:"labels,omitempty"`
}

// RemoteNodeOwner returns the prefixes owner of a remote node's addresses,
// "remote-node/<name>".
func RemoteNodeOwner(name string) string { return "remote-node/" + name }

// NodesPeerOwner returns the prefixes owner of the nodes: labels a remote
// node's addresses get from the ClusterNetworkPolicy nodes peers that
// select it, "nodes-peer/<name>".
func NodesPeerOwner(name string) string { return "nodes-peer/" + name }

// TableHeader implements statedb.TableWritable.
func (*Node) TableHeader() []string {
	return []string{"Name", "Local", "Addresses", "Conflicts", "Labels"}
}

// TableRow implements statedb.TableWritable.
func (n *Node) TableRow() []string {
	addrs := make([]string, len(n.Addresses))
	for i, a := range n.Addresses {
		addrs[i] = a.String()
	}
	local := "no"
	if n.Local {
		local = "yes"
	}
	labels := make([]string, 0, len(n.Labels))
	for _, k := range slices.Sorted(maps.Keys(n.Labels)) {
		labels = append(labels, k+"="+n.Labels[k])
	}
	return []string{n.Name, local, strings.Join(addrs, ", "), strings.Join(n.Conflicts, "; "), strings.Join(labels, ", ")}
}

// NodeNameIndex is the primary index of the nodes table.
var NodeNameIndex = statedb.Index[*Node, string]{
	Name:       "name",
	FromObject: func(n *Node) index.KeySet { return index.NewKeySet(index.String(n.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewNodesTable registers the nodes table with db.
func NewNodesTable(db *statedb.DB) (statedb.RWTable[*Node], error) {
	return statedb.NewTable(db, NodesTableName, NodeNameIndex)
}
