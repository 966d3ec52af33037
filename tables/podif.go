package tables

import (
	"net/netip"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// PodInterfacesTableName is the statedb name of the pod-interfaces table.
const PodInterfacesTableName = "pod-interfaces"

// PodInterface is the host side of a pod's network interface, where the
// policy programs judge every packet the pod sends or receives (packet
// level, besides the socket hooks). One row per endpoint that has its own
// network namespace; a pod in the host's has none.
type PodInterface struct {
	// Name is the endpoint's name, "<namespace>/<pod>".
	Name string `json:"name" yaml:"name"`
	// CgroupID is the pod's cgroup: the programs find the pod's endpoint
	// and policy by it.
	CgroupID uint64 `json:"cgroupId" yaml:"cgroupId"`
	// Interface and Ifindex are the host side of the pod's veth; empty and
	// 0 while it is not found (Error says why).
	Interface string `json:"interface,omitempty" yaml:"interface,omitempty"`
	Ifindex   int    `json:"ifindex,omitempty" yaml:"ifindex,omitempty"`
	// PeerIfindex is the veth's pod side's index in the pod's network
	// namespace, as the host said when the interface was found: the
	// device a packet must leave by for the socket hooks to leave its
	// ClusterNetworkPolicy drop to the interface (bpf.PolicyPodIface).
	PeerIfindex int `json:"peerIfindex,omitempty" yaml:"peerIfindex,omitempty"`
	// Netns is the inode of the pod's network namespace.
	Netns uint64 `json:"netns,omitempty" yaml:"netns,omitempty"`
	// Addrs are the pod's addresses: the only sources its packets may
	// have. None while the pod's addresses are not known: then it may send
	// nothing but neighbour discovery.
	Addrs []netip.Addr `json:"addrs" yaml:"addrs"`
	// Error says why the interface is not found or not enforced.
	Error string `json:"error,omitempty" yaml:"error,omitempty"`
	// FailClosed: the pod has processes in a network namespace of its own
	// but no interface could be given to it (none found, or the one found
	// is another pod's): the policy controller denies it both ways at the
	// socket level until one is (Error says why).
	FailClosed bool `json:"failClosed,omitempty" yaml:"failClosed,omitempty"`
	// Status is the reconciliation status: the interface's map entry and
	// its programs' links.
	Status reconciler.Status `json:"status" yaml:"status"`
}

// Clone returns a shallow copy.
func (p *PodInterface) Clone() *PodInterface {
	c := *p
	return &c
}

// GetStatus returns the reconciliation status.
func (p *PodInterface) GetStatus() reconciler.Status { return p.Status }

// SetStatus sets the reconciliation status and returns the row.
func (p *PodInterface) SetStatus(s reconciler.Status) *PodInterface {
	p.Status = s
	return p
}

// TableHeader implements statedb.TableWritable.
func (*PodInterface) TableHeader() []string {
	return []string{"Name", "Interface", "Ifindex", "Addrs", "CgroupID", "Error", "Status"}
}

// TableRow implements statedb.TableWritable.
func (p *PodInterface) TableRow() []string {
	addrs := make([]string, len(p.Addrs))
	for i, a := range p.Addrs {
		addrs[i] = a.String()
	}
	ifindex := ""
	if p.Ifindex != 0 {
		ifindex = strconv.Itoa(p.Ifindex)
	}
	return []string{
		p.Name, p.Interface, ifindex, strings.Join(addrs, ", "), formatUint64(p.CgroupID), p.Error,
		StatusText(p.Status),
	}
}

func formatUint64(v uint64) string {
	if v == 0 {
		return ""
	}
	return strconv.FormatUint(v, 10)
}

// PodInterfaceNameIndex is the primary index of the pod-interfaces table.
var PodInterfaceNameIndex = statedb.Index[*PodInterface, string]{
	Name:       "name",
	FromObject: func(p *PodInterface) index.KeySet { return index.NewKeySet(index.String(p.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewPodInterfacesTable registers the pod-interfaces table with db.
func NewPodInterfacesTable(db *statedb.DB) (statedb.RWTable[*PodInterface], error) {
	return statedb.NewTable(db, PodInterfacesTableName, PodInterfaceNameIndex)
}
