package tables

import (
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// Table names of the policy tables.
const (
	PoliciesTableName  = "policies"
	SelectorsTableName = "selectors"
)

// Policy is one CiliumNetworkPolicy, CiliumClusterwideNetworkPolicy,
// NetworkPolicy or ClusterNetworkPolicy as the agent understood it. What
// enforcing it shows (verdicts, warnings) is in the policy-status table.
type Policy struct {
	// Name is "cnp/<namespace>/<name>", "ccnp/<name>" or, for a
	// NetworkPolicy, "netpol/<namespace>/<name>".
	Name string `json:"name" yaml:"name"`
	// Subjects are the selectors of the endpoints the policy applies to.
	Subjects []string `json:"subjects" yaml:"subjects"`
	// Peers are the selectors of the peers the policy's rules allow or
	// deny, sorted; never AnyPeer, which is not a selector.
	Peers []string `json:"peers" yaml:"peers"`
	// CIDRs are the prefixes the policy names, which get cidr: labels.
	CIDRs []string `json:"cidrs,omitempty" yaml:"cidrs,omitempty"`
	// Specs are the policy's rules as enforcement uses them. An invalid
	// policy has no rules: its specs are what it fails closed to, the
	// subject of each spec whose selector parsed in default deny in the
	// directions the spec has rules in.
	Specs []PolicySpec `json:"specs,omitempty" yaml:"specs,omitempty"`
	// FailClosed: the policy is invalid and its Specs are enforced (the
	// endpoints it selects are denied in their directions), as
	// --policy-invalid-mode=deny asks.
	FailClosed bool `json:"failClosed,omitempty" yaml:"failClosed,omitempty"`
	// Audit is set by the annotation apiary.io/audit: "true": what only
	// this policy denies is let through and reported as audited.
	Audit bool `json:"audit,omitempty" yaml:"audit,omitempty"`
	// SelectedLabelKeys are the pod label keys the policy's pod selectors
	// name where the API promises selection by every label of a pod
	// (ClusterNetworkPolicy): the pods' identities carry labels of these
	// keys whatever the identity label filter says (cells/endpoints), so
	// that a selector on statefulset.kubernetes.io/pod-name selects.
	SelectedLabelKeys []string `json:"selectedLabelKeys,omitempty" yaml:"selectedLabelKeys,omitempty"`
	// Status is "OK" or "Error".
	Status string `json:"status" yaml:"status"`
	// Error says what is wrong with an invalid policy; the valid rules of
	// the other policies keep working.
	Error string `json:"error,omitempty" yaml:"error,omitempty"`
}

// VerdictCounts are counts of decisions by verdict.
type VerdictCounts struct {
	Allowed uint64 `json:"allowed" yaml:"allowed"`
	Denied  uint64 `json:"denied" yaml:"denied"`
	Audited uint64 `json:"audited" yaml:"audited"`
}

// Add returns the sum of c and o.
func (c VerdictCounts) Add(o VerdictCounts) VerdictCounts {
	return VerdictCounts{Allowed: c.Allowed + o.Allowed, Denied: c.Denied + o.Denied, Audited: c.Audited + o.Audited}
}

// Policy statuses.
const (
	PolicyOK    = "OK"
	PolicyError = "Error"
)

// TableHeader implements statedb.TableWritable.
func (*Policy) TableHeader() []string {
	return []string{"Name", "Subjects", "Peers", "CIDRs", "Rules", "Status", "Error"}
}

// TableRow implements statedb.TableWritable. Rules is the number of rules
// of all specs (the rules themselves are in the YAML and JSON forms),
// empty for an invalid policy.
func (p *Policy) TableRow() []string {
	status := p.Status
	if p.FailClosed {
		status += " (fail closed)"
	}
	if p.Audit {
		status += " (audit)"
	}
	rules := ""
	if p.Status == PolicyOK {
		n := 0
		for _, s := range p.Specs {
			n += len(s.Rules)
		}
		rules = strconv.Itoa(n)
	}
	return []string{
		p.Name, strings.Join(p.Subjects, "; "), strings.Join(p.Peers, "; "),
		strings.Join(p.CIDRs, ", "), rules, status, p.Error,
	}
}

// PolicyNameIndex is the primary index of the policies table.
var PolicyNameIndex = statedb.Index[*Policy, string]{
	Name:       "name",
	FromObject: func(p *Policy) index.KeySet { return index.NewKeySet(index.String(p.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewPoliciesTable registers the policies table with db.
func NewPoliciesTable(db *statedb.DB) (statedb.RWTable[*Policy], error) {
	return statedb.NewTable(db, PoliciesTableName, PolicyNameIndex)
}

// Selector is one distinct selector of the policies and the identities it
// selects now.
type Selector struct {
	// Selector is the selector in its canonical form: label requirements
	// "k8s:app=web, k8s:io.kubernetes.pod.namespace=default", a CIDR
	// "cidr:10.0.0.0/8" (with " except cidr:…" parts), "fqdn:<pattern>"
	// or an entity "entity:world", "entity:host", "entity:cluster".
	Selector string `json:"selector" yaml:"selector"`
	// Identities are the numbers of the identities selected, sorted.
	Identities []uint32 `json:"identities" yaml:"identities"`
	// Policies are the policies that use the selector.
	Policies []string `json:"policies" yaml:"policies"`
}

// Clone returns a copy whose slices may be modified.
func (s *Selector) Clone() *Selector {
	c := *s
	c.Identities = slices.Clone(s.Identities)
	c.Policies = slices.Clone(s.Policies)
	return &c
}

// TableHeader implements statedb.TableWritable.
func (*Selector) TableHeader() []string {
	return []string{"Selector", "Identities", "Policies"}
}

// TableRow implements statedb.TableWritable.
func (s *Selector) TableRow() []string {
	ids := make([]string, len(s.Identities))
	for i, id := range s.Identities {
		ids[i] = formatUint(id)
	}
	return []string{s.Selector, strings.Join(ids, ", "), strings.Join(s.Policies, ", ")}
}

// SelectorIndex is the primary index of the selectors table.
var SelectorIndex = statedb.Index[*Selector, string]{
	Name:       "selector",
	FromObject: func(s *Selector) index.KeySet { return index.NewKeySet(index.String(s.Selector)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewSelectorsTable registers the selectors table with db.
func NewSelectorsTable(db *statedb.DB) (statedb.RWTable[*Selector], error) {
	return statedb.NewTable(db, SelectorsTableName, SelectorIndex)
}

func formatUint(v uint32) string {
	return strconv.FormatUint(uint64(v), 10)
}

// Directions of a policy rule and of a policy map entry.
const (
	DirIngress = "ingress"
	DirEgress  = "egress"
)

// AnyPeer is the peer of a rule that applies to every remote identity
// (entity "all", or a rule with ports but no peers): it becomes the
// identity-0 entry of the policy map rather than a selector.
const AnyPeer = "entity:all"

// IPBlockPeerPrefix starts the text of a NetworkPolicy ipBlock's peer
// selector ("ipblock:10.0.0.0/8 except 10.1.0.0/16"). It selects the CIDR
// identities a CNP's CIDR of the same prefixes selects, but its allow
// entries also match the pods whose addresses are inside the block
// (PolicyEntry.PodAddrs).
const IPBlockPeerPrefix = "ipblock:"

// MatchesPodAddrs reports whether a rule's peer (a selector's text)
// matches addresses, pods' included, rather than identities alone: a
// NetworkPolicy ipBlock.
func MatchesPodAddrs(peer string) bool { return strings.HasPrefix(peer, IPBlockPeerPrefix) }

// Port protocols of a PortRule.
const (
	ProtoTCP  = "TCP"
	ProtoUDP  = "UDP"
	ProtoSCTP = "SCTP"
	ProtoAny  = "ANY"
)

// PolicySpec is one rule (spec) of a policy in the form enforcement
// uses: the endpoints it applies to and what it allows and denies them.
type PolicySpec struct {
	// Subject is the selector (a selectors row) of the endpoints the
	// spec applies to.
	Subject string `json:"subject" yaml:"subject"`
	// Ingress and Egress say that the spec has rules (allow or deny) in
	// that direction, so the endpoints it selects are enforced there.
	Ingress bool `json:"ingress,omitempty" yaml:"ingress,omitempty"`
	Egress  bool `json:"egress,omitempty" yaml:"egress,omitempty"`
	// DefaultDenyIngress and DefaultDenyEgress say that the spec puts the
	// endpoints it selects into default deny in that direction: true when
	// it has rules there unless enableDefaultDeny turns it off.
	DefaultDenyIngress bool `json:"defaultDenyIngress,omitempty" yaml:"defaultDenyIngress,omitempty"`
	DefaultDenyEgress  bool `json:"defaultDenyEgress,omitempty" yaml:"defaultDenyEgress,omitempty"`
	// Rules are the spec's allow and deny rules.
	Rules []PolicyRule `json:"rules,omitempty" yaml:"rules,omitempty"`
}

// PolicyRule allows (or denies) the subject's traffic with some peers on
// some ports in one direction.
type PolicyRule struct {
	// Direction is DirIngress or DirEgress.
	Direction string `json:"direction" yaml:"direction"`
	// Deny makes the rule deny what it matches; deny beats allow.
	Deny bool `json:"deny,omitempty" yaml:"deny,omitempty"`
	// Peers are the selectors (selectors rows) of the remote identities,
	// or AnyPeer.
	Peers []string `json:"peers" yaml:"peers"`
	// Ports limit the rule to these ports; empty: every protocol and port.
	Ports []PortRule `json:"ports,omitempty" yaml:"ports,omitempty"`
	// DNS are the names (cells/fqdn/pattern syntax, normalized) the DNS
	// rules of an egress allow rule's ports let the endpoint look up; "*"
	// for a DNS rule with an empty list. Empty: the rule has no DNS rule.
	// An endpoint with one has its DNS intercepted by the DNS proxy. A
	// tiered rule's DNS (a ClusterNetworkPolicy domainNames peer) only
	// asks for that interception: it allows no name of its own, and
	// every name where no other rule has DNS rules.
	DNS []string `json:"dns,omitempty" yaml:"dns,omitempty"`
	// Tier is "" for NetworkPolicy and CNP rules, TierAdmin or
	// TierBaseline for a ClusterNetworkPolicy's; a tiered rule's Deny is
	// false for Accept and Pass.
	Tier string `json:"tier,omitempty" yaml:"tier,omitempty"`
	// Pass: a tiered rule whose action is Pass.
	Pass bool `json:"pass,omitempty" yaml:"pass,omitempty"`
	// Priority is the tiered rule's policy's priority (0 first), Index
	// the rule's place among the policy's rules of its direction.
	Priority int32 `json:"priority,omitempty" yaml:"priority,omitempty"`
	Index    int32 `json:"index,omitempty" yaml:"index,omitempty"`
	// Label names a tiered rule in entries and verdicts:
	// "clusternetpol/<policy>/<rule name or index>".
	Label string `json:"label,omitempty" yaml:"label,omitempty"`
}

// Tiers of ClusterNetworkPolicy rules (PolicyRule.Tier).
const (
	TierAdmin    = "admin"
	TierBaseline = "baseline"
)

// PortRule is one port (or range, or named port) of a rule.
type PortRule struct {
	// Protocol is ProtoTCP, ProtoUDP, ProtoSCTP or ProtoAny.
	Protocol string `json:"protocol" yaml:"protocol"`
	// Port is the first port; 0 with no Name: every port of Protocol.
	Port uint16 `json:"port,omitempty" yaml:"port,omitempty"`
	// EndPort is the last port of a range (0: just Port).
	EndPort uint16 `json:"endPort,omitempty" yaml:"endPort,omitempty"`
	// Name is a named container port, resolved per endpoint (Port is 0).
	Name string `json:"name,omitempty" yaml:"name,omitempty"`
}
