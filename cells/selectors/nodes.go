package selectors

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"github.com/cilium/statedb"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/tables"
)

// NodePeer is the selector of a ClusterNetworkPolicy nodes peer: it
// selects the identities carrying its Label, "nodes:{<selector>}". The
// controller gives that label to the addresses of the remote nodes whose
// Node object's labels the selector matches (prefixes owner
// tables.NodesPeerOwner), which then get an identity of their own rather
// than remote-node's 6, and to the host identity (1) when this node's
// Node object matches. So the peer is exactly the selected nodes'
// addresses, and follows their labels.
type NodePeer struct {
	// Label is tables.NodesLabel of the selector's canonical text.
	Label string
	sel   labels.Selector
}

// ParseNodePeer returns the selector of a nodes peer: Kubernetes label
// selector semantics over the Node objects' labels; empty selects every
// node.
func ParseNodePeer(sel *metav1.LabelSelector) (*NodePeer, error) {
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		return nil, err
	}
	return &NodePeer{Label: tables.NodesLabel(s.String()), sel: s}, nil
}

// String implements Selector.
func (s *NodePeer) String() string { return s.Label }

// Matches implements Selector.
func (s *NodePeer) Matches(l tables.Labels) bool { return l.Has(s.Label) }

// selectsNode reports whether the peer selects a node with these labels.
func (s *NodePeer) selectsNode(nodeLabels map[string]string) bool {
	return s.sel.Matches(labels.Set(nodeLabels))
}

// hostIdentity is the reserved identity of this node's own addresses.
const hostIdentity uint32 = 1

// nodePeers keeps the nodes peers of the valid policies and what the
// controller labelled for them.
type nodePeers struct {
	// sels are the nodes peers in use, by label, with the number of
	// policies using each.
	sels map[string]*NodePeer
	refs map[string]int
	// dirty: sels changed since the last flush.
	dirty bool
	// labelled are what each remote node's addresses were given: the
	// addresses and their nodes: labels.
	labelled map[string]labelledNode
	// hostBase are identity 1's labels in the identities table,
	// hostLabels the nodes: labels this node's Node object gets: the
	// selector cache sees identity 1 with both.
	hostBase, hostLabels tables.Labels
}

type labelledNode struct {
	addrs  []netip.Addr
	labels []string
}

func newNodePeers() *nodePeers {
	return &nodePeers{sels: map[string]*NodePeer{}, refs: map[string]int{}, labelled: map[string]labelledNode{}}
}

// acquire and release count the nodes peers of a valid policy.
func (n *nodePeers) acquire(p *parsedPolicy) {
	for _, s := range p.peers {
		if np, ok := s.(*NodePeer); ok {
			if n.refs[np.Label] == 0 {
				n.sels[np.Label] = np
				n.dirty = true
			}
			n.refs[np.Label]++
		}
	}
}

func (n *nodePeers) release(p *parsedPolicy) {
	for _, s := range p.peers {
		if np, ok := s.(*NodePeer); ok {
			n.refs[np.Label]--
			if n.refs[np.Label] <= 0 {
				delete(n.refs, np.Label)
				delete(n.sels, np.Label)
				n.dirty = true
			}
		}
	}
}

// matching returns the labels of the nodes peers that select a node with
// these labels, sorted.
func (n *nodePeers) matching(nodeLabels map[string]string) []string {
	var out []string
	for _, label := range slices.Sorted(maps.Keys(n.sels)) {
		if n.sels[label].selectsNode(nodeLabels) {
			out = append(out, label)
		}
	}
	return out
}

// hostIdentityLabels are identity 1's labels as the selector cache sees
// them.
func (n *nodePeers) hostIdentityLabels() tables.Labels {
	return tables.NewLabels(append(slices.Clone(n.hostBase), n.hostLabels...)...)
}

// flushNodes labels the addresses of the nodes the nodes peers select,
// after a change of the nodes table or of the peers: a remote node's
// addresses get the nodes: labels of the peers selecting it (its own
// prefixes owner, beside its remote-node one), this node's go to the
// host identity in the selector cache. Nothing is labelled while no
// policy has a nodes peer, so remote nodes keep identity 6 then.
func (c *controller) flushNodes(rtxn statedb.ReadTxn) error {
	if c.NodesTable == nil {
		return nil
	}
	n := c.nodePeers
	var changes []ipcache.Change
	seen := map[string]struct{}{}
	var hostLabels []string
	for node := range c.NodesTable.All(rtxn) {
		matched := n.matching(node.Labels)
		if node.Local {
			hostLabels = matched
			continue
		}
		seen[node.Name] = struct{}{}
		old := n.labelled[node.Name]
		owner := tables.NodesPeerOwner(node.Name)
		var addrs []netip.Addr
		if len(matched) > 0 {
			addrs = node.Addresses
		}
		if slices.Equal(old.addrs, addrs) && slices.Equal(old.labels, matched) {
			continue
		}
		for _, a := range old.addrs {
			if !slices.Contains(addrs, a) {
				changes = append(changes, ipcache.Delete(netip.PrefixFrom(a, a.BitLen()), owner))
			}
		}
		for _, a := range addrs {
			changes = append(changes, ipcache.Upsert(netip.PrefixFrom(a, a.BitLen()), owner, matched...))
		}
		if len(addrs) == 0 {
			delete(n.labelled, node.Name)
		} else {
			n.labelled[node.Name] = labelledNode{addrs: slices.Clone(addrs), labels: matched}
		}
	}
	for name, old := range n.labelled {
		if _, ok := seen[name]; ok {
			continue
		}
		for _, a := range old.addrs {
			changes = append(changes, ipcache.Delete(netip.PrefixFrom(a, a.BitLen()), tables.NodesPeerOwner(name)))
		}
		delete(n.labelled, name)
	}
	if len(changes) > 0 {
		if _, err := c.Prefixes.Update(changes...); err != nil {
			return fmt.Errorf("label the addresses of nodes that nodes peers select: %w", err)
		}
	}
	if !slices.Equal(hostLabels, n.hostLabels) {
		n.hostLabels = hostLabels
		if n.hostBase != nil {
			c.cache.upsertIdentity(hostIdentity, n.hostIdentityLabels())
		}
	}
	n.dirty = false
	return nil
}
