package policy

// The semantics of Kubernetes NetworkPolicy (networking.k8s.io/v1, issue
// 26), rule by rule, with the traps the upstream API documents. Every case
// runs twice: with the policies as the API server hands them to the
// informer (created in a fake clientset and read back) and as the
// --config-dir decoder reads them.

import (
	"context"
	"fmt"
	"testing"

	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/tables"
)

// The input paths of a NetworkPolicy.
const (
	pathK8s       = "k8s"
	pathConfigDir = "config-dir"
)

// decodeNetworkPolicy returns the NetworkPolicy of doc as it reaches the
// selectors cell through path: pathK8s creates it in a fake clientset and
// gets it back through the typed client the informer uses; pathConfigDir
// decodes it with the --config-dir decoder (which, like the API server,
// puts an object without a namespace in "default"). Without a path, the
// k8s one.
func decodeNetworkPolicy(t testing.TB, doc, path string) *networkingv1.NetworkPolicy {
	t.Helper()
	if path == pathConfigDir {
		kinds := k8s.NewKinds()
		if err := k8s.RegisterKind(kinds, selectors.NetworkPolicyKind); err != nil {
			t.Fatal(err)
		}
		decoded, err := k8s.DecodeFile("netpol.yaml", []byte(doc), kinds)
		if err != nil || len(decoded) != 1 {
			t.Fatalf("config dir: %d objects, %v\n%s", len(decoded), err, doc)
		}
		return decoded[0].Object.(*networkingv1.NetworkPolicy)
	}
	var np networkingv1.NetworkPolicy
	if err := yaml.UnmarshalStrict([]byte(doc), &np); err != nil {
		t.Fatalf("bad test YAML: %v\n%s", err, doc)
	}
	if np.Namespace == "" {
		np.Namespace = "default"
	}
	c := fake.NewClientset()
	ctx := context.Background()
	if _, err := c.NetworkingV1().NetworkPolicies(np.Namespace).Create(ctx, &np, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	list, err := c.NetworkingV1().NetworkPolicies("").List(ctx, metav1.ListOptions{})
	if err != nil || len(list.Items) != 1 {
		t.Fatalf("k8s: %v", err)
	}
	return &list.Items[0]
}

func netpol(ns, name, spec string) string {
	return fmt.Sprintf("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: %s, namespace: %s}\nspec:\n%s", name, ns, indent(spec))
}

// runNetpolCases runs each case through both input paths.
func runNetpolCases(t *testing.T, cases []semanticsCase) {
	t.Helper()
	for _, path := range []string{pathK8s, pathConfigDir} {
		t.Run(path, func(t *testing.T) {
			for _, tc := range cases {
				for _, shareMin := range []int{0, 1} {
					name := tc.name
					if shareMin > 0 {
						name += ",shared"
					}
					t.Run(name, func(t *testing.T) {
						m := newAgentModel(t, tc.cluster.localhost)
						m.netpolPath = path
						c := tc.cluster
						c.shareMin = shareMin
						m.apply(c)
						for _, p := range tc.probes {
							if got := m.verdictOf(p); got != p.want {
								t.Errorf("%s: %s, want %s (upstream's)\nentries of %s: %v", p, got, p.want, p.ep, m.out.list(p.ep))
							}
						}
					})
				}
			}
		})
	}
}

func udp(p probe) probe  { p.proto = protoUDP; return p }
func sctp(p probe) probe { p.proto = 132; return p }
func withCIDRs(c cluster, cidrs ...string) cluster {
	c.cidrs = cidrs
	return c
}

// podSelector selects pods of the policy's namespace; policyTypes and its
// defaults decide the directions; an empty rule list and no rule at all
// both deny, a rule without peers and ports allows everything.
func TestNetpolDirections(t *testing.T) {
	runNetpolCases(t, []semanticsCase{
		{"default deny ingress: podSelector {} in its namespace only", baseCluster(netpol("beta", "deny", `
podSelector: {}
policyTypes: [Ingress]`)), []probe{
			in("beta/web", "beta/client", 80, "deny"),
			in("beta/server", "alpha/web", 80, "deny"),
			in("beta/web", "host", 80, "allow"), // --allow-localhost=always
			in("alpha/web", "beta/client", 80, "allow"),
			out("beta/web", "beta/client", 80, "allow"),
		}},
		{"no policyTypes and no rules: Ingress", baseCluster(netpol("beta", "deny", `
podSelector: {matchLabels: {app: web}}`)), []probe{
			in("beta/web", "beta/client", 80, "deny"),
			in("beta/server", "beta/client", 80, "allow"),
			out("beta/web", "world", 80, "allow"),
		}},
		{"ingress: [{}] allows everything, the world too", baseCluster(netpol("beta", "all", `
podSelector: {}
ingress: [{}]`)), []probe{
			in("beta/web", "beta/client", 80, "allow"),
			in("beta/web", "alpha/web", 9999, "allow"),
			in("beta/web", "world", 443, "allow"),
			udp(in("beta/web", "world", 53, "allow")),
		}},
		{"ingress: [] with Ingress denies everything", baseCluster(netpol("beta", "none", `
podSelector: {}
policyTypes: [Ingress]
ingress: []`)), []probe{
			in("beta/web", "beta/client", 80, "deny"),
			in("beta/web", "world", 443, "deny"),
		}},
		{"policyTypes [Egress] without egress rules denies all egress, not ingress", baseCluster(netpol("beta", "no-egress", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]`)), []probe{
			out("beta/client", "beta/server", 80, "deny"),
			out("beta/client", "world", 443, "deny"),
			udp(out("beta/client", "world", 53, "deny")),
			in("beta/client", "beta/web", 80, "allow"),
			out("beta/web", "beta/server", 80, "allow"),
		}},
		{"egress rules without policyTypes: Ingress and Egress", baseCluster(netpol("beta", "both", `
podSelector: {matchLabels: {app: client}}
egress: [{to: [{podSelector: {matchLabels: {app: server}}}]}]`)), []probe{
			out("beta/client", "beta/server", 80, "allow"),
			out("beta/client", "beta/web", 80, "deny"),
			in("beta/client", "beta/server", 80, "deny"),
		}},
		{"rules of a direction not in policyTypes are ignored", baseCluster(netpol("beta", "ingress-only", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Ingress]
ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]
egress: [{to: [{podSelector: {matchLabels: {app: server}}}]}]`)), []probe{
			in("beta/client", "beta/web", 80, "allow"),
			in("beta/client", "beta/server", 80, "deny"),
			out("beta/client", "beta/web", 80, "allow"),
			out("beta/client", "world", 80, "allow"),
		}},
		{"egress: [{}] allows everything out", baseCluster(netpol("beta", "out", `
podSelector: {}
policyTypes: [Ingress, Egress]
egress: [{}]`)), []probe{
			out("beta/client", "world", 443, "allow"),
			out("beta/client", "alpha/web", 80, "allow"),
			in("beta/client", "alpha/web", 80, "deny"),
		}},
	})
}

// Peers: podSelector in the policy's namespace, namespaceSelector, both in
// one peer (AND), in separate peers (OR), an empty podSelector beside a
// namespaceSelector, namespaces by name.
func TestNetpolPeers(t *testing.T) {
	runNetpolCases(t, []semanticsCase{
		{"podSelector: the policy's namespace", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]`)), []probe{
			in("beta/server", "beta/web", 80, "allow"),
			in("beta/server", "alpha/web", 80, "deny"),
			in("beta/server", "beta/client", 80, "deny"),
		}},
		{"podSelector {}: every pod of the policy's namespace, nothing else", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{podSelector: {}}]}]`)), []probe{
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "alpha/web", 80, "deny"),
			in("beta/server", "world", 80, "deny"),
		}},
		{"namespaceSelector: pods of the namespaces it selects", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{namespaceSelector: {matchLabels: {env: dev}}}]}]`)), []probe{
			in("beta/server", "alpha/web", 80, "allow"),
			in("beta/server", "gamma/server", 80, "allow"),
			in("beta/server", "beta/client", 80, "deny"),
			in("beta/server", "world", 80, "deny"),
		}},
		{"both in one peer: AND", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress:
- from:
  - namespaceSelector: {matchLabels: {env: dev}}
    podSelector: {matchLabels: {app: server}}`)), []probe{
			in("beta/server", "gamma/server", 80, "allow"),
			in("beta/server", "alpha/web", 80, "deny"),
			in("beta/server", "beta/client", 80, "deny"),
		}},
		{"separate peers: OR", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress:
- from:
  - namespaceSelector: {matchLabels: {env: dev}}
  - podSelector: {matchLabels: {app: web}}`)), []probe{
			in("beta/server", "alpha/web", 80, "allow"),
			in("beta/server", "gamma/server", 80, "allow"),
			in("beta/server", "beta/web", 80, "allow"),
			in("beta/server", "beta/client", 80, "deny"),
		}},
		{"trap: podSelector {} beside a namespaceSelector is every pod of those namespaces", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress:
- from:
  - namespaceSelector: {matchLabels: {env: dev}}
    podSelector: {}`)), []probe{
			in("beta/server", "alpha/web", 80, "allow"),
			in("beta/server", "gamma/server", 80, "allow"),
			in("beta/server", "beta/client", 80, "deny"), // not the policy's namespace
		}},
		{"namespaceSelector {}: every pod, not the world", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{namespaceSelector: {}}]}]`)), []probe{
			in("beta/server", "alpha/web", 80, "allow"),
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "world", 80, "deny"),
		}},
		{"a namespace by name: kubernetes.io/metadata.name", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: alpha}}}]}]`)), []probe{
			in("beta/server", "alpha/web", 80, "allow"),
			in("beta/server", "gamma/server", 80, "deny"),
		}},
		{"matchExpressions on pods and namespaces", baseCluster(netpol("beta", "p", `
podSelector: {matchExpressions: [{key: app, operator: In, values: [server, web]}]}
egress:
- to:
  - namespaceSelector: {matchExpressions: [{key: env, operator: NotIn, values: [prod]}]}
    podSelector: {matchExpressions: [{key: app, operator: Exists}]}`)), []probe{
			out("beta/server", "alpha/web", 80, "allow"),
			out("beta/web", "gamma/server", 80, "allow"),
			out("beta/web", "beta/server", 80, "deny"),
			out("beta/client", "beta/server", 80, "allow"), // not selected
		}},
		{"egress to peers", baseCluster(netpol("alpha", "p", `
podSelector: {}
policyTypes: [Egress]
egress: [{to: [{namespaceSelector: {matchLabels: {env: prod}}, podSelector: {matchLabels: {app: server}}}]}]`)), []probe{
			out("alpha/web", "beta/server", 80, "allow"),
			out("alpha/web", "beta/web", 80, "deny"),
			out("alpha/web", "gamma/server", 80, "deny"),
		}},
	})
}

// withPodAddrs gives the pods of c addresses: 10.244.<n>.<n> for the n-th.
func withPodAddrs(c cluster) cluster {
	for i := range c.pods {
		c.pods[i].addr = fmt.Sprintf("10.244.%d.%d", i+1, i+1)
	}
	return c
}

// Addresses withPodAddrs gives the pods of baseCluster.
const (
	addrAlphaWeb    = "10.244.1.1"
	addrBetaClient  = "10.244.3.3"
	addrBetaServer  = "10.244.4.4"
	addrGammaServer = "10.244.5.5"
)

// ipBlock selects addresses, less its excepts: those outside the cluster
// by their CIDR identities, and, unlike the reference, pods' addresses
// inside it too, as upstream's suite expects (its "egress access to server
// in CIDR block" tests). A CNP's CIDR rule still selects no pod, as in the
// reference, and a deny of a pod still wins.
func TestNetpolIPBlock(t *testing.T) {
	runNetpolCases(t, []semanticsCase{
		{"ipBlock with except", withCIDRs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: 192.0.2.0/24, except: [192.0.2.128/25]}}]}]`)), "192.0.2.0/24", "192.0.2.128/25"), []probe{
			out("beta/client", "cidr:192.0.2.0/24", 443, "allow"),
			out("beta/client", "cidr:192.0.2.128/25", 443, "deny"),
			out("beta/client", "world", 443, "deny"),
		}},
		{"0.0.0.0/0: the world and every pod, by address", withPodAddrs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{ipBlock: {cidr: 0.0.0.0/0}}]}]`))), []probe{
			in("beta/server", "world", 80, "allow"),
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "alpha/web", 80, "allow"),
			in("beta/server", "host", 80, "allow"), // --allow-localhost=always
		}},
		{"ipBlock or pods", withCIDRs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress:
- from:
  - ipBlock: {cidr: 198.51.100.0/24}
  - podSelector: {matchLabels: {app: client}}
  ports: [{port: 443}]`)), "198.51.100.0/24"), []probe{
			in("beta/server", "cidr:198.51.100.0/24", 443, "allow"),
			in("beta/server", "beta/client", 443, "allow"),
			in("beta/server", "beta/client", 80, "deny"),
			in("beta/server", "world", 443, "deny"),
		}},
		// Upstream: "should allow egress access to server in CIDR block".
		{"a pod's /32: that pod, no other", withPodAddrs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: `+addrBetaServer+`/32}}]}]`))), []probe{
			out("beta/client", "beta/server", 80, "allow"),
			out("beta/client", "gamma/server", 80, "deny"),
			out("beta/client", "alpha/web", 80, "deny"),
			out("beta/client", "world", 80, "deny"),
		}},
		// Upstream: "should enforce except clause while egress access to
		// server in CIDR block" (makeLargeCIDRForIP: a /4).
		{"a large block less a pod's /32", withPodAddrs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: 0.0.0.0/4, except: [`+addrBetaServer+`/32]}}], ports: [{port: 80}]}]`))), []probe{
			out("beta/client", "beta/server", 80, "deny"),
			out("beta/client", "gamma/server", 80, "allow"),
			out("beta/client", "alpha/web", 80, "allow"),
			out("beta/client", "alpha/web", 81, "deny"),
		}},
		// Upstream: "should ensure an IP overlapping both IPBlock.CIDR and
		// IPBlock.Except is allowed": another policy allows the except.
		{"an except another policy allows", withPodAddrs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: 0.0.0.0/4, except: [`+addrBetaServer+`/32]}}]}]`), netpol("beta", "q", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: `+addrBetaServer+`/32}}]}]`))), []probe{
			out("beta/client", "beta/server", 80, "allow"),
			out("beta/client", "gamma/server", 80, "allow"),
		}},
		{"ingress from a block: the pods inside it", withPodAddrs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{ipBlock: {cidr: 10.244.0.0/16, except: [`+addrGammaServer+`/32]}}]}]`))), []probe{
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "alpha/web", 80, "allow"),
			in("beta/server", "gamma/server", 80, "deny"),
			in("beta/server", "world", 80, "deny"),
		}},
		{"a CNP's toCIDR selects no pod", withPodAddrs(baseCluster(cnp("beta", "c", `
endpointSelector: {matchLabels: {app: client}}
egress: [{toCIDR: [10.244.0.0/16]}]`))), []probe{
			out("beta/client", "beta/server", 80, "deny"),
			out("beta/client", "alpha/web", 80, "deny"),
		}},
		{"a CNP's toCIDR of the block takes nothing from the ipBlock", withPodAddrs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: 10.244.0.0/16}}], ports: [{port: 80}]}]`), cnp("beta", "c", `
endpointSelector: {matchLabels: {app: client}}
egress: [{toCIDR: [10.244.0.0/16], toPorts: [{ports: [{port: "80", protocol: TCP}, {port: "443", protocol: TCP}]}]}]`))), []probe{
			out("beta/client", "beta/server", 80, "allow"),
			out("beta/client", "beta/server", 443, "deny"),
		}},
		{"an ipBlock allowing all ports inside a CNP's CIDR port", withPodAddrs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: 10.244.0.0/16}}]}]`), cnp("beta", "c", `
endpointSelector: {matchLabels: {app: client}}
egress: [{toCIDR: [10.244.0.0/16], toPorts: [{ports: [{port: "80", protocol: TCP}]}]}]`))), []probe{
			out("beta/client", "beta/server", 80, "allow"),
			out("beta/client", "beta/server", 81, "allow"),
		}},
		{"a CNP deny of the pod still wins", withPodAddrs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: 10.244.0.0/16}}]}]`), cnp("beta", "d", `
endpointSelector: {matchLabels: {app: client}}
egressDeny: [{toEndpoints: [{matchLabels: {app: server}}]}]`))), []probe{
			out("beta/client", "beta/server", 80, "deny"),
			out("beta/client", "alpha/web", 80, "allow"),
		}},
	})
}

// Ports: a number, protocol TCP by default, UDP and SCTP, every port of a
// protocol, endPort, a named port (the destination pod's).
func TestNetpolPorts(t *testing.T) {
	twoHTTP := baseCluster()
	twoHTTP.pods = append(twoHTTP.pods, testPod{ns: "beta", name: "web2", labels: map[string]string{"app": "web"},
		ports: []tables.NamedPort{{Name: "http", Port: 8080, Protocol: "TCP"}}})
	oneHTTP := baseCluster()
	oneHTTP.pods[0].ports = nil // alpha/web: beta/server alone names http
	withPolicies := func(c cluster, docs ...string) cluster {
		c.policies = docs
		return c
	}
	runNetpolCases(t, []semanticsCase{
		{"a number: TCP unless said", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress: [{ports: [{port: 80}, {port: 53, protocol: UDP}, {port: 3868, protocol: SCTP}]}]`)), []probe{
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "world", 80, "allow"), // no from: every peer
			udp(in("beta/server", "beta/client", 80, "deny")),
			in("beta/server", "beta/client", 81, "deny"),
			udp(in("beta/server", "beta/client", 53, "allow")),
			in("beta/server", "beta/client", 53, "deny"),
			sctp(in("beta/server", "beta/client", 3868, "allow")),
		}},
		{"a protocol without port: its every port", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{ports: [{protocol: UDP}]}]`)), []probe{
			udp(out("beta/client", "world", 53, "allow")),
			udp(out("beta/client", "beta/server", 9999, "allow")),
			out("beta/client", "world", 53, "deny"),
		}},
		{"endPort", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{podSelector: {}}], ports: [{port: 8000, endPort: 8100}]}]`)), []probe{
			in("beta/server", "beta/client", 7999, "deny"),
			in("beta/server", "beta/client", 8000, "allow"),
			in("beta/server", "beta/client", 8050, "allow"),
			in("beta/server", "beta/client", 8100, "allow"),
			in("beta/server", "beta/client", 8101, "deny"),
		}},
		{"a named port on ingress: each selected pod's own number", withPolicies(twoHTTP, netpol("beta", "p", `
podSelector: {matchLabels: {app: web}}
ingress: [{ports: [{port: http}]}]`)), []probe{
			in("beta/web2", "beta/client", 8080, "allow"),
			in("beta/web2", "beta/client", 9090, "deny"),
			in("beta/web", "beta/client", 8080, "deny"), // beta/web has no port http
		}},
		{"a named port on ingress: different numbers on different pods", withPolicies(twoHTTP, netpol("beta", "p", `
podSelector: {}
ingress: [{from: [{podSelector: {matchLabels: {app: client}}}], ports: [{port: http}]}]`)), []probe{
			in("beta/server", "beta/client", 9090, "allow"),
			in("beta/server", "beta/client", 8080, "deny"),
			in("beta/web2", "beta/client", 8080, "allow"),
			in("beta/web2", "beta/client", 9090, "deny"),
		}},
		{"a named port on egress: the destination's", withPolicies(oneHTTP, netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{podSelector: {matchLabels: {app: server}}}], ports: [{port: http}]}]`)), []probe{
			out("beta/client", "beta/server", 9090, "allow"),
			out("beta/client", "beta/server", 8080, "deny"),
		}},
		// A departure (docs/policy.md): egress names are looked up among
		// the pods of this node, where http is 8080 (alpha/web) and 9090
		// (beta/server): ambiguous, the rule uses neither, and the
		// policy's row says so.
		{"a named port on egress with two numbers on this node: neither", baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{podSelector: {matchLabels: {app: server}}}], ports: [{port: http}]}]`)), []probe{
			out("beta/client", "beta/server", 9090, "deny"),
			out("beta/client", "beta/server", 8080, "deny"),
		}},
	})
}

// NetworkPolicies only allow: unioned with each other and with CNPs, whose
// denies still win.
func TestNetpolUnion(t *testing.T) {
	runNetpolCases(t, []semanticsCase{
		{"two NetworkPolicies: either allows", baseCluster(
			netpol("beta", "a", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]`),
			netpol("beta", "b", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{podSelector: {matchLabels: {app: client}}}], ports: [{port: 443}]}]`)), []probe{
			in("beta/server", "beta/web", 80, "allow"),
			in("beta/server", "beta/client", 443, "allow"),
			in("beta/server", "beta/client", 80, "deny"),
		}},
		{"a NetworkPolicy and a CNP: either allows", baseCluster(
			netpol("beta", "a", `
podSelector: {matchLabels: {app: server}}
ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]`),
			cnp("beta", "b", `
endpointSelector: {matchLabels: {app: server}}
ingress: [{fromEntities: [world]}]`)), []probe{
			in("beta/server", "beta/web", 80, "allow"),
			in("beta/server", "world", 80, "allow"),
			in("beta/server", "beta/client", 80, "deny"),
		}},
		{"a CNP deny beats a NetworkPolicy allow", baseCluster(
			netpol("beta", "all", `
podSelector: {}
ingress: [{}]`),
			cnp("beta", "deny", `
endpointSelector: {matchLabels: {app: server}}
ingressDeny: [{fromEndpoints: [{matchLabels: {app: client}}], toPorts: [{ports: [{port: "443"}]}]}]`)), []probe{
			in("beta/server", "beta/client", 443, "deny"),
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "beta/web", 443, "allow"),
		}},
	})
}

// Upstream's "should ensure an IP overlapping both IPBlock.CIDR and
// IPBlock.Except is allowed" as it runs: the policy allowing a /4 less a
// pod's /32 is then updated to allow that /32 alone, on the same agent.
func TestNetpolIPBlockUpdate(t *testing.T) {
	block := func(to string) cluster {
		return withPodAddrs(baseCluster(netpol("beta", "p", `
podSelector: {matchLabels: {app: client}}
policyTypes: [Egress]
egress: [{to: [{ipBlock: `+to+`}]}]`)))
	}
	for _, path := range []string{pathK8s, pathConfigDir} {
		t.Run(path, func(t *testing.T) {
			m := newAgentModel(t, "")
			m.netpolPath = path
			for _, step := range []struct {
				cluster cluster
				probes  []probe
			}{
				{block(`{cidr: 0.0.0.0/4, except: [` + addrBetaServer + `/32]}`), []probe{
					out("beta/client", "beta/server", 80, "deny"),
					out("beta/client", "gamma/server", 80, "allow"),
				}},
				{block(`{cidr: ` + addrBetaServer + `/32}`), []probe{
					out("beta/client", "beta/server", 80, "allow"),
					out("beta/client", "gamma/server", 80, "deny"),
					out("beta/client", "alpha/web", 80, "deny"),
				}},
			} {
				m.apply(step.cluster)
				for _, p := range step.probes {
					if got := m.verdictOf(p); got != p.want {
						t.Errorf("%s: %s, want %s (upstream's)\nentries of %s: %v", p, got, p.want, p.ep, m.out.list(p.ep))
					}
				}
			}
		})
	}
}
