package selectors

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"reflect"
	"regexp"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/cache"

	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/tables"
)

// ClusterNetpolGroupVersion is policy.networking.k8s.io/v1beta1, the API
// of SIG Network's network-policy-api v0.3.0. The types below are
// apiary's own copy of its ClusterNetworkPolicy (as the cilium.io ones
// are): the module would raise the go directive, and apiary needs the
// JSON form only.
var ClusterNetpolGroupVersion = schema.GroupVersion{Group: "policy.networking.k8s.io", Version: "v1beta1"}

// ClusterNetpolPrefix starts the names of ClusterNetworkPolicies in the
// policies table, verdicts and health: "clusternetpol/<name>" ("cnp/" is
// CiliumNetworkPolicy's).
const ClusterNetpolPrefix = "clusternetpol/"

// ClusterNetworkPolicy is policy.networking.k8s.io/v1beta1
// ClusterNetworkPolicy, cluster-scoped.
type ClusterNetworkPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`

	Spec ClusterNetworkPolicySpec `json:"spec"`

	// specErr is what a strict decoding of spec found (a field apiary
	// does not know, such as one of a newer API version): the policy is
	// then invalid, since enforcing it without the field would allow or
	// deny something else than it says.
	specErr string
}

// ClusterNetworkPolicySpec is the spec of a ClusterNetworkPolicy.
type ClusterNetworkPolicySpec struct {
	// Tier is "Admin" or "Baseline".
	Tier string `json:"tier"`
	// Priority orders the policies of a tier, 0 (first) to 1000.
	Priority int32                     `json:"priority"`
	Subject  ClusterNetpolSubject      `json:"subject"`
	Ingress  []ClusterNetpolIngress    `json:"ingress,omitempty"`
	Egress   []ClusterNetpolEgressRule `json:"egress,omitempty"`
}

// ClusterNetpolSubject selects the pods a policy applies to: exactly one
// of its fields is set.
type ClusterNetpolSubject struct {
	Namespaces *metav1.LabelSelector `json:"namespaces,omitempty"`
	Pods       *NamespacedPod        `json:"pods,omitempty"`
}

// NamespacedPod selects pods by their labels and their namespace's.
type NamespacedPod struct {
	NamespaceSelector metav1.LabelSelector `json:"namespaceSelector"`
	PodSelector       metav1.LabelSelector `json:"podSelector"`
}

// ClusterNetpolIngress is an ingress rule.
type ClusterNetpolIngress struct {
	Name      string                  `json:"name,omitempty"`
	Action    string                  `json:"action"`
	From      []ClusterNetpolPeer     `json:"from"`
	Protocols []ClusterNetpolProtocol `json:"protocols,omitempty"`
}

// ClusterNetpolEgressRule is an egress rule.
type ClusterNetpolEgressRule struct {
	Name      string                  `json:"name,omitempty"`
	Action    string                  `json:"action"`
	To        []ClusterNetpolPeer     `json:"to"`
	Protocols []ClusterNetpolProtocol `json:"protocols,omitempty"`
}

// ClusterNetpolPeer is a peer of a rule; exactly one field is set. Nodes,
// Networks and DomainNames are for egress only.
type ClusterNetpolPeer struct {
	Namespaces  *metav1.LabelSelector `json:"namespaces,omitempty"`
	Pods        *NamespacedPod        `json:"pods,omitempty"`
	Nodes       *metav1.LabelSelector `json:"nodes,omitempty"`
	Networks    []string              `json:"networks,omitempty"`
	DomainNames []string              `json:"domainNames,omitempty"`
}

// ClusterNetpolProtocol is one protocol (with a port or range) or a
// destination named port; exactly one field is set.
type ClusterNetpolProtocol struct {
	TCP                  *ClusterNetpolPorts `json:"tcp,omitempty"`
	UDP                  *ClusterNetpolPorts `json:"udp,omitempty"`
	SCTP                 *ClusterNetpolPorts `json:"sctp,omitempty"`
	DestinationNamedPort string              `json:"destinationNamedPort,omitempty"`
}

// ClusterNetpolPorts is the destination port of a protocol; none: every
// port.
type ClusterNetpolPorts struct {
	DestinationPort *ClusterNetpolPort `json:"destinationPort,omitempty"`
}

// ClusterNetpolPort is a port number or a range; exactly one is set.
type ClusterNetpolPort struct {
	Number int32               `json:"number,omitempty"`
	Range  *ClusterNetpolRange `json:"range,omitempty"`
}

// ClusterNetpolRange is an inclusive port range.
type ClusterNetpolRange struct {
	Start int32 `json:"start"`
	End   int32 `json:"end"`
}

// ClusterNetworkPolicyList is a list of ClusterNetworkPolicies.
type ClusterNetworkPolicyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata"`
	Items           []ClusterNetworkPolicy `json:"items"`
}

// UnmarshalJSON decodes the policy, then its spec again strictly: a field
// of the spec apiary does not know makes the policy invalid.
func (p *ClusterNetworkPolicy) UnmarshalJSON(data []byte) error {
	type plain ClusterNetworkPolicy
	if err := json.Unmarshal(data, (*plain)(p)); err != nil {
		return err
	}
	p.specErr = ""
	var doc struct {
		Spec json.RawMessage `json:"spec"`
	}
	if err := json.Unmarshal(data, &doc); err == nil && len(doc.Spec) > 0 {
		d := json.NewDecoder(bytes.NewReader(doc.Spec))
		d.DisallowUnknownFields()
		var strict ClusterNetworkPolicySpec
		if err := d.Decode(&strict); err != nil {
			p.specErr = "spec: " + err.Error()
		}
	}
	return nil
}

// DeepCopyObject implements runtime.Object.
func (p *ClusterNetworkPolicy) DeepCopyObject() runtime.Object {
	out := deepCopy(p)
	out.specErr = p.specErr
	return out
}

// DeepCopyObject implements runtime.Object.
func (l *ClusterNetworkPolicyList) DeepCopyObject() runtime.Object { return deepCopy(l) }

// ClusterNetpolKind is policy.networking.k8s.io/v1beta1
// ClusterNetworkPolicy (CRDs in deploy/network-policy-api-crds/).
var ClusterNetpolKind = k8s.Kind[*ClusterNetworkPolicy]{
	GVK:        ClusterNetpolGroupVersion.WithKind("ClusterNetworkPolicy"),
	Resource:   "clusternetworkpolicies",
	Namespaced: false,
	// A cluster without the CRDs has no such policies.
	Optional: true,
	ListWatch: func(c *k8s.Clientset) cache.ListerWatcher {
		return k8s.CustomResourceListWatch[*ClusterNetworkPolicy, *ClusterNetworkPolicyList](c, ClusterNetpolGroupVersion.WithResource("clusternetworkpolicies"))
	},
}

// clusterNetpolInput is what the parse of a ClusterNetworkPolicy depends
// on: its spec (with what strict decoding found) and its annotations.
type clusterNetpolInput struct {
	spec        ClusterNetworkPolicySpec
	specErr     string
	annotations map[string]string
}

func clusterNetpolInputOf(p *ClusterNetworkPolicy) clusterNetpolInput {
	return clusterNetpolInput{spec: p.Spec, specErr: p.specErr, annotations: p.Annotations}
}

func (a clusterNetpolInput) equal(b clusterNetpolInput) bool {
	return a.specErr == b.specErr && maps.Equal(a.annotations, b.annotations) && reflect.DeepEqual(a.spec, b.spec)
}

// ParseClusterNetworkPolicy parses a ClusterNetworkPolicy as the cell
// does; the error says why it is invalid.
func ParseClusterNetworkPolicy(p *ClusterNetworkPolicy) (Parsed, error) {
	return parseClusterNetpol(ClusterNetpolPrefix+p.Name, p).withAudit(p.Annotations).parsed()
}

// Rule actions of a ClusterNetworkPolicy.
const (
	clusterNetpolAccept = "Accept"
	clusterNetpolDeny   = "Deny"
	clusterNetpolPass   = "Pass"
)

// parseClusterNetpol turns a ClusterNetworkPolicy into the spec the other
// kinds become, its rules tiered (tables.PolicyRule.Tier): Admin and
// Baseline, each rule with its policy's priority, its index among the
// rules of its direction and its label for verdicts
// ("clusternetpol/<name>/<rule name, or ingress[i], egress[i]>"). The
// engine orders them (docs/policy.md, Tiers): the Admin tier first
// (Accept and Deny final, Pass hands over to NetworkPolicy and CNP),
// then NetworkPolicy and CNP, then the Baseline tier, then the default.
// The policy does not put its subject into default deny
// (enableDefaultDeny: false).
//
// What apiary cannot enforce exactly makes the policy invalid, and it
// fails closed, its subjects denied in the directions it has rules in,
// so that a policy apiary cannot enforce never leaves open what it meant
// to close.
//
// Subjects and peers select pods (never host-network ones, which have the
// host's identity): namespaces by their labels, pods by theirs and their
// namespace's. A networks peer is a CIDR selector, a nodes peer a
// NodePeer, a domainNames entry an FQDN selector (ParseDomainName).
func parseClusterNetpol(name string, cnp *ClusterNetworkPolicy) *parsedPolicy {
	p := &parsedPolicy{name: name}
	pp := &policyParser{
		subjects: map[string]Selector{},
		peers:    map[string]Selector{},
		cidrs:    map[netip.Prefix]struct{}{},
		podNets:  map[netip.Prefix]struct{}{},
	}
	spec := &cnp.Spec
	if cnp.specErr != "" {
		pp.errs = append(pp.errs, errors.New(cnp.specErr))
	}
	tier := tables.TierAdmin
	switch spec.Tier {
	case "Admin":
	case "Baseline":
		tier = tables.TierBaseline
	default:
		pp.errorf("spec.tier", "%q is neither Admin nor Baseline", spec.Tier)
	}
	if spec.Priority < 0 || spec.Priority > 1000 {
		pp.errorf("spec.priority", "%d is not from 0 to 1000", spec.Priority)
	}
	var ps tables.PolicySpec
	if sel, err := clusterNetpolPods("spec.subject", spec.Subject.Namespaces, spec.Subject.Pods); err != nil {
		pp.fail("spec.subject", err)
	} else {
		pp.subjects[sel.String()] = sel
		ps.Subject = sel.String()
	}
	ps.Ingress, ps.Egress = len(spec.Ingress) > 0, len(spec.Egress) > 0
	tiered := func(r tables.PolicyRule, i int, ruleName, dir string) tables.PolicyRule {
		r.Tier, r.Priority, r.Index = tier, spec.Priority, int32(i)
		if ruleName == "" {
			ruleName = fmt.Sprintf("%s[%d]", dir, i)
		}
		r.Label = name + "/" + ruleName
		return r
	}
	for i, r := range spec.Ingress {
		path := fmt.Sprintf("spec.ingress[%d]", i)
		ps.Rules = append(ps.Rules, tiered(pp.clusterNetpolRule(path, tables.DirIngress, "from", r.Action, r.From, r.Protocols), i, r.Name, tables.DirIngress))
	}
	for i, r := range spec.Egress {
		path := fmt.Sprintf("spec.egress[%d]", i)
		ps.Rules = append(ps.Rules, tiered(pp.clusterNetpolRule(path, tables.DirEgress, "to", r.Action, r.To, r.Protocols), i, r.Name, tables.DirEgress))
	}
	p.labelKeys = clusterNetpolLabelKeys(spec)
	p.subjects = sortedSelectors(pp.subjects)
	if len(pp.errs) > 0 {
		p.err = errors.Join(pp.errs...)
		p.invalidate([]tables.PolicySpec{ps})
		return p
	}
	p.specs = []tables.PolicySpec{ps}
	p.peers = sortedSelectors(pp.peers)
	for _, pfx := range slices.SortedFunc(maps.Keys(pp.cidrs), func(a, b netip.Prefix) int {
		return strings.Compare(a.String(), b.String())
	}) {
		p.cidrs = append(p.cidrs, pfx)
	}
	p.podNets = slices.SortedFunc(maps.Keys(pp.podNets), func(a, b netip.Prefix) int {
		return strings.Compare(a.String(), b.String())
	})
	return p
}

// clusterNetpolLabelKeys returns the pod label keys the policy's pod
// selectors (subject and peers) name, sorted: the API selects pods by
// every label they have, so the pods' identities must carry these
// whatever the identity label filter leaves out (an invalid policy's too,
// whose subject still selects the pods it fails closed on).
func clusterNetpolLabelKeys(spec *ClusterNetworkPolicySpec) []string {
	keys := map[string]struct{}{}
	add := func(pods *NamespacedPod) {
		if pods == nil {
			return
		}
		for k := range pods.PodSelector.MatchLabels {
			keys[k] = struct{}{}
		}
		for _, e := range pods.PodSelector.MatchExpressions {
			keys[e.Key] = struct{}{}
		}
	}
	add(spec.Subject.Pods)
	for _, r := range spec.Ingress {
		for _, peer := range r.From {
			add(peer.Pods)
		}
	}
	for _, r := range spec.Egress {
		for _, peer := range r.To {
			add(peer.Pods)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	return slices.Sorted(maps.Keys(keys))
}

// clusterNetpolPods returns the selector of a subject or peer that is
// namespaces (every pod of the namespaces selected) or pods (the pods
// selected in the namespaces selected); exactly one must be set.
func clusterNetpolPods(path string, namespaces *metav1.LabelSelector, pods *NamespacedPod) (*LabelSelector, error) {
	switch {
	case namespaces != nil && pods != nil:
		return nil, errors.New("namespaces and pods are both set; exactly one must be")
	case namespaces != nil:
		return netpolSelector(&metav1.LabelSelector{}, namespaces, "")
	case pods != nil:
		ns := pods.NamespaceSelector
		return netpolSelector(&pods.PodSelector, &ns, "")
	}
	return nil, errors.New("neither namespaces nor pods is set; exactly one must be")
}

// clusterNetpolRule parses one rule: its action, its peers (field "from"
// or "to") and its protocols.
func (pp *policyParser) clusterNetpolRule(path, dir, field, action string, peers []ClusterNetpolPeer, protocols []ClusterNetpolProtocol) tables.PolicyRule {
	out := tables.PolicyRule{Direction: dir, Peers: []string{}}
	switch action {
	case clusterNetpolDeny:
		out.Deny = true
	case clusterNetpolAccept:
	case clusterNetpolPass:
		out.Pass = true
	default:
		pp.errorf(path+".action", "%q is not Accept, Deny or Pass", action)
	}
	if len(peers) == 0 {
		pp.errorf(path+"."+field, "needs at least one peer")
	}
	set := map[string]struct{}{}
	for i, peer := range peers {
		where := fmt.Sprintf("%s.%s[%d]", path, field, i)
		n := 0
		for _, set := range []bool{peer.Namespaces != nil, peer.Pods != nil, peer.Nodes != nil, peer.Networks != nil, peer.DomainNames != nil} {
			if set {
				n++
			}
		}
		switch {
		case n != 1:
			pp.errorf(where, "exactly one of namespaces, pods, nodes, networks and domainNames must be set")
		case peer.Nodes != nil:
			if dir != tables.DirEgress {
				pp.errorf(where+".nodes", "only egress rules have nodes peers")
				continue
			}
			sel, err := ParseNodePeer(peer.Nodes)
			if err != nil {
				pp.fail(where+".nodes", err)
				continue
			}
			pp.peers[sel.String()] = sel
			set[sel.String()] = struct{}{}
		case peer.DomainNames != nil:
			switch {
			case dir != tables.DirEgress:
				pp.errorf(where+".domainNames", "only egress rules have domainNames peers")
				continue
			case action != clusterNetpolAccept:
				pp.errorf(where+".domainNames", "only Accept rules may have domainNames peers (the API's rule)")
				continue
			case len(peer.DomainNames) == 0:
				pp.errorf(where+".domainNames", "needs at least one domain name")
			}
			for j, name := range peer.DomainNames {
				sel, err := ParseDomainName(name)
				if err != nil {
					pp.fail(fmt.Sprintf("%s.domainNames[%d]", where, j), err)
					continue
				}
				pp.peers[sel.String()] = sel
				set[sel.String()] = struct{}{}
			}
			// The proxy must see the subjects' DNS answers to label the
			// names' addresses (tables.PolicyRule.DNS).
			out.DNS = []string{"*"}
		case peer.Networks != nil:
			if dir != tables.DirEgress {
				pp.errorf(where+".networks", "only egress rules have networks peers")
				continue
			}
			if len(peer.Networks) == 0 {
				pp.errorf(where+".networks", "needs at least one CIDR")
			}
			for j, cidr := range peer.Networks {
				if _, err := netip.ParsePrefix(cidr); err != nil {
					pp.errorf(fmt.Sprintf("%s.networks[%d]", where, j), "%q is not a CIDR", cidr)
					continue
				}
				sel, err := ParseCIDR(cidr, nil)
				if err != nil {
					pp.fail(fmt.Sprintf("%s.networks[%d]", where, j), err)
					continue
				}
				// Cluster traffic too, as the API says: the pods
				// inside the prefix, by address.
				sel.networks()
				pp.peers[sel.String()] = sel
				set[sel.String()] = struct{}{}
				for _, pfx := range sel.Prefixes() {
					pp.cidrs[pfx] = struct{}{}
				}
				for _, pfx := range sel.PodNets() {
					pp.podNets[pfx] = struct{}{}
				}
			}
		default:
			sel, err := clusterNetpolPods(where, peer.Namespaces, peer.Pods)
			if err != nil {
				pp.fail(where, err)
				continue
			}
			pp.peers[sel.String()] = sel
			set[sel.String()] = struct{}{}
		}
	}
	for i, proto := range protocols {
		where := fmt.Sprintf("%s.protocols[%d]", path, i)
		pr, err := parseClusterNetpolProtocol(proto)
		if err != nil {
			pp.fail(where, err)
			continue
		}
		if !slices.Contains(out.Ports, pr) {
			out.Ports = append(out.Ports, pr)
		}
	}
	out.Peers = append(out.Peers, slices.Sorted(maps.Keys(set))...)
	return out
}

// domainNameRE is the API's pattern of a DomainName: an exact name of at
// least two labels, or "*." before one.
var domainNameRE = regexp.MustCompile(`^(\*\.)?([a-zA-Z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\.)+[a-zA-Z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\.?$`)

// ParseDomainName returns the FQDN selector of a domainNames entry. The
// API's wildcard "*." matches one or more whole labels ("*.example.com"
// matches www.example.com and a.b.example.com, not example.com), which
// is apiary's (and the reference's) "**." pattern; a name without it
// matches only itself.
func ParseDomainName(name string) (*FQDNPeer, error) {
	if !domainNameRE.MatchString(name) {
		return nil, fmt.Errorf("%q is not a domain name (a name of two labels or more, or one after \"*.\")", name)
	}
	if rest, ok := strings.CutPrefix(name, "*."); ok {
		return ParseFQDN(FQDNSelector{MatchPattern: "**." + rest})
	}
	return ParseFQDN(FQDNSelector{MatchName: name})
}

// parseClusterNetpolProtocol returns a protocol of a rule as a port rule.
func parseClusterNetpolProtocol(p ClusterNetpolProtocol) (tables.PortRule, error) {
	var out tables.PortRule
	n := 0
	var ports *ClusterNetpolPorts
	for _, c := range []struct {
		proto string
		p     *ClusterNetpolPorts
	}{{tables.ProtoTCP, p.TCP}, {tables.ProtoUDP, p.UDP}, {tables.ProtoSCTP, p.SCTP}} {
		if c.p != nil {
			n++
			out.Protocol, ports = c.proto, c.p
		}
	}
	if p.DestinationNamedPort != "" {
		n++
		if !isPortName(p.DestinationNamedPort) {
			return out, fmt.Errorf("destinationNamedPort: %q is not a port name", p.DestinationNamedPort)
		}
		// A named port is a container port of the destination, of
		// whatever protocol it is declared with.
		out = tables.PortRule{Protocol: tables.ProtoAny, Name: p.DestinationNamedPort}
	}
	if n != 1 {
		return out, errors.New("exactly one of tcp, udp, sctp and destinationNamedPort must be set")
	}
	if ports == nil || ports.DestinationPort == nil {
		return out, nil
	}
	dp := ports.DestinationPort
	switch {
	case dp.Range != nil && dp.Number != 0:
		return out, errors.New("destinationPort: number and range are both set; exactly one must be")
	case dp.Range != nil:
		s, e := dp.Range.Start, dp.Range.End
		if s < 1 || s > 65535 || e < s || e > 65535 {
			return out, fmt.Errorf("destinationPort.range: %d-%d is not a range of ports (1-65535, start <= end)", s, e)
		}
		out.Port = uint16(s)
		if e > s {
			out.EndPort = uint16(e)
		}
	default:
		if dp.Number < 1 || dp.Number > 65535 {
			return out, fmt.Errorf("destinationPort.number: %d is not a port number (1-65535)", dp.Number)
		}
		out.Port = uint16(dp.Number)
	}
	return out, nil
}
