package tables

import (
	"iter"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// Table names of policy enforcement.
const (
	PolicyEntriesTableName  = "policy-entries"
	EndpointPolicyTableName = "endpoint-policy"
)

// PolicyEntry is one entry of an endpoint's policy: what the endpoint may
// do with a remote identity (0: any) in one direction on a protocol and a
// port prefix. It is one entry of the policy map.
type PolicyEntry struct {
	// Endpoint is the endpoint's name, "<namespace>/<pod>".
	Endpoint string `json:"endpoint" yaml:"endpoint"`
	// EndpointID is the endpoint's node-local number in the policy map.
	EndpointID uint32 `json:"endpointId" yaml:"endpointId"`
	// Identity is the remote identity; 0 stands for any.
	Identity uint32 `json:"identity" yaml:"identity"`
	// Direction is DirIngress or DirEgress.
	Direction string `json:"direction" yaml:"direction"`
	// Protocol is the IANA protocol number, 0 for any protocol and port.
	Protocol uint8 `json:"protocol" yaml:"protocol"`
	// Port is the first port of the prefix; PortBits how many of its
	// leading bits the entry matches (16: one port, 0: every port).
	Port     uint16 `json:"port" yaml:"port"`
	PortBits uint8  `json:"portBits" yaml:"portBits"`
	// Deny is true for an entry that denies.
	Deny bool `json:"deny" yaml:"deny"`
	// Audit is true for a deny that only audited policies make: it lets
	// traffic through and reports it as audited.
	Audit bool `json:"audit,omitempty" yaml:"audit,omitempty"`
	// PodAddrs, on an allow entry for a CIDR identity, makes it match by
	// address: a pod whose own identity no entry allows is allowed when
	// its address is inside the entry's prefix (the policy-prefixes
	// table). A NetworkPolicy ipBlock sets it (MatchesPodAddrs); a CNP's
	// CIDR rule does not, as in the reference.
	PodAddrs bool `json:"podAddrs,omitempty" yaml:"podAddrs,omitempty"`
	// Final, on an entry of a peer identity, makes it decide alone: its
	// decision folds in every layer (ClusterNetworkPolicy tiers,
	// NetworkPolicy and CNP, the identity-0 entries), so the datapath
	// does not look up identity 0 (see docs/policy.md, Tiers).
	Final bool `json:"final,omitempty" yaml:"final,omitempty"`
	// Pass, on an entry of a peer identity, makes it decide nothing: the
	// datapath goes on by identity 0 and the default as if it had not
	// matched. An Admin tier Pass that no rule below decides makes it.
	Pass bool `json:"pass,omitempty" yaml:"pass,omitempty"`
	// Drop, on a deny entry, says a ClusterNetworkPolicy Deny rule
	// decided it: the API says it drops, so where the endpoint's
	// interface is enforced (EndpointPolicy.PodIface) the socket hooks
	// let it through and the interface drops it (bpf.PolicyFlagDrop).
	Drop bool `json:"drop,omitempty" yaml:"drop,omitempty"`
	// Policies are the policies that put the entry there.
	Policies []string `json:"policies" yaml:"policies"`
	// Cookie names the first of Policies in the datapath's verdicts.
	Cookie uint32 `json:"cookie" yaml:"cookie"`
}

// Clone returns a shallow copy.
func (e *PolicyEntry) Clone() *PolicyEntry {
	c := *e
	return &c
}

// Key is the entry's primary key: endpoint, identity, direction,
// protocol and port prefix.
func (e *PolicyEntry) Key() string {
	return PolicyEntryKey(e.Endpoint, e.Identity, e.Direction, e.Protocol, e.Port, e.PortBits)
}

// PolicyEntryKey is the primary key of a policy entry.
func PolicyEntryKey(endpoint string, identity uint32, dir string, proto uint8, port uint16, bits uint8) string {
	// Built in one buffer: a node's entries are written by the hundred
	// thousand (docs/benchmarks.md).
	var num [24]byte
	var b strings.Builder
	b.Grow(len(endpoint) + len(dir) + 32)
	b.WriteString(endpoint)
	b.WriteByte('|')
	b.Write(strconv.AppendUint(num[:0], uint64(identity), 10))
	b.WriteByte('|')
	b.WriteString(dir)
	b.WriteByte('|')
	b.Write(appendPortPrefix(num[:0], proto, port, bits))
	return b.String()
}

// PortPrefixString formats a protocol and port prefix: "ANY", "TCP",
// "TCP/80" or the range a partial prefix covers, "TCP/80-95".
func PortPrefixString(proto uint8, port uint16, bits uint8) string {
	var buf [24]byte
	return string(appendPortPrefix(buf[:0], proto, port, bits))
}

func appendPortPrefix(b []byte, proto uint8, port uint16, bits uint8) []byte {
	if proto == 0 {
		return append(b, "ANY"...)
	}
	b = append(b, Proto(proto).String()...)
	if bits == 0 {
		return b
	}
	b = append(b, '/')
	b = strconv.AppendUint(b, uint64(port), 10)
	if bits >= 16 {
		return b
	}
	last := port | (^uint16(0) >> bits)
	b = append(b, '-')
	return strconv.AppendUint(b, uint64(last), 10)
}

// TableHeader implements statedb.TableWritable.
func (*PolicyEntry) TableHeader() []string {
	return []string{"Endpoint", "Identity", "Direction", "Port", "Verdict", "Policies"}
}

// TableRow implements statedb.TableWritable.
func (e *PolicyEntry) TableRow() []string {
	id := "any"
	if e.Identity != 0 {
		id = formatUint(e.Identity)
	}
	if e.Identity == PolicySetRef {
		return []string{e.Endpoint, "any", e.Direction, "ANY", "shares " + strings.Join(e.Policies, ", "), ""}
	}
	verdict := "allow"
	switch {
	case e.PodAddrs && !e.Deny:
		verdict = "allow (pod addresses too)"
	case e.Deny && e.Audit:
		verdict = "deny (audit)"
	case e.Deny && e.Drop:
		verdict = "drop"
	case e.Deny:
		verdict = "deny"
	}
	switch {
	case e.Pass:
		verdict = "pass (identity 0 and the default decide)"
	case e.Final:
		verdict += " (final)"
	}
	return []string{
		e.Endpoint, id, e.Direction, PortPrefixString(e.Protocol, e.Port, e.PortBits), verdict,
		strings.Join(e.Policies, ", "),
	}
}

// PolicyEntryKeyIndex is the primary index of the policy-entries table.
var PolicyEntryKeyIndex = statedb.Index[*PolicyEntry, string]{
	Name:       "key",
	FromObject: func(e *PolicyEntry) index.KeySet { return index.NewKeySet(index.String(e.Key())) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// PolicyEntriesOf returns the entries of an endpoint, in key order: a
// prefix of the primary index, whose keys begin with the endpoint's name
// and a separator no name has. (An index of its own would cost every
// write a third tree, and a node writes its entries by the hundred
// thousand.)
func PolicyEntriesOf(txn statedb.ReadTxn, t statedb.Table[*PolicyEntry], endpoint string) iter.Seq2[*PolicyEntry, statedb.Revision] {
	return t.Prefix(txn, PolicyEntryKeyIndex.Query(endpoint+"|"))
}

// PolicyEntryIdentityIndex finds the entries of a node-local remote
// identity (ScopeLocal: CIDR and FQDN label sets), for the DNS proxy's
// gate. The entries of other identities are not in it: pod identities
// are the bulk of a node's entries (each one a peer selects, on every
// endpoint it applies to), and an index costs every row written.
var PolicyEntryIdentityIndex = statedb.Index[*PolicyEntry, uint32]{
	Name: "identity",
	FromObject: func(e *PolicyEntry) index.KeySet {
		if e.Identity < MinLocalIdentity || e.Identity > MaxLocalIdentity {
			return index.KeySet{}
		}
		return index.NewKeySet(index.Uint32(e.Identity))
	},
	FromKey:    index.Uint32,
	FromString: index.Uint32String,
	Unique:     false,
}

// NewPolicyEntriesTable registers the policy-entries table with db.
func NewPolicyEntriesTable(db *statedb.DB) (statedb.RWTable[*PolicyEntry], error) {
	return statedb.NewTable(db, PolicyEntriesTableName, PolicyEntryKeyIndex, PolicyEntryIdentityIndex)
}

// Enforcement states of a direction of an endpoint.
const (
	// EnforceOff: no policy selects the endpoint in that direction;
	// everything is allowed.
	EnforceOff = "off"
	// EnforceDefaultDeny: only what an entry allows is allowed.
	EnforceDefaultDeny = "default-deny"
	// EnforceDefaultAllow: selected, but every selecting policy turned
	// enableDefaultDeny off; everything not denied is allowed.
	EnforceDefaultAllow = "default-allow"
)

// EndpointPolicy is the policy state of an endpoint: its number in the
// policy map, its cgroup and how each direction is enforced. It is one
// entry of the policy_endpoints map (once its cgroup is known).
type EndpointPolicy struct {
	// Name is the endpoint's name, "<namespace>/<pod>".
	Name string `json:"name" yaml:"name"`
	// ID is the endpoint's number in the policy map; 0 until its cgroup
	// is known.
	ID uint32 `json:"id" yaml:"id"`
	// Cgroup and CgroupID are the pod's cgroup (see the endpoints table).
	Cgroup   string `json:"cgroup" yaml:"cgroup"`
	CgroupID uint64 `json:"cgroupId" yaml:"cgroupId"`
	// Ingress and Egress are Enforce* states.
	Ingress string `json:"ingress" yaml:"ingress"`
	Egress  string `json:"egress" yaml:"egress"`
	// Audit: nothing is denied, what would be is counted
	// (--policy-audit-mode).
	Audit bool `json:"audit,omitempty" yaml:"audit,omitempty"`
	// AuditDefaultIngress and AuditDefaultEgress: the direction's default
	// deny comes only from audited policies, so it is audited too.
	AuditDefaultIngress bool `json:"auditDefaultIngress,omitempty" yaml:"auditDefaultIngress,omitempty"`
	AuditDefaultEgress  bool `json:"auditDefaultEgress,omitempty" yaml:"auditDefaultEgress,omitempty"`
	// Entries is the number of the endpoint's policy entries.
	Entries int `json:"entries" yaml:"entries"`
	// Policies are the policies that select the endpoint.
	Policies []string `json:"policies" yaml:"policies"`
	// Reason says why the endpoint is enforced other than its policies
	// say, or not at all: it waits for its identity (denied meanwhile),
	// it is a host-network pod, it has no cgroup (ReasonNotEnforced and
	// why), invalid policies deny it (ReasonFailClosed and each policy
	// with its error, "; " between them).
	Reason string `json:"reason,omitempty" yaml:"reason,omitempty"`
	// FailClosedIngress and FailClosedEgress are the invalid policies
	// that select the endpoint and keep it default deny in that direction
	// (--policy-invalid-mode=deny): the default-deny verdicts there are
	// theirs.
	FailClosedIngress []string `json:"failClosedIngress,omitempty" yaml:"failClosedIngress,omitempty"`
	FailClosedEgress  []string `json:"failClosedEgress,omitempty" yaml:"failClosedEgress,omitempty"`
	// PodTree marks a row that is no endpoint but a root of the kubelet's
	// pod cgroups (Name "pod-tree:<cgroup>"): a process below it in no
	// endpoint is unclassified, denied by the programs until its pod is
	// registered (--unclassified-pods=deny).
	PodTree bool `json:"podTree,omitempty" yaml:"podTree,omitempty"`
	// DNS are the names the DNS rules of the endpoint's egress policy let
	// it look up, by pattern. Not empty: its DNS is intercepted by the
	// DNS proxy, which refuses other names (bpf.PolicyDNS).
	DNS []DNSRule `json:"dns,omitempty" yaml:"dns,omitempty"`
	// PodIface: the endpoint's pod interface is enforced (its
	// pod-interfaces row reconciled for the endpoint's cgroup), so a
	// ClusterNetworkPolicy Deny is dropped there rather than refused
	// with EPERM at the socket (bpf.PolicyPodIface).
	PodIface bool `json:"podIface,omitempty" yaml:"podIface,omitempty"`
	// PodIfindex is the pod side's index of that interface in the pod's
	// network namespace: only a packet leaving by it is let through for
	// the interface to drop (any other device of the pod's is no path
	// through the interface).
	PodIfindex int `json:"podIfindex,omitempty" yaml:"podIfindex,omitempty"`
	// Agent marks the row of the agent's own container cgroup (Name
	// "agent:<cgroup>"): an endpoint that no policy enforces, written at
	// start, before anything else, so that the pinned programs of an
	// earlier agent never deny the agent's own pod as unclassified while
	// it cannot reach the API server yet to learn of that pod.
	Agent bool `json:"agent,omitempty" yaml:"agent,omitempty"`
	// Set marks the row of a policy set (Name "policy-set:<ID>"): no
	// endpoint, but the allows that the endpoints whose rows name it in
	// SharedRules share (docs/policy.md, Shared policy sets). Its entries
	// are rows of policy-entries under its name; an endpoint's reference
	// entry (identity PolicySetRef) points at it.
	Set bool `json:"set,omitempty" yaml:"set,omitempty"`
	// SharedRules are the endpoint's allows kept in its policy sets, one
	// per peer selector, port prefix and policy: what names, in a
	// verdict, the policy behind an allow of a set.
	SharedRules []SharedRule `json:"sharedRules,omitempty" yaml:"sharedRules,omitempty"`
	// Status is the reconciliation status of the endpoint's map entry,
	// which is written once all its policy entries are in the map.
	Status reconciler.Status `json:"status" yaml:"status"`
}

// SharedRule is an allow of an endpoint kept in its policy set: the
// policy, the direction, the peer selector and the port prefix (as in
// PolicyEntry).
type SharedRule struct {
	Policy    string `json:"policy" yaml:"policy"`
	Direction string `json:"direction" yaml:"direction"`
	Peer      string `json:"peer" yaml:"peer"`
	Protocol  uint8  `json:"protocol" yaml:"protocol"`
	Port      uint16 `json:"port" yaml:"port"`
	PortBits  uint8  `json:"portBits" yaml:"portBits"`
}

// Covers says whether the rule's port prefix holds the protocol and port.
func (r SharedRule) Covers(proto uint8, port uint16) bool {
	if r.Protocol == 0 {
		return true
	}
	if r.Protocol != proto {
		return false
	}
	if r.PortBits == 0 {
		return true
	}
	mask := ^uint16(0) << (16 - uint(r.PortBits))
	return port&mask == r.Port&mask
}

// PolicySetRef is the identity of an endpoint's reference entry to its
// policy set in a direction (any protocol and port; Cookie is the set's
// ID, Policies its name). No identity is this number (bpf.PolicySetRef).
const PolicySetRef uint32 = 0xffffffff

// PolicySetPrefix begins the name of a policy set's row and entries.
const PolicySetPrefix = "policy-set:"

// PolicySetName is the name of the policy set of ID id.
func PolicySetName(id uint32) string {
	return PolicySetPrefix + strconv.FormatUint(uint64(id), 10)
}

// DNSRule is a name an endpoint may look up, and the policy that says so.
type DNSRule struct {
	// Pattern is a DNS name or pattern (cells/fqdn/pattern syntax,
	// normalized); "*" is every name.
	Pattern string `json:"pattern" yaml:"pattern"`
	// Policy is the first policy (by name) with a DNS rule for it.
	Policy string `json:"policy" yaml:"policy"`
}

// Clone returns a shallow copy.
func (e *EndpointPolicy) Clone() *EndpointPolicy {
	c := *e
	return &c
}

// GetStatus returns the reconciliation status.
func (e *EndpointPolicy) GetStatus() reconciler.Status { return e.Status }

// SetStatus sets the reconciliation status and returns the row.
func (e *EndpointPolicy) SetStatus(s reconciler.Status) *EndpointPolicy {
	e.Status = s
	return e
}

// TableHeader implements statedb.TableWritable.
func (*EndpointPolicy) TableHeader() []string {
	return []string{"Name", "ID", "Cgroup", "Ingress", "Egress", "Entries", "Policies", "Reason", "Status"}
}

// Prefixes of EndpointPolicy.Reason.
const (
	ReasonNotEnforced = "not enforced: "
	ReasonFailClosed  = "fail closed: "
)

// TableRow implements statedb.TableWritable.
func (e *EndpointPolicy) TableRow() []string {
	ingress, egress := e.Ingress, e.Egress
	if e.Audit || e.AuditDefaultIngress {
		ingress += " (audit)"
	}
	if e.Audit || e.AuditDefaultEgress {
		egress += " (audit)"
	}
	// An endpoint without an ID has nothing in the map: its status says
	// so rather than the reconciler's Done (it had nothing to write).
	status := StatusText(e.Status)
	if e.ID == 0 && !e.PodTree && e.Reason != "" {
		status = "Not enforced"
	}
	if e.Set {
		ingress, egress = "-", "-"
	}
	return []string{
		e.Name, formatUint(e.ID), e.Cgroup, ingress, egress, strconv.Itoa(e.Entries),
		strings.Join(e.Policies, ", "), e.Reason, status,
	}
}

// PodTreeRowPrefix begins the names of EndpointPolicy rows that are pod
// trees.
const PodTreeRowPrefix = "pod-tree:"

// AgentRowPrefix begins the name of the EndpointPolicy row of the agent's
// own container cgroup.
const AgentRowPrefix = "agent:"

// EndpointPolicyNameIndex is the primary index of the endpoint-policy
// table.
var EndpointPolicyNameIndex = statedb.Index[*EndpointPolicy, string]{
	Name:       "name",
	FromObject: func(e *EndpointPolicy) index.KeySet { return index.NewKeySet(index.String(e.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewEndpointPolicyTable registers the endpoint-policy table with db.
func NewEndpointPolicyTable(db *statedb.DB) (statedb.RWTable[*EndpointPolicy], error) {
	return statedb.NewTable(db, EndpointPolicyTableName, EndpointPolicyNameIndex)
}
