package tables

import (
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// AgentIPsTableName is the statedb name of the table of the agent's own IPs.
const AgentIPsTableName = "agent-ips"

// The kinds of IP the agent allocates for itself.
const (
	AgentIPKindHealth  = "health"
	AgentIPKindIngress = "ingress"
)

// The values of AgentIP.Status.
const (
	// AgentIPPending: the kind is enabled and nothing has been tried yet.
	AgentIPPending = "pending"
	// AgentIPReady: the IP is allocated, recorded in --state-dir and usable.
	AgentIPReady = "ready"
	// AgentIPError: the last attempt failed (see Error); it is retried.
	AgentIPError = "error"
	// AgentIPReleasing: the kind was disabled and its recorded IP has not
	// been handed back yet (see Error when a release failed).
	AgentIPReleasing = "releasing"
)

// AgentIP is one IP the agent holds for itself (the health or ingress IP),
// allocated through the delegated IPAM plugin. There is a row for every
// enabled kind and for a disabled kind whose recorded IP is being released;
// the row of a released kind is deleted.
//
// A consumer that uses the IPs (say, the ipcache, which gives them the
// reserved identities) reads only rows whose Status is AgentIPReady: IP is
// then valid and stays so until the row changes.
type AgentIP struct {
	// Kind is "health" or "ingress".
	Kind string `json:"kind" yaml:"kind"`
	// Owner is the owner name under which the IP is published as a prefix,
	// "ipam/<kind>".
	Owner string `json:"owner" yaml:"owner"`
	// Labels are the labels the IP's prefix carries ("reserved:health" or
	// "reserved:ingress").
	Labels []string `json:"labels" yaml:"labels"`
	// IP is the allocated IPv4 address; invalid (JSON "") unless Ready.
	IP netip.Addr `json:"ip" yaml:"ip"`
	// IPv6 is the allocated IPv6 address on a dual-stack node
	// (--enable-ipv6), absent otherwise.
	IPv6 netip.Addr `json:"ipv6,omitzero" yaml:"ipv6,omitempty"`
	// ContainerID is the CNI_CONTAINERID the plugin is called with
	// ("apiary-health", "apiary-ingress"); the plugin keys its lease on it.
	ContainerID string `json:"containerID" yaml:"containerID"`
	// Network is the CNI network name the lease belongs to.
	Network string `json:"network,omitempty" yaml:"network,omitempty"`
	// Plugin is the IPAM plugin's type, e.g. "host-local".
	Plugin string `json:"plugin,omitempty" yaml:"plugin,omitempty"`
	// Status is pending, ready, error or releasing.
	Status string `json:"status" yaml:"status"`
	// Action says how a Ready IP was obtained: "checked" (a recorded IP
	// that the plugin confirmed with CHECK) or "allocated" (a fresh ADD).
	Action string `json:"action,omitempty" yaml:"action,omitempty"`
	// Error is the reason of the last failure, empty when Ready.
	Error string `json:"error,omitempty" yaml:"error,omitempty"`
	// Attempts counts the attempts since the agent started.
	Attempts int `json:"attempts" yaml:"attempts"`
	// Updated is when the row last changed.
	Updated time.Time `json:"updated" yaml:"updated"`
}

// AgentIPOwner returns the prefix owner name of a kind, "ipam/<kind>".
func AgentIPOwner(kind string) string { return "ipam/" + kind }

// AgentIPLabel returns the reserved label of a kind, "reserved:<kind>".
func AgentIPLabel(kind string) string { return "reserved:" + kind }

// AgentIPContainerID returns the CNI container ID of a kind, "apiary-<kind>".
func AgentIPContainerID(kind string) string { return "apiary-" + kind }

// Clone returns a copy whose Labels may be changed too.
func (a *AgentIP) Clone() *AgentIP {
	c := *a
	c.Labels = append([]string(nil), a.Labels...)
	return &c
}

// Ready reports whether the IP is allocated and usable.
func (a *AgentIP) Ready() bool { return a.Status == AgentIPReady && a.IP.IsValid() }

// TableHeader implements statedb.TableWritable.
func (*AgentIP) TableHeader() []string {
	return []string{"Kind", "Owner", "IP", "IPv6", "ContainerID", "Network", "Plugin", "Status", "Action", "Attempts", "Error"}
}

// TableRow implements statedb.TableWritable.
func (a *AgentIP) TableRow() []string {
	str := func(ip netip.Addr) string {
		if ip.IsValid() {
			return ip.String()
		}
		return ""
	}
	return []string{
		a.Kind, a.Owner, str(a.IP), str(a.IPv6), a.ContainerID, a.Network, a.Plugin, a.Status, a.Action,
		strconv.Itoa(a.Attempts), strings.ReplaceAll(a.Error, "\n", " "),
	}
}

// AgentIPKindIndex is the primary index of the agent-ips table.
var AgentIPKindIndex = statedb.Index[*AgentIP, string]{
	Name:       "kind",
	FromObject: func(a *AgentIP) index.KeySet { return index.NewKeySet(index.String(a.Kind)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewAgentIPsTable registers the agent-ips table with db.
func NewAgentIPsTable(db *statedb.DB) (statedb.RWTable[*AgentIP], error) {
	return statedb.NewTable(db, AgentIPsTableName, AgentIPKindIndex)
}
