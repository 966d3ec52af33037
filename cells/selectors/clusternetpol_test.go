package selectors

import (
	"slices"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/cells/fqdn/pattern"
	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/tables"
)

func decodeClusterNetpol(t *testing.T, spec string) *ClusterNetworkPolicy {
	t.Helper()
	lines := strings.Split(strings.Trim(spec, "\n"), "\n")
	doc := "apiVersion: policy.networking.k8s.io/v1beta1\nkind: ClusterNetworkPolicy\nmetadata: {name: p}\nspec:\n  " +
		strings.Join(lines, "\n  ")
	var p ClusterNetworkPolicy
	if err := yaml.Unmarshal([]byte(doc), &p); err != nil {
		t.Fatalf("bad test YAML: %v", err)
	}
	return &p
}

// Admin-tier Deny rules become deny rules that do not put the subject into
// default deny; subjects and peers select pods by namespace and pod labels.
func TestClusterNetworkPolicyParse(t *testing.T) {
	p := decodeClusterNetpol(t, `
tier: Admin
priority: 10
subject: {namespaces: {matchLabels: {team: a}}}
ingress:
- name: no-b
  action: Deny
  from: [{pods: {namespaceSelector: {matchLabels: {team: b}}, podSelector: {matchLabels: {app: x}}}}]
  protocols: [{tcp: {destinationPort: {number: 80}}}, {udp: {destinationPort: {range: {start: 1000, end: 2000}}}}, {destinationNamedPort: http}]
egress:
- action: Deny
  to: [{networks: [169.254.169.254/32]}, {namespaces: {}}]
  protocols: [{sctp: {}}]
`)
	parsed := parseClusterNetpol("clusternetpol/p", p)
	if parsed.err != nil {
		t.Fatal(parsed.err)
	}
	if len(parsed.specs) != 1 {
		t.Fatalf("specs: %+v", parsed.specs)
	}
	s := parsed.specs[0]
	if !s.Ingress || !s.Egress || s.DefaultDenyIngress || s.DefaultDenyEgress {
		t.Errorf("directions: %+v", s)
	}
	if s.Subject != "k8s:io.cilium.k8s.namespace.labels.team=a" {
		t.Errorf("subject %q", s.Subject)
	}
	if len(s.Rules) != 2 || !s.Rules[0].Deny || !s.Rules[1].Deny {
		t.Fatalf("rules: %+v", s.Rules)
	}
	in, out := s.Rules[0], s.Rules[1]
	wantPorts := []tables.PortRule{
		{Protocol: tables.ProtoTCP, Port: 80},
		{Protocol: tables.ProtoUDP, Port: 1000, EndPort: 2000},
		{Protocol: tables.ProtoAny, Name: "http"},
	}
	if in.Direction != tables.DirIngress || len(in.Peers) != 1 || len(in.Ports) != 3 {
		t.Fatalf("ingress rule: %+v", in)
	}
	for i, w := range wantPorts {
		if in.Ports[i] != w {
			t.Errorf("port %d: %+v, want %+v", i, in.Ports[i], w)
		}
	}
	if out.Direction != tables.DirEgress || len(out.Peers) != 2 || len(out.Ports) != 1 || out.Ports[0] != (tables.PortRule{Protocol: tables.ProtoSCTP}) {
		t.Errorf("egress rule: %+v", out)
	}
	if len(parsed.cidrs) != 1 || parsed.cidrs[0].String() != "169.254.169.254/32" {
		t.Errorf("cidrs: %v", parsed.cidrs)
	}
}

// Accept, Pass and the Baseline tier become tiered rules with their
// priority, index and label.
func TestClusterNetworkPolicyTiers(t *testing.T) {
	for _, tc := range []struct {
		spec       string
		tier       string
		deny, pass bool
		index      int32
		label, dir string
	}{
		{"tier: Admin\npriority: 7\nsubject: {namespaces: {}}\ningress: [{action: Deny, from: [{namespaces: {}}]}, {name: ok, action: Accept, from: [{namespaces: {}}]}]",
			tables.TierAdmin, false, false, 1, "clusternetpol/p/ok", tables.DirIngress},
		{"tier: Admin\npriority: 7\nsubject: {namespaces: {}}\negress: [{action: Deny, to: [{namespaces: {}}]}, {action: Pass, to: [{namespaces: {}}]}]",
			tables.TierAdmin, false, true, 1, "clusternetpol/p/egress[1]", tables.DirEgress},
		{"tier: Baseline\npriority: 7\nsubject: {namespaces: {}}\ningress: [{action: Accept, from: [{namespaces: {}}]}, {action: Deny, from: [{namespaces: {}}]}]",
			tables.TierBaseline, true, false, 1, "clusternetpol/p/ingress[1]", tables.DirIngress},
	} {
		p := parseClusterNetpol("clusternetpol/p", decodeClusterNetpol(t, tc.spec))
		if p.err != nil {
			t.Fatalf("%s: %v", tc.spec, p.err)
		}
		r := p.specs[0].Rules[1]
		if r.Tier != tc.tier || r.Deny != tc.deny || r.Pass != tc.pass || r.Priority != 7 || r.Index != tc.index || r.Label != tc.label || r.Direction != tc.dir {
			t.Errorf("%s: rule %+v", tc.spec, r)
		}
	}
}

// What apiary cannot enforce exactly, and what the API server would
// refuse, is an invalid policy naming the field; it fails closed on its
// subjects in the directions it has rules in.
func TestClusterNetworkPolicyInvalid(t *testing.T) {
	const subject = "subject: {namespaces: {}}\n"
	for _, tc := range []struct {
		name, spec, err string
		ingress, egress bool
	}{
		{"bad action", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Drop, to: [{namespaces: {}}]}]",
			`spec.egress[0].action: "Drop" is not Accept, Deny or Pass`, false, true},
		{"bad tier", "tier: Top\npriority: 1\n" + subject + "ingress: [{action: Deny, from: [{namespaces: {}}]}]",
			`spec.tier: "Top" is neither Admin nor Baseline`, true, false},
		{"priority", "tier: Admin\npriority: 1001\n" + subject + "ingress: [{action: Deny, from: [{namespaces: {}}]}]",
			"spec.priority: 1001 is not from 0 to 1000", true, false},
		{"ingress nodes", "tier: Admin\npriority: 1\n" + subject + "ingress: [{action: Deny, from: [{nodes: {}}]}]",
			"spec.ingress[0].from[0].nodes: only egress", true, false},
		{"bad nodes selector", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Deny, to: [{nodes: {matchExpressions: [{key: a, operator: Near}]}}]}]",
			"spec.egress[0].to[0].nodes: ", false, true},
		{"domainNames in Deny", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Deny, to: [{domainNames: [example.com]}]}]",
			"spec.egress[0].to[0].domainNames: only Accept rules", false, true},
		{"domainNames in Pass", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Pass, to: [{domainNames: [example.com]}]}]",
			"spec.egress[0].to[0].domainNames: only Accept rules", false, true},
		{"one-label domain name", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Accept, to: [{domainNames: [localhost]}]}]",
			`spec.egress[0].to[0].domainNames[0]: "localhost" is not a domain name`, false, true},
		{"inner wildcard", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Accept, to: [{domainNames: [\"www.*.com\"]}]}]",
			`spec.egress[0].to[0].domainNames[0]: "www.*.com" is not a domain name`, false, true},
		{"partial wildcard", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Accept, to: [{domainNames: [\"*x.example.com\"]}]}]",
			`is not a domain name`, false, true},
		{"two peer kinds", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Deny, to: [{namespaces: {}, networks: [10.0.0.0/8]}]}]",
			"spec.egress[0].to[0]: exactly one of", false, true},
		{"no peers", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Deny, to: []}]",
			"spec.egress[0].to: needs at least one peer", false, true},
		{"ingress networks", "tier: Admin\npriority: 1\n" + subject + "ingress: [{action: Deny, from: [{networks: [10.0.0.0/8]}]}]",
			"spec.ingress[0].from[0].networks: only egress", true, false},
		{"bad CIDR", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Deny, to: [{networks: [10.0.0.1]}]}]",
			`spec.egress[0].to[0].networks[0]: "10.0.0.1" is not a CIDR`, false, true},
		{"bad range", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Deny, to: [{namespaces: {}}], protocols: [{tcp: {destinationPort: {range: {start: 9, end: 8}}}}]}]",
			"spec.egress[0].protocols[0]: destinationPort.range: 9-8", false, true},
		{"two protocols", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Deny, to: [{namespaces: {}}], protocols: [{tcp: {}, udp: {}}]}]",
			"spec.egress[0].protocols[0]: exactly one of tcp", false, true},
		{"bad selector", "tier: Admin\npriority: 1\nsubject: {namespaces: {matchExpressions: [{key: a, operator: Near}]}}\ningress: [{action: Deny, from: [{namespaces: {}}]}]",
			"spec.subject:", true, false},
		{"both subjects", "tier: Admin\npriority: 1\nsubject: {namespaces: {}, pods: {namespaceSelector: {}, podSelector: {}}}\ningress: [{action: Deny, from: [{namespaces: {}}]}]",
			"spec.subject: namespaces and pods are both set", true, false},
		{"unknown field", "tier: Admin\npriority: 1\n" + subject + "egress: [{action: Deny, to: [{namespaces: {}}], ports: [80]}]",
			`unknown field "ports"`, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := parseClusterNetpol("clusternetpol/p", decodeClusterNetpol(t, tc.spec))
			if p.err == nil || !strings.Contains(p.err.Error(), tc.err) {
				t.Fatalf("error %v, want one containing %q", p.err, tc.err)
			}
			if len(p.specs) != 0 || len(p.peers) != 0 || len(p.cidrs) != 0 {
				t.Errorf("an invalid policy contributes %+v %v %v", p.specs, p.peers, p.cidrs)
			}
			if tc.name == "bad selector" || tc.name == "both subjects" {
				if len(p.failClosed) != 0 {
					t.Errorf("fail closed without a subject: %+v", p.failClosed)
				}
				return
			}
			if len(p.failClosed) != 1 {
				t.Fatalf("failClosed: %+v", p.failClosed)
			}
			fc := p.failClosed[0]
			if fc.Ingress != tc.ingress || fc.Egress != tc.egress || fc.DefaultDenyIngress != tc.ingress ||
				fc.DefaultDenyEgress != tc.egress || len(fc.Rules) != 0 {
				t.Errorf("failClosed: %+v", fc)
			}
		})
	}
}

// The audit annotation works on a ClusterNetworkPolicy as on the other
// kinds; a bad value makes it invalid.
func TestClusterNetworkPolicyAudit(t *testing.T) {
	const spec = "tier: Admin\npriority: 1\nsubject: {namespaces: {}}\ningress: [{action: Deny, from: [{namespaces: {}}]}]"
	for _, tc := range []struct {
		value     string
		audit, ok bool
	}{{"true", true, true}, {"false", false, true}, {"maybe", false, false}} {
		p := decodeClusterNetpol(t, spec)
		p.Annotations = map[string]string{AuditAnnotation: tc.value}
		parsed, err := ParseClusterNetworkPolicy(p)
		if (err == nil) != tc.ok || parsed.Audit != tc.audit {
			t.Errorf("%s: audit %v, error %v", tc.value, parsed.Audit, err)
		}
	}
}

// nodes and domainNames peers become a NodePeer and FQDN selectors; a
// domainNames rule asks for the subjects' DNS to be intercepted ("*").
// The API's "*." is apiary's "**." (one or more whole labels).
func TestClusterNetworkPolicyNodesAndDomainNames(t *testing.T) {
	p := decodeClusterNetpol(t, `
tier: Admin
priority: 10
subject: {namespaces: {}}
egress:
- name: db-nodes
  action: Accept
  to: [{nodes: {matchLabels: {role: db}, matchExpressions: [{key: zone, operator: In, values: [b, a]}]}}, {nodes: {}}]
- name: names
  action: Accept
  to: [{domainNames: ["*.Example.com", "kubernetes.io", "www.kubernetes.io."]}]
`)
	parsed := parseClusterNetpol("clusternetpol/p", p)
	if parsed.err != nil {
		t.Fatal(parsed.err)
	}
	rules := parsed.specs[0].Rules
	wantNodes := []string{"nodes:{role=db,zone in (a,b)}", "nodes:{}"}
	if !slices.Equal(rules[0].Peers, wantNodes) || len(rules[0].DNS) != 0 {
		t.Errorf("nodes rule: %+v, want peers %v", rules[0], wantNodes)
	}
	wantNames := []string{"fqdn:**.example.com", "fqdn:kubernetes.io", "fqdn:www.kubernetes.io"}
	if !slices.Equal(rules[1].Peers, wantNames) || !slices.Equal(rules[1].DNS, []string{"*"}) {
		t.Errorf("domainNames rule: %+v, want peers %v and DNS [*]", rules[1], wantNames)
	}
	for _, tc := range []struct {
		domain, name string
		match        bool
	}{
		{"*.kubernetes.io", "www.kubernetes.io", true},
		{"*.kubernetes.io", "latest.blog.kubernetes.io", true},
		{"*.kubernetes.io", "kubernetes.io", false},
		{"*.kubernetes.io", "wikipedia.org", false},
		{"kubernetes.io", "kubernetes.io", true},
		{"kubernetes.io", "www.kubernetes.io", false},
		{"kubernetes.io", "my-kubernetes.io", false},
		{"blog.kubernetes.io", "blog.kubernetes.io", true},
		{"blog.kubernetes.io", "www.kubernetes.io", false},
	} {
		sel, err := ParseDomainName(tc.domain)
		if err != nil {
			t.Fatalf("%s: %v", tc.domain, err)
		}
		pat, err := pattern.ParsePattern(strings.TrimPrefix(sel.Label, tables.SourceFQDN+":"))
		if err != nil {
			t.Fatalf("%s: %v", sel.Label, err)
		}
		if got := pat.Match(tc.name); got != tc.match {
			t.Errorf("%s (%s) matches %s: %v, want %v", tc.domain, sel.Label, tc.name, got, tc.match)
		}
	}
}
