package selectors

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/tools/cache"

	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/tables"
)

// NetworkPolicyKind is networking.k8s.io/v1 NetworkPolicy, which every API
// server serves.
var NetworkPolicyKind = k8s.Kind[*networkingv1.NetworkPolicy]{
	GVK:        networkingv1.SchemeGroupVersion.WithKind("NetworkPolicy"),
	Resource:   "networkpolicies",
	Namespaced: true,
	ListWatch: func(c *k8s.Clientset) cache.ListerWatcher {
		return k8s.NewListWatch(c.Interface, c.NetworkingV1().NetworkPolicies("").List, c.NetworkingV1().NetworkPolicies("").Watch)
	},
}

// NetpolPrefix starts the names of NetworkPolicies in the policies table,
// verdicts and health: "netpol/<namespace>/<name>".
const NetpolPrefix = "netpol/"

// ParseNetworkPolicy parses a NetworkPolicy as the cell does; the error says
// why it is invalid.
func ParseNetworkPolicy(np *networkingv1.NetworkPolicy) (Parsed, error) {
	return parseNetworkPolicy(NetpolPrefix+np.Namespace+"/"+np.Name, np).withAudit(np.Annotations).parsed()
}

// parseNetworkPolicy turns a NetworkPolicy into the spec CNP rules become,
// with the upstream semantics:
//
//   - podSelector selects pods of the policy's namespace only;
//   - the directions are policyTypes; unset, Ingress, and Egress when the
//     policy has egress rules (the API server's default). A direction the
//     policy has is default deny for the pods it selects, even with no rule
//     (ingress: [] or absent); rules of a direction not in policyTypes are
//     ignored, as upstream;
//   - a rule without from/to applies to every peer (the world too), a rule
//     without ports to every port;
//   - a peer is a podSelector (pods of the policy's namespace), a
//     namespaceSelector (pods of the namespaces it selects), both (pods the
//     podSelector selects in those namespaces), or an ipBlock (addresses,
//     pods' too: its selector is a CIDR selector whose allow entries the
//     datapath also applies to the pods whose addresses are inside it, see
//     tables.MatchesPodAddrs);
//   - a port's protocol defaults to TCP; a named port is the destination
//     pod's container port.
//
// A NetworkPolicy only allows. The checks are the API server's, so that a
// policy in --config-dir is refused where kubectl would refuse it.
func parseNetworkPolicy(name string, np *networkingv1.NetworkPolicy) *parsedPolicy {
	p := &parsedPolicy{name: name}
	pp := &policyParser{
		namespace: np.Namespace,
		subjects:  map[string]Selector{},
		peers:     map[string]Selector{},
		cidrs:     map[netip.Prefix]struct{}{},
	}
	spec := &np.Spec
	var ps tables.PolicySpec
	if sel, err := netpolSelector(&spec.PodSelector, nil, np.Namespace); err != nil {
		pp.fail("spec.podSelector", err)
	} else {
		pp.subjects[sel.String()] = sel
		ps.Subject = sel.String()
	}

	ingress, egress := false, false
	if len(spec.PolicyTypes) == 0 {
		ingress, egress = true, len(spec.Egress) > 0
	}
	for i, t := range spec.PolicyTypes {
		switch t {
		case networkingv1.PolicyTypeIngress:
			ingress = true
		case networkingv1.PolicyTypeEgress:
			egress = true
		default:
			pp.errorf(fmt.Sprintf("spec.policyTypes[%d]", i), "%q is neither Ingress nor Egress", t)
			// Fail closed in both: which direction was meant is unknown.
			ingress, egress = true, true
		}
	}
	ps.Ingress, ps.Egress = ingress, egress
	ps.DefaultDenyIngress, ps.DefaultDenyEgress = ingress, egress
	if ingress {
		for i, r := range spec.Ingress {
			ps.Rules = append(ps.Rules, pp.netpolRule(fmt.Sprintf("spec.ingress[%d]", i), tables.DirIngress, "from", r.From, r.Ports))
		}
	}
	if egress {
		for i, r := range spec.Egress {
			ps.Rules = append(ps.Rules, pp.netpolRule(fmt.Sprintf("spec.egress[%d]", i), tables.DirEgress, "to", r.To, r.Ports))
		}
	}
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
	return p
}

// netpolRule parses one ingress or egress rule: its peers (field "from"
// or "to") and its ports.
func (pp *policyParser) netpolRule(path, dir, field string, peers []networkingv1.NetworkPolicyPeer, ports []networkingv1.NetworkPolicyPort) tables.PolicyRule {
	out := tables.PolicyRule{Direction: dir, Peers: []string{}}
	set := map[string]struct{}{}
	if len(peers) == 0 {
		set[tables.AnyPeer] = struct{}{}
	}
	for i, peer := range peers {
		where := fmt.Sprintf("%s.%s[%d]", path, field, i)
		switch {
		case peer.IPBlock != nil && (peer.PodSelector != nil || peer.NamespaceSelector != nil):
			pp.errorf(where, "ipBlock may not be combined with podSelector or namespaceSelector")
		case peer.IPBlock != nil:
			sel, err := parseIPBlock(peer.IPBlock)
			if err != nil {
				pp.fail(where+".ipBlock", err)
				continue
			}
			pp.peers[sel.String()] = sel
			set[sel.String()] = struct{}{}
			for _, pfx := range sel.Prefixes() {
				pp.cidrs[pfx] = struct{}{}
			}
		case peer.PodSelector != nil || peer.NamespaceSelector != nil:
			sel, err := netpolSelector(peer.PodSelector, peer.NamespaceSelector, pp.namespace)
			if err != nil {
				pp.fail(where, err)
				continue
			}
			pp.peers[sel.String()] = sel
			set[sel.String()] = struct{}{}
		default:
			pp.errorf(where, "must specify a peer: podSelector, namespaceSelector or ipBlock")
		}
	}
	for i, port := range ports {
		pr, err := parseNetpolPort(port)
		if err != nil {
			pp.fail(fmt.Sprintf("%s.ports[%d]", path, i), err)
			continue
		}
		if !slices.Contains(out.Ports, pr) {
			out.Ports = append(out.Ports, pr)
		}
	}
	out.Peers = append(out.Peers, slices.Sorted(maps.Keys(set))...)
	return out
}

// netpolSelector returns the label selector of a NetworkPolicy's
// podSelector (pod labels, source k8s) and namespaceSelector (labels of
// the pod's namespace). A nil namespaceSelector means the policy's
// namespace; an empty one every namespace.
func netpolSelector(pods, namespaces *metav1.LabelSelector, namespace string) (*LabelSelector, error) {
	var reqs []requirement
	add := func(field, prefix string, s *metav1.LabelSelector) error {
		if s == nil {
			return nil
		}
		// The API server's checks of keys, values and operators.
		if _, err := metav1.LabelSelectorAsSelector(s); err != nil {
			return fmt.Errorf("%s: %w", field, err)
		}
		for k, v := range s.MatchLabels {
			reqs = append(reqs, requirement{source: tables.SourceK8s, key: prefix + k, op: opIn, values: []string{v}})
		}
		for _, e := range s.MatchExpressions {
			vs := slices.Clone(e.Values)
			slices.Sort(vs)
			reqs = append(reqs, requirement{source: tables.SourceK8s, key: prefix + e.Key, op: string(e.Operator), values: slices.Compact(vs)})
		}
		return nil
	}
	if err := add("podSelector", "", pods); err != nil {
		return nil, err
	}
	switch {
	case namespaces == nil:
		reqs = append(reqs, requirement{source: tables.SourceK8s, key: NamespaceLabel, op: opIn, values: []string{namespace}})
	case len(namespaces.MatchLabels) == 0 && len(namespaces.MatchExpressions) == 0:
		// Every namespace: every pod, never the node or the world.
		reqs = append(reqs, requirement{source: tables.SourceK8s, key: NamespaceLabel, op: opExists})
	default:
		if err := add("namespaceSelector", NamespaceLabelsPrefix, namespaces); err != nil {
			return nil, err
		}
	}
	return newLabelSelector(reqs), nil
}

// parseIPBlock returns the CIDR selector of an ipBlock, checked as the
// API server checks it: a prefix in CIDR notation, each except a strict
// subset of it.
func parseIPBlock(b *networkingv1.IPBlock) (*CIDRSelector, error) {
	if _, err := netip.ParsePrefix(b.CIDR); err != nil {
		return nil, fmt.Errorf("cidr: %q is not a CIDR", b.CIDR)
	}
	sel, err := ParseCIDR(b.CIDR, b.Except)
	if err != nil {
		return nil, err
	}
	sel.ipBlock()
	for i, e := range b.Except {
		ep, err := netip.ParsePrefix(e)
		if err != nil {
			return nil, fmt.Errorf("except[%d]: %q is not a CIDR", i, e)
		}
		if ep.Bits() == sel.Prefix.Bits() {
			return nil, fmt.Errorf("except[%d]: %s is not a strict subset of %s", i, e, b.CIDR)
		}
	}
	return sel, nil
}

// parseNetpolPort returns a NetworkPolicy port as a port rule: protocol
// TCP unless set (TCP, UDP or SCTP), every port of it without port, a
// number (1-65535), a container port name, or a range up to endPort.
func parseNetpolPort(p networkingv1.NetworkPolicyPort) (tables.PortRule, error) {
	out := tables.PortRule{Protocol: tables.ProtoTCP}
	if p.Protocol != nil {
		switch proto := string(*p.Protocol); proto {
		case tables.ProtoTCP, tables.ProtoUDP, tables.ProtoSCTP:
			out.Protocol = proto
		default:
			return out, &portFieldError{"protocol", fmt.Sprintf("%q is not TCP, UDP or SCTP", proto)}
		}
	}
	if p.Port == nil {
		if p.EndPort != nil {
			return out, &portFieldError{"endPort", "needs a port to start the range at"}
		}
		return out, nil
	}
	switch p.Port.Type {
	case intstr.Int:
		n := p.Port.IntVal
		if n < 1 || n > 65535 {
			return out, &portFieldError{"port", fmt.Sprintf("%d is not a port number (1-65535)", n)}
		}
		out.Port = uint16(n)
	default:
		name := p.Port.StrVal
		if !isPortName(name) {
			return out, &portFieldError{"port", fmt.Sprintf("%q is not a port name "+
				"(1-15 lowercase letters, digits and '-', with a letter, without '-' at either end or twice in a row)", name)}
		}
		out.Name = name
	}
	if p.EndPort != nil {
		end := *p.EndPort
		switch {
		case out.Name != "":
			return out, &portFieldError{"endPort", fmt.Sprintf("%d needs a numeric port, not the port name %q", end, out.Name)}
		case end < int32(out.Port) || end > 65535:
			return out, &portFieldError{"endPort", fmt.Sprintf("%d is not a port from port %d to 65535", end, out.Port)}
		case end > int32(out.Port):
			out.EndPort = uint16(end)
		}
	}
	return out, nil
}
