package selectors

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/cache"

	"github.com/apiary-net/apiary/cells/k8s"
)

// GroupVersion is cilium.io/v2, the API group of the policy kinds. The
// types below are apiary's own, holding the subset of the CRDs apiary
// understands; fields they don't have are ignored when decoding, so
// existing policies load unchanged.
var GroupVersion = schema.GroupVersion{Group: "cilium.io", Version: "v2"}

// CiliumNetworkPolicy is a namespaced policy.
type CiliumNetworkPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`

	// Spec is a single rule; Specs a list of them. Both may be set.
	Spec  *Rule  `json:"spec,omitempty"`
	Specs []Rule `json:"specs,omitempty"`

	// unknown and unsupported are the fields UnmarshalJSON found no place
	// for (see UnknownFields and UnsupportedFields).
	unknown, unsupported []string
}

// CiliumClusterwideNetworkPolicy is a cluster-scoped policy: its selectors
// are not restricted to a namespace.
type CiliumClusterwideNetworkPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`

	Spec  *Rule  `json:"spec,omitempty"`
	Specs []Rule `json:"specs,omitempty"`

	// unknown and unsupported are the fields UnmarshalJSON found no place
	// for (see UnknownFields and UnsupportedFields).
	unknown, unsupported []string
}

// Rule selects endpoints and says what they may and may not talk to.
// Fields unknown inside the four rule lists make the policy invalid (see
// the apiary:"strict" tag and unknown.go); elsewhere they are ignored.
type Rule struct {
	EndpointSelector *EndpointSelector `json:"endpointSelector,omitempty"`
	Ingress          []IngressRule     `json:"ingress,omitempty" apiary:"strict"`
	IngressDeny      []IngressRule     `json:"ingressDeny,omitempty" apiary:"strict"`
	Egress           []EgressRule      `json:"egress,omitempty" apiary:"strict"`
	// EgressDeny shares EgressRule's fields, but ToFQDNs is an error in it
	// (as in the reference, which has no such field there).
	EgressDeny        []EgressRule       `json:"egressDeny,omitempty" apiary:"strict"`
	EnableDefaultDeny *DefaultDenyConfig `json:"enableDefaultDeny,omitempty"`
	Description       string             `json:"description,omitempty"`
}

// DefaultDenyConfig says per direction whether a rule puts the endpoints
// it selects into default deny there; unset means yes (when the rule has
// rules in that direction).
type DefaultDenyConfig struct {
	Ingress *bool `json:"ingress,omitempty"`
	Egress  *bool `json:"egress,omitempty"`
}

// EndpointSelector is a Kubernetes label selector over security labels.
// Keys may carry a source ("k8s:app"); without one they match any source.
type EndpointSelector struct {
	MatchLabels      map[string]string          `json:"matchLabels,omitempty"`
	MatchExpressions []LabelSelectorRequirement `json:"matchExpressions,omitempty"`
}

// LabelSelectorRequirement is one matchExpressions entry.
type LabelSelectorRequirement struct {
	Key      string   `json:"key"`
	Operator string   `json:"operator"`
	Values   []string `json:"values,omitempty"`
}

// IngressRule lists peers allowed in (or, in ingressDeny, denied), on
// ToPorts or every port. An absent peer list and an empty one differ: a
// rule without peers applies to every peer, a rule with an empty list
// (fromEndpoints: []) to none, as in the reference. The lists are tagged
// omitzero so that copies through JSON keep the difference.
type IngressRule struct {
	FromEndpoints []EndpointSelector `json:"fromEndpoints,omitzero"`
	FromCIDR      []string           `json:"fromCIDR,omitzero"`
	FromCIDRSet   []CIDRRule         `json:"fromCIDRSet,omitzero"`
	FromEntities  []string           `json:"fromEntities,omitzero"`
	ToPorts       []PortRule         `json:"toPorts,omitempty"`
}

// EgressRule lists peers allowed out (or, in egressDeny, denied), on
// ToPorts or every port. Absent and empty peer lists differ as in
// IngressRule.
type EgressRule struct {
	ToEndpoints []EndpointSelector `json:"toEndpoints,omitzero"`
	ToCIDR      []string           `json:"toCIDR,omitzero"`
	ToCIDRSet   []CIDRRule         `json:"toCIDRSet,omitzero"`
	ToFQDNs     []FQDNSelector     `json:"toFQDNs,omitempty"`
	ToEntities  []string           `json:"toEntities,omitzero"`
	ToPorts     []PortRule         `json:"toPorts,omitempty"`
}

// CIDRRule is a prefix minus the prefixes in Except.
type CIDRRule struct {
	CIDR   string   `json:"cidr"`
	Except []string `json:"except,omitempty"`
}

// FQDNSelector selects peers by DNS name (resolved by the DNS proxy).
type FQDNSelector struct {
	MatchName    string `json:"matchName,omitempty"`
	MatchPattern string `json:"matchPattern,omitempty"`
}

// PortRule is one toPorts entry: the ports a rule is limited to. L7
// fields (rules other than dns, serverNames, listener, …) are not
// supported.
type PortRule struct {
	Ports []PortProtocol `json:"ports,omitempty"`
	// Rules holds the L7 rules; only DNS rules are accepted.
	Rules *L7Rules `json:"rules,omitempty"`
}

// L7Rules are a toPorts entry's L7 rules. DNS rules (egress only) are
// enforced: the endpoint's DNS is intercepted by the DNS proxy, which
// refuses names the rules do not list (docs/fqdn.md); the entry's ports
// (53) are enforced as L4 rules. Each DNS rule is a FQDNSelector (matchName
// or matchPattern); an empty list allows every name. Any other kind (http,
// kafka, …) makes the policy invalid.
type L7Rules struct {
	DNS []json.RawMessage `json:"dns,omitempty"`
}

// PortProtocol is a port, a range of ports or a named port, of one
// protocol (TCP, UDP, SCTP or ANY, the default).
type PortProtocol struct {
	// Port is a number ("0" or empty: every port) or a named container
	// port.
	Port PortValue `json:"port,omitempty"`
	// EndPort is the last port of a range starting at Port.
	EndPort  PortValue `json:"endPort,omitempty"`
	Protocol string    `json:"protocol,omitempty"`
}

// PortValue is a port field as written: the CRD has port as a string and
// endPort as a number, and people write either way, so both decode here
// and parsePolicy validates the text (a bad value then makes the policy
// invalid with its path, rather than failing the whole decode).
type PortValue string

// UnmarshalJSON implements json.Unmarshaler: a string as it is, anything
// else as its JSON text.
func (v *PortValue) UnmarshalJSON(data []byte) error {
	var s string
	if err := json.Unmarshal(data, &s); err == nil {
		*v = PortValue(s)
		return nil
	}
	*v = PortValue(strings.TrimSpace(string(data)))
	return nil
}

// CiliumNetworkPolicyList is a list of CiliumNetworkPolicy.
type CiliumNetworkPolicyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata"`
	Items           []CiliumNetworkPolicy `json:"items"`
}

// CiliumClusterwideNetworkPolicyList is a list of
// CiliumClusterwideNetworkPolicy.
type CiliumClusterwideNetworkPolicyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata"`
	Items           []CiliumClusterwideNetworkPolicy `json:"items"`
}

// deepCopy copies through JSON: the types hold only JSON data, and copies
// are rare (informer stores hand out shared objects).
func deepCopy[T any](in *T) *T {
	out := new(T)
	data, err := json.Marshal(in)
	if err == nil {
		err = json.Unmarshal(data, out)
	}
	if err != nil {
		panic(fmt.Sprintf("deep copy %T: %v", in, err)) // can't happen for these types
	}
	return out
}

// DeepCopyObject implements runtime.Object.
func (p *CiliumNetworkPolicy) DeepCopyObject() runtime.Object {
	out := deepCopy(p)
	out.unknown, out.unsupported = slices.Clone(p.unknown), slices.Clone(p.unsupported)
	return out
}

// DeepCopyObject implements runtime.Object.
func (p *CiliumClusterwideNetworkPolicy) DeepCopyObject() runtime.Object {
	out := deepCopy(p)
	out.unknown, out.unsupported = slices.Clone(p.unknown), slices.Clone(p.unsupported)
	return out
}

// DeepCopyObject implements runtime.Object.
func (l *CiliumNetworkPolicyList) DeepCopyObject() runtime.Object { return deepCopy(l) }

// DeepCopyObject implements runtime.Object.
func (l *CiliumClusterwideNetworkPolicyList) DeepCopyObject() runtime.Object { return deepCopy(l) }

// CNPKind is cilium.io/v2 CiliumNetworkPolicy.
var CNPKind = k8s.Kind[*CiliumNetworkPolicy]{
	GVK:        GroupVersion.WithKind("CiliumNetworkPolicy"),
	Resource:   "ciliumnetworkpolicies",
	Namespaced: true,
	// Cilium's CRD, which apiary does not ship: without it, no policies.
	Optional: true,
	ListWatch: func(c *k8s.Clientset) cache.ListerWatcher {
		return k8s.CustomResourceListWatch[*CiliumNetworkPolicy, *CiliumNetworkPolicyList](c, GroupVersion.WithResource("ciliumnetworkpolicies"))
	},
}

// CCNPKind is cilium.io/v2 CiliumClusterwideNetworkPolicy.
var CCNPKind = k8s.Kind[*CiliumClusterwideNetworkPolicy]{
	GVK:        GroupVersion.WithKind("CiliumClusterwideNetworkPolicy"),
	Resource:   "ciliumclusterwidenetworkpolicies",
	Namespaced: false,
	// Cilium's CRD, which apiary does not ship: without it, no policies.
	Optional: true,
	ListWatch: func(c *k8s.Clientset) cache.ListerWatcher {
		return k8s.CustomResourceListWatch[*CiliumClusterwideNetworkPolicy, *CiliumClusterwideNetworkPolicyList](c, GroupVersion.WithResource("ciliumclusterwidenetworkpolicies"))
	},
}
