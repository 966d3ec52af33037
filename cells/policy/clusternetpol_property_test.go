package policy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/tables"
)

// clusterNetpolVerdict is the decision of one tier of
// ClusterNetworkPolicies ("Admin" or "Baseline"), from the API text: the
// tier's policies in priority order (same priority: apiary's choice, by
// name, which the API leaves open), their rules in the order written; the
// first one whose subject selects the pod and whose peer and protocol
// match decides: "allow" for Accept, "deny" for Deny, "pass" for Pass
// (the next tier decides). "none" when a policy selects the pod with
// rules in dir but none matched (the direction is enforced), "" when none
// selects it. Subjects and peers are pods only: a namespace by its labels
// (with kubernetes.io/metadata.name), a pod by its labels and its
// namespace's.
func (o *oracle) clusterNetpolVerdict(tier string, ep *testPod, dir string, peer peerRef, scope []tables.NamedPort, proto uint8, port uint16) string {
	nsLabels := func(ns string) labels.Set {
		l := labels.Set{"kubernetes.io/metadata.name": ns}
		for k, v := range o.c.namespaces[ns] {
			l[k] = v
		}
		return l
	}
	matches := func(s *metav1.LabelSelector, l labels.Set) bool {
		sel, err := metav1.LabelSelectorAsSelector(s)
		return err == nil && sel.Matches(l)
	}
	selectsPod := func(namespaces *metav1.LabelSelector, pods *selectors.NamespacedPod, p *testPod) bool {
		if p == nil {
			return false // host, world: never a subject or peer
		}
		if namespaces != nil {
			return matches(namespaces, nsLabels(p.ns))
		}
		return matches(&pods.NamespaceSelector, nsLabels(p.ns)) && matches(&pods.PodSelector, labels.Set(p.labels))
	}
	protoMatches := func(ps []selectors.ClusterNetpolProtocol) bool {
		if len(ps) == 0 {
			return true
		}
		for _, pr := range ps {
			if pr.DestinationNamedPort != "" {
				// The number the name stands for in scope; a name of
				// several numbers matches nothing.
				var nums []tables.NamedPort
				for _, np := range scope {
					if np.Name == pr.DestinationNamedPort && !slices.ContainsFunc(nums, func(x tables.NamedPort) bool {
						return x.Port == np.Port && x.Protocol == np.Protocol
					}) {
						nums = append(nums, np)
					}
				}
				byProto := map[string][]uint16{}
				for _, np := range nums {
					byProto[np.Protocol] = append(byProto[np.Protocol], np.Port)
				}
				if ports := byProto[tables.Proto(proto).String()]; len(ports) == 1 && ports[0] == port {
					return true
				}
				continue
			}
			var want string
			var pp *selectors.ClusterNetpolPorts
			switch {
			case pr.TCP != nil:
				want, pp = "TCP", pr.TCP
			case pr.UDP != nil:
				want, pp = "UDP", pr.UDP
			default:
				want, pp = "SCTP", pr.SCTP
			}
			if tables.Proto(proto).String() != want {
				continue
			}
			switch {
			case pp.DestinationPort == nil:
				return true
			case pp.DestinationPort.Range != nil:
				if int32(port) >= pp.DestinationPort.Range.Start && int32(port) <= pp.DestinationPort.Range.End {
					return true
				}
			case int32(port) == pp.DestinationPort.Number:
				return true
			}
		}
		return false
	}
	var admin []*selectors.ClusterNetworkPolicy
	for _, p := range o.admin {
		if p.Spec.Tier == tier {
			admin = append(admin, p)
		}
	}
	slices.SortStableFunc(admin, func(a, b *selectors.ClusterNetworkPolicy) int {
		if a.Spec.Priority != b.Spec.Priority {
			return int(a.Spec.Priority - b.Spec.Priority)
		}
		return strings.Compare(a.Name, b.Name)
	})
	selected := false
	for _, p := range admin {
		if !selectsPod(p.Spec.Subject.Namespaces, p.Spec.Subject.Pods, ep) {
			continue
		}
		type rule struct {
			action    string
			peers     []selectors.ClusterNetpolPeer
			protocols []selectors.ClusterNetpolProtocol
		}
		var rules []rule
		if dir == tables.DirIngress {
			for _, r := range p.Spec.Ingress {
				rules = append(rules, rule{r.Action, r.From, r.Protocols})
			}
		} else {
			for _, r := range p.Spec.Egress {
				rules = append(rules, rule{r.Action, r.To, r.Protocols})
			}
		}
		selected = selected || len(rules) > 0
		for _, r := range rules {
			byNetworks := false
			if !slices.ContainsFunc(r.peers, func(pe selectors.ClusterNetpolPeer) bool {
				if pe.Networks != nil {
					byNetworks = true
					// "cluster-internal traffic will be checked against
					// the rule as well": a pod inside a CIDR (none of
					// the generator's holds the world or the node).
					return peer.pod != nil && peer.pod.addr != "" && slices.ContainsFunc(pe.Networks, func(n string) bool {
						return netip.MustParsePrefix(n).Contains(netip.MustParseAddr(peer.pod.addr))
					})
				}
				return selectsPod(pe.Namespaces, pe.Pods, peer.pod)
			}) || !protoMatches(r.protocols) {
				continue
			}
			// By networks unless a pods or namespaces peer of the rule
			// matches as well.
			o.byNetworks[tier] = byNetworks && !slices.ContainsFunc(r.peers, func(pe selectors.ClusterNetpolPeer) bool {
				return pe.Networks == nil && selectsPod(pe.Namespaces, pe.Pods, peer.pod)
			})
			switch r.action {
			case "Accept":
				return "allow"
			case "Deny":
				return "deny"
			}
			return "pass"
		}
	}
	if selected {
		return "none"
	}
	return ""
}

// clusterNetpol returns a random ClusterNetworkPolicy of either tier,
// with Accept, Deny and Pass rules.
func (g generator) clusterNetpol(i int) string {
	nsSel := func() string {
		switch g.rng.IntN(4) {
		case 0:
			return "{}"
		case 1:
			return fmt.Sprintf("{matchLabels: {kubernetes.io/metadata.name: %s}}", g.pick("alpha", "beta", "gamma"))
		default:
			return fmt.Sprintf("{matchLabels: {env: %s}}", g.pick("dev", "prod"))
		}
	}
	pods := func() string {
		if g.rng.IntN(2) == 0 {
			return "{namespaces: " + nsSel() + "}"
		}
		podSel := fmt.Sprintf("{matchLabels: {app: %s}}", g.pick("web", "api", "db"))
		if g.rng.IntN(4) == 0 {
			podSel = fmt.Sprintf("{matchExpressions: [{key: app, operator: NotIn, values: [%s]}]}", g.pick("web", "api"))
		}
		return "{pods: {namespaceSelector: " + nsSel() + ", podSelector: " + podSel + "}}"
	}
	protocols := func() string {
		switch g.rng.IntN(6) {
		case 0, 1:
			return ""
		case 2:
			return fmt.Sprintf(", protocols: [{%s: {destinationPort: {number: %s}}}]", g.pick("tcp", "udp"), g.pick("80", "8080", "53"))
		case 3:
			return ", protocols: [{tcp: {destinationPort: {range: {start: 8000, end: 9000}}}}, {udp: {}}]"
		default:
			return fmt.Sprintf(", protocols: [{destinationNamedPort: %s}]", g.pick("http", "dns"))
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "tier: %s\npriority: %d\nsubject: %s\n", g.pick("Admin", "Admin", "Baseline"), g.rng.IntN(3), pods())
	for _, dir := range []struct{ name, peer string }{{"ingress", "from"}, {"egress", "to"}} {
		if g.rng.IntN(2) == 0 {
			continue
		}
		var rules []string
		for range 1 + g.rng.IntN(2) {
			peers := pods() + ", " + pods()
			if g.networks && dir.name == "egress" && g.rng.IntN(3) == 0 {
				// Pods by address: each /24 holds pods of both
				// namespaces and labels, /32 one pod, 10.0.0.0/16
				// all, 192.0.2.0/24 none.
				peers = fmt.Sprintf("{networks: [%s]}", g.pick("10.0.0.0/24", "10.0.1.0/24", "10.0.0.12/32", "10.0.0.0/16", "192.0.2.0/24"))
				if g.rng.IntN(3) == 0 {
					peers += ", " + pods()
				}
			}
			if g.rng.IntN(4) == 0 {
				// Every pod: Passes and Baseline rules that meet the
				// CNPs' rules often.
				peers = "{namespaces: {}}"
			}
			rules = append(rules, fmt.Sprintf("{action: %s, %s: [%s]%s}", g.pick("Accept", "Deny", "Pass"), dir.peer, peers, protocols()))
		}
		fmt.Fprintf(&b, "%s: [%s]\n", dir.name, strings.Join(rules, ", "))
	}
	return fmt.Sprintf("apiVersion: policy.networking.k8s.io/v1beta1\nkind: ClusterNetworkPolicy\nmetadata: {name: c%d}\nspec:\n%s", i, indent(b.String()))
}

// TestClusterNetworkPolicyProperty is TestPolicyProperty with
// ClusterNetworkPolicies of both tiers among the CNPs: the Admin tier's
// first matching rule decides (Accept, Deny) or hands over (Pass), then
// the CNPs, then the Baseline tier where no CNP decided, then the
// default.
func TestClusterNetworkPolicyProperty(t *testing.T) {
	testClusterNetworkPolicyProperty(t, 38, false)
}

// TestClusterNetworkPolicyNetworksProperty is TestClusterNetworkPolicyProperty
// with networks peers among the egress rules' peers: a pod whose address
// is inside one of their CIDRs is matched, another pod of the same labels
// is not (the generator's pods of even and odd numbers are in two /24s).
func TestClusterNetworkPolicyNetworksProperty(t *testing.T) {
	paths := testClusterNetworkPolicyProperty(t, 39, true)
	for _, p := range []string{"admin allow by networks", "admin deny by networks", "baseline deny by networks"} {
		if min := 20; !testing.Short() && paths[p] < min {
			t.Errorf("path %q taken %d times, fewer than %d", p, paths[p], min)
		}
	}
}

func testClusterNetworkPolicyProperty(t *testing.T, stream uint64, networks bool) map[string]int {
	paths := runPolicyProperty(t, stream, 10, func(g generator, i int) string {
		g.networks = networks
		if g.rng.IntN(2) == 0 {
			return g.clusterNetpol(i)
		}
		return g.policy(i)
	})
	t.Logf("paths: %v", paths)
	// A run that never takes a path proves nothing of it. (A Pass then
	// a Baseline Accept is rare in these clusters:
	// TestSemanticsClusterNetworkPolicyTiers has it.)
	for _, p := range []string{
		"admin allow", "admin deny", "pass, rules allow", "pass, rules deny", "pass, default deny", "pass, default allow",
		"pass, baseline deny", "baseline deny", "baseline allow", "rules deny", "rules allow",
	} {
		if networks {
			break // the caller checks its own paths
		}
		if min := 20; !testing.Short() && paths[p] < min {
			t.Errorf("path %q taken %d times, fewer than %d", p, paths[p], min)
		}
	}
	return paths
}
