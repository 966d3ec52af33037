package policy

import (
	"encoding/json"
	"fmt"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/tables"
)

// clusterNetpolDoc returns a ClusterNetworkPolicy of the tier and priority.
func clusterNetpolDoc(name, tier string, priority int, spec string) string {
	return fmt.Sprintf("apiVersion: policy.networking.k8s.io/v1beta1\nkind: ClusterNetworkPolicy\nmetadata: {name: %s}\nspec:\n%s",
		name, indent(fmt.Sprintf("tier: %s\npriority: %d\n%s", tier, priority, spec)))
}

// The tiers of ClusterNetworkPolicy (network-policy-api v1beta1): the
// Admin tier in priority order, then NetworkPolicy and CNP, then the
// Baseline tier where no NetworkPolicy or CNP decided, then the default.
// Pods of baseCluster: alpha/web, beta/web, beta/client, beta/server,
// gamma/server.
func TestSemanticsClusterNetworkPolicyTiers(t *testing.T) {
	const betaServer = "subject: {pods: {namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: beta}}, podSelector: {matchLabels: {app: server}}}}\n"
	const fromBeta = "from: [{namespaces: {matchLabels: {kubernetes.io/metadata.name: beta}}}]"
	const fromAll = "from: [{namespaces: {}}]"
	denyAllNetpol := netpol("beta", "deny-all", "podSelector: {}\npolicyTypes: [Ingress]")
	runCases(t, []semanticsCase{
		{"Admin Accept wins over a NetworkPolicy's default deny", baseCluster(denyAllNetpol,
			clusterNetpolDoc("accept", "Admin", 5, betaServer+"ingress: [{action: Accept, "+fromBeta+"}]")), []probe{
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "alpha/web", 80, "deny"),
			in("beta/web", "beta/client", 80, "deny"),
		}},
		{"Admin Accept wins over a CNP deny of every peer", baseCluster(
			cnp("beta", "deny", "endpointSelector: {}\ningressDeny: [{fromEntities: [all]}]"),
			clusterNetpolDoc("accept", "Admin", 5, betaServer+"ingress: [{action: Accept, "+fromBeta+"}]")), []probe{
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "alpha/web", 80, "deny"),
		}},
		{"lower priority first; rules in order", baseCluster(
			clusterNetpolDoc("a", "Admin", 1, betaServer+"ingress: [{action: Deny, "+fromBeta+", protocols: [{tcp: {destinationPort: {number: 80}}}]}, {action: Accept, "+fromAll+"}]"),
			clusterNetpolDoc("b", "Admin", 0, betaServer+"ingress: [{action: Accept, from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: client}}}}], protocols: [{tcp: {destinationPort: {range: {start: 80, end: 90}}}}]}]"),
			denyAllNetpol), []probe{
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "beta/web", 80, "drop"),
			in("beta/server", "beta/web", 81, "allow"),
			in("beta/server", "alpha/web", 80, "allow"),
		}},
		{"Pass hands over to the NetworkPolicy, which allows or denies", baseCluster(
			netpol("beta", "from-client", "podSelector: {matchLabels: {app: server}}\ningress: [{from: [{podSelector: {matchLabels: {app: client}}}]}]"),
			clusterNetpolDoc("pass", "Admin", 1, betaServer+"ingress: [{action: Pass, "+fromBeta+"}, {action: Deny, "+fromAll+"}]")), []probe{
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "beta/web", 80, "deny"),
			in("beta/server", "alpha/web", 80, "drop"),
		}},
		{"Pass with no NetworkPolicy: the Baseline tier decides", baseCluster(
			clusterNetpolDoc("pass", "Admin", 1, betaServer+"ingress: [{action: Pass, "+fromBeta+"}]"),
			clusterNetpolDoc("base", "Baseline", 3, betaServer+"ingress: [{action: Accept, from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: client}}}}]}, {action: Deny, "+fromAll+"}]")), []probe{
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "beta/web", 80, "drop"),
			in("beta/server", "alpha/web", 80, "drop"),
			in("beta/web", "alpha/web", 80, "allow"),
		}},
		{"the Baseline tier decides nothing where a NetworkPolicy selects", baseCluster(denyAllNetpol,
			netpol("beta", "from-web", "podSelector: {}\ningress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]"),
			clusterNetpolDoc("base", "Baseline", 3, betaServer+"ingress: [{action: Accept, "+fromAll+"}]")), []probe{
			in("beta/server", "beta/web", 80, "allow"),
			in("beta/server", "beta/client", 80, "deny"),
		}},
		{"a CNP allow of every peer decides before the Baseline tier", baseCluster(
			cnp("beta", "open", "endpointSelector: {matchLabels: {app: server}}\ningress: [{fromEntities: [all], toPorts: [{ports: [{port: \"80\", protocol: TCP}]}]}]\nenableDefaultDeny: {ingress: false}"),
			clusterNetpolDoc("base", "Baseline", 3, betaServer+"ingress: [{action: Deny, "+fromAll+"}]")), []probe{
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "beta/client", 81, "drop"),
			in("beta/server", "host", 81, "allow"),
		}},
		{"Baseline Deny, same priority: by name", baseCluster(
			clusterNetpolDoc("b", "Baseline", 3, betaServer+"ingress: [{action: Deny, "+fromAll+"}]"),
			clusterNetpolDoc("a", "Baseline", 3, betaServer+"ingress: [{action: Accept, "+fromBeta+"}]")), []probe{
			in("beta/server", "beta/client", 80, "allow"),
			in("beta/server", "alpha/web", 80, "drop"),
		}},
	})
}

// An invalid policy keeps its subject's direction closed: no Accept of a
// tier opens it, whatever its priority; an Admin Deny still denies, and
// another pod is not concerned.
func TestSemanticsClusterNetworkPolicyFailClosed(t *testing.T) {
	const betaServer = "subject: {pods: {namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: beta}}, podSelector: {matchLabels: {app: server}}}}\n"
	accept := clusterNetpolDoc("accept", "Admin", 1, betaServer+"ingress: [{action: Accept, from: [{namespaces: {}}]}]")
	c := baseCluster(accept,
		clusterNetpolDoc("base", "Baseline", 1, betaServer+"ingress: [{action: Accept, from: [{namespaces: {}}]}]"),
		clusterNetpolDoc("deny", "Admin", 2, betaServer+"ingress: [{action: Deny, from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: web}}}}]}]"))
	m := newAgentModel(t, c.localhost)
	m.apply(c)
	for _, p := range []probe{in("beta/server", "beta/client", 80, "allow"), in("beta/server", "beta/web", 80, "allow")} {
		if got := m.verdictOf(p); got != p.want {
			t.Errorf("before: %s: %s, want %s", p, got, p.want)
		}
	}
	// The policies table's row of an invalid policy selecting the same
	// pod: its fail-closed spec, as the controller hands it over.
	js, err := yaml.YAMLToJSON([]byte(accept))
	if err != nil {
		t.Fatal(err)
	}
	var cn selectors.ClusterNetworkPolicy
	if err := json.Unmarshal(js, &cn); err != nil {
		t.Fatal(err)
	}
	parsed, err := selectors.ParseClusterNetworkPolicy(&cn)
	if err != nil {
		t.Fatal(err)
	}
	m.eng.setPolicy("clusternetpol/broken", []tables.PolicySpec{{Subject: parsed.Specs[0].Subject, Ingress: true, DefaultDenyIngress: true}}, false, "broken")
	m.eng.flush(m.out)
	m.byGroup = map[string][]*tables.PolicyEntry{}
	for _, e := range m.out.entries {
		g := groupOf(e.Endpoint, e.Identity, e.Direction)
		m.byGroup[g] = append(m.byGroup[g], e)
	}
	for _, p := range []probe{
		in("beta/server", "beta/client", 80, "deny"),
		in("beta/server", "beta/web", 80, "drop"),
		in("beta/web", "beta/client", 80, "allow"),
	} {
		if got := m.verdictOf(p); got != p.want {
			t.Errorf("with the invalid policy: %s: %s, want %s\nentries: %v", p, got, p.want, m.out.list(p.ep))
		}
	}
}

// A peer's group of tiered rules takes the ports of identity 0's entries
// only where they change the decision: an Admin Deny of every port over a
// CNP's allow of three ports to every peer is one entry, a Pass over it
// four (the Pass's, and the three allows folded in).
func TestClusterNetworkPolicyEntries(t *testing.T) {
	const betaServer = "subject: {pods: {namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: beta}}, podSelector: {matchLabels: {app: server}}}}\n"
	open := cnp("beta", "open", `endpointSelector: {matchLabels: {app: server}}
ingress: [{fromEntities: [all], toPorts: [{ports: [{port: "80", protocol: TCP}, {port: "53", protocol: UDP}, {port: "8080", protocol: TCP}]}]}]`)
	for _, tc := range []struct {
		action string
		want   int
		probes []probe
	}{
		{"Deny", 1, []probe{in("beta/server", "beta/web", 80, "drop"), in("beta/server", "beta/client", 80, "allow")}},
		{"Pass", 4, []probe{in("beta/server", "beta/web", 80, "allow"), in("beta/server", "beta/web", 81, "deny")}},
	} {
		c := baseCluster(open, clusterNetpolDoc("admin", "Admin", 1, betaServer+"ingress: [{action: "+tc.action+", from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: web}}}}]}]"))
		m := newAgentModel(t, c.localhost)
		m.apply(c)
		n := 0
		for _, e := range m.out.entries {
			if e.Endpoint == "beta/server" && e.Identity == m.podIDs["beta/web"] {
				n++
			}
		}
		if n != tc.want {
			t.Errorf("%s: %d entries of beta/web on beta/server, want %d: %v", tc.action, n, tc.want, m.out.list("beta/server"))
		}
		for _, p := range tc.probes {
			if got := m.verdictOf(p); got != p.want {
				t.Errorf("%s: %s: %s, want %s", tc.action, p, got, p.want)
			}
		}
	}
}

// A domainNames rule gets its subjects' DNS intercepted, so that the
// proxy labels the names' addresses, without allowing a name: a pod
// whose CNP has DNS rules keeps exactly their names; a pod without any
// may look up every name ("*", as without interception).
func TestClusterNetworkPolicyDomainNamesDNS(t *testing.T) {
	dnsRule := cnp("beta", "dns", `endpointSelector: {matchLabels: {app: web}}
egress: [{toEndpoints: [{}], toPorts: [{ports: [{port: "53", protocol: ANY}], rules: {dns: [{matchPattern: "*.allowed.com"}]}}]}]`)
	names := clusterNetpolDoc("names", "Admin", 1, `subject: {namespaces: {matchLabels: {kubernetes.io/metadata.name: beta}}}
egress: [{action: Accept, to: [{domainNames: ["*.example.com"]}]}]`)
	c := baseCluster(dnsRule, names)
	m := newAgentModel(t, c.localhost)
	m.eng.dnsProxy = true
	m.apply(c)
	for _, tc := range []struct {
		ep   string
		want []tables.DNSRule
	}{
		{"beta/web", []tables.DNSRule{{Pattern: "*.allowed.com", Policy: "cnp/beta/dns"}}},
		{"beta/server", []tables.DNSRule{{Pattern: "*", Policy: "clusternetpol/names"}}},
		{"alpha/web", nil},
	} {
		ep := m.out.endpoints[tc.ep]
		if ep == nil {
			t.Fatalf("no endpoint %s", tc.ep)
		}
		if fmt.Sprint(ep.DNS) != fmt.Sprint(tc.want) {
			t.Errorf("%s: DNS %v, want %v", tc.ep, ep.DNS, tc.want)
		}
	}
	// Without a proxy that intercepts, the rule intercepts nothing (the
	// subject's DNS would be denied): it matches nothing, as the API's
	// fail closed of an Accept rule.
	m = newAgentModel(t, c.localhost)
	m.apply(c)
	if ep := m.out.endpoints["beta/server"]; ep == nil || len(ep.DNS) != 0 {
		t.Errorf("beta/server without a proxy: %+v, want no DNS rules", ep)
	}
}
