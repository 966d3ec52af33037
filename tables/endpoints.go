package tables

import (
	"net/netip"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// EndpointsTableName is the statedb name of the endpoints table.
const EndpointsTableName = "endpoints"

// Endpoint is a Pod running on this node, with its security identity.
type Endpoint struct {
	// Name is "<namespace>/<name>".
	Name string `json:"name" yaml:"name"`
	// IPs are the pod's addresses.
	IPs []netip.Addr `json:"ips" yaml:"ips"`
	// Labels are the pod's security labels.
	Labels Labels `json:"labels" yaml:"labels"`
	// Identity is the identity of the pod's IPs, 0 until resolved.
	Identity uint32 `json:"identity" yaml:"identity"`
	// IdentitySource says who handed the number out ("agent" for this
	// agent's cluster allocator, "reserved"; in the operator identity
	// management mode "cluster" for an Identity's number and "temporary"
	// until one appears); empty while pending.
	IdentitySource string `json:"identitySource" yaml:"identitySource"`
	// Error says what is wrong with the pod's identity: why it has none,
	// or an address of the pod that another pod claims too (see
	// docs/identities.md).
	Error string `json:"error,omitempty" yaml:"error,omitempty"`
	// UID is the pod's UID, which names its kubelet cgroup.
	UID string `json:"uid,omitempty" yaml:"uid,omitempty"`
	// NamedPorts are the pod's named container ports.
	NamedPorts []NamedPort `json:"namedPorts,omitempty" yaml:"namedPorts,omitempty"`
	// Cgroup is the pod's cgroup, relative to --cgroup-root; empty until
	// it appears.
	Cgroup string `json:"cgroup,omitempty" yaml:"cgroup,omitempty"`
	// CgroupID is the cgroup's ID (its inode number), 0 until it appears.
	CgroupID uint64 `json:"cgroupId,omitempty" yaml:"cgroupId,omitempty"`
	// HostNetwork is set for a pod in the host's network namespace: it
	// is the host (no IPs, no identity, no policy of its own), listed so
	// that its cgroup is known.
	HostNetwork bool `json:"hostNetwork,omitempty" yaml:"hostNetwork,omitempty"`
	// CgroupError says why Cgroup is empty: a UID that cannot name a
	// cgroup, no cgroup of the UID (yet), or an unusable cgroup root. The
	// pod is not enforced until it has a cgroup.
	CgroupError string `json:"cgroupError,omitempty" yaml:"cgroupError,omitempty"`
	// Workload is the workload that controls the pod, as Hubble names it
	// in its flows; nil for a pod no controller made.
	Workload *Workload `json:"workload,omitempty" yaml:"workload,omitempty"`
}

// Workload is a pod's controlling workload: a Deployment (through its
// ReplicaSet), a DaemonSet, a StatefulSet, a Job, a CronJob (through its
// Job), or whatever other kind of controller owns the pod.
type Workload struct {
	// Kind is the workload's kind ("Deployment", "DaemonSet", ...).
	Kind string `json:"kind" yaml:"kind"`
	// Name is the workload's name, in the pod's namespace.
	Name string `json:"name" yaml:"name"`
}

// NamedPort is a named container port of a pod.
type NamedPort struct {
	// Name is the port's name, which policies may refer to.
	Name string `json:"name" yaml:"name"`
	// Port is the container port.
	Port uint16 `json:"port" yaml:"port"`
	// Protocol is "TCP" (the default), "UDP" or "SCTP".
	Protocol string `json:"protocol" yaml:"protocol"`
}

// TableHeader implements statedb.TableWritable. The cgroup comes last, as
// its path is long; the UID and named ports are in the JSON and YAML forms.
func (*Endpoint) TableHeader() []string {
	return []string{"Name", "IPs", "Labels", "Identity", "IdentitySource", "Error", "CgroupID", "Cgroup"}
}

// TableRow implements statedb.TableWritable.
func (e *Endpoint) TableRow() []string {
	ips := make([]string, len(e.IPs))
	for i, ip := range e.IPs {
		ips[i] = ip.String()
	}
	cgroupID := "" // not found, like an empty Cgroup
	if e.CgroupID != 0 {
		cgroupID = strconv.FormatUint(e.CgroupID, 10)
	}
	cgroup := e.Cgroup
	if cgroup == "" && e.CgroupError != "" {
		cgroup = "(none: " + e.CgroupError + ")"
	}
	return []string{
		e.Name, strings.Join(ips, ", "), strings.Join(e.Labels, ", "), formatUint(e.Identity),
		e.IdentitySource, e.Error, cgroupID, cgroup,
	}
}

// EndpointNameIndex is the primary index of the endpoints table.
var EndpointNameIndex = statedb.Index[*Endpoint, string]{
	Name:       "name",
	FromObject: func(e *Endpoint) index.KeySet { return index.NewKeySet(index.String(e.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewEndpointsTable registers the endpoints table with db.
func NewEndpointsTable(db *statedb.DB) (statedb.RWTable[*Endpoint], error) {
	return statedb.NewTable(db, EndpointsTableName, EndpointNameIndex)
}
