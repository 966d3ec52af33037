package tables

import (
	"net/netip"
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// NodePortDevicesTableName is the statedb name of the nodeport-devices
// table.
const NodePortDevicesTableName = "nodeport-devices"

// NodePortDevice is an external device of the node, where the nodeport
// programs translate traffic from outside the node to Services, and what
// is attached to it.
type NodePortDevice struct {
	// Name is the device's name.
	Name string `json:"name" yaml:"name"`
	// Ifindex is its index; 0 when it is not found.
	Ifindex int `json:"ifindex,omitempty" yaml:"ifindex,omitempty"`
	// SNATAddr is the address remote backends see as the source of
	// flows leaving through it; invalid when it has none.
	SNATAddr netip.Addr `json:"snatAddr,omitzero" yaml:"snatAddr,omitempty"`
	// SNATAddr6 is the same for IPv6.
	SNATAddr6 netip.Addr `json:"snatAddr6,omitzero" yaml:"snatAddr6,omitempty"`
	// Attach says how the programs are attached ("tcx" or "tc"), empty
	// when they are not.
	Attach string `json:"attach,omitempty" yaml:"attach,omitempty"`
	// Error says why the device has no programs.
	Error string `json:"error,omitempty" yaml:"error,omitempty"`
}

// TableHeader implements statedb.TableWritable.
func (*NodePortDevice) TableHeader() []string {
	return []string{"Name", "Ifindex", "SNATAddr", "SNATAddr6", "Attach", "Error"}
}

// TableRow implements statedb.TableWritable.
func (d *NodePortDevice) TableRow() []string {
	addr := func(a netip.Addr) string {
		if a.IsValid() {
			return a.String()
		}
		return ""
	}
	return []string{d.Name, strconv.Itoa(d.Ifindex), addr(d.SNATAddr), addr(d.SNATAddr6), d.Attach, d.Error}
}

// NodePortDeviceNameIndex is the primary index of the nodeport-devices
// table.
var NodePortDeviceNameIndex = statedb.Index[*NodePortDevice, string]{
	Name:       "name",
	FromObject: func(d *NodePortDevice) index.KeySet { return index.NewKeySet(index.String(d.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewNodePortDevicesTable registers the nodeport-devices table with db.
func NewNodePortDevicesTable(db *statedb.DB) (statedb.RWTable[*NodePortDevice], error) {
	return statedb.NewTable(db, NodePortDevicesTableName, NodePortDeviceNameIndex)
}
