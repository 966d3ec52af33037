package selectors

import (
	"strings"
	"testing"

	networkingv1 "k8s.io/api/networking/v1"
	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/tables"
)

func decodeNetpol(t *testing.T, spec string) *networkingv1.NetworkPolicy {
	t.Helper()
	lines := strings.Split(strings.Trim(spec, "\n"), "\n")
	doc := "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: default}\nspec:\n  " +
		strings.Join(lines, "\n  ")
	var np networkingv1.NetworkPolicy
	if err := yaml.UnmarshalStrict([]byte(doc), &np); err != nil {
		t.Fatalf("bad test YAML: %v", err)
	}
	return &np
}

// What the API server refuses is an invalid policy here, with the field's
// path; it fails closed on its pods in the directions it has (both when
// policyTypes itself is wrong).
func TestNetworkPolicyInvalid(t *testing.T) {
	for _, tc := range []struct {
		name, spec, err string
		ingress, egress bool
	}{
		{"bad operator", `
podSelector: {matchExpressions: [{key: app, operator: Near}]}`, "spec.podSelector: podSelector:", true, false},
		{"bad label key", `
podSelector: {}
ingress: [{from: [{podSelector: {matchLabels: {"a b": x}}}]}]`, "spec.ingress[0].from[0]: podSelector:", true, false},
		{"bad namespace label value", `
podSelector: {}
ingress: [{from: [{namespaceSelector: {matchLabels: {team: "a b"}}}]}]`, "spec.ingress[0].from[0]: namespaceSelector:", true, false},
		{"empty peer", `
podSelector: {}
ingress: [{from: [{}]}]`, "spec.ingress[0].from[0]: must specify a peer", true, false},
		{"ipBlock and selector", `
podSelector: {}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: 10.0.0.0/8}, namespaceSelector: {}}]}]`, "spec.egress[0].to[0]: ipBlock may not be combined", false, true},
		{"not a CIDR", `
podSelector: {}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: 10.0.0.1}}]}]`, `spec.egress[0].to[0].ipBlock: cidr: "10.0.0.1" is not a CIDR`, false, true},
		{"except outside", `
podSelector: {}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: 10.0.0.0/8, except: [192.168.0.0/16]}}]}]`, "except 192.168.0.0/16 is not inside 10.0.0.0/8", false, true},
		{"except the whole block", `
podSelector: {}
policyTypes: [Egress]
egress: [{to: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.0.0.0/8]}}]}]`, "not a strict subset", false, true},
		{"port 0", `
podSelector: {}
ingress: [{ports: [{port: 0}]}]`, "spec.ingress[0].ports[0]: port: 0 is not a port number", true, false},
		{"port too big", `
podSelector: {}
ingress: [{ports: [{port: 70000}]}]`, "port: 70000 is not a port number", true, false},
		{"bad port name", `
podSelector: {}
ingress: [{ports: [{port: HTTP}]}]`, `port: "HTTP" is not a port name`, true, false},
		{"endPort below port", `
podSelector: {}
ingress: [{ports: [{port: 90, endPort: 80}]}]`, "endPort: 80 is not a port from port 90", true, false},
		{"endPort without port", `
podSelector: {}
ingress: [{ports: [{endPort: 80}]}]`, "endPort: needs a port", true, false},
		{"lower-case protocol", `
podSelector: {}
ingress: [{ports: [{port: 80, protocol: udp}]}]`, `protocol: "udp" is not TCP, UDP or SCTP`, true, false},
		{"bad policy type", `
podSelector: {}
policyTypes: [Inbound]`, `spec.policyTypes[0]: "Inbound" is neither Ingress nor Egress`, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := parseNetworkPolicy("netpol/default/p", decodeNetpol(t, tc.spec))
			if p.err == nil || !strings.Contains(p.err.Error(), tc.err) {
				t.Fatalf("error %v, want one with %q", p.err, tc.err)
			}
			if len(p.specs) != 0 || len(p.peers) != 0 || len(p.cidrs) != 0 {
				t.Errorf("an invalid policy kept specs %v, peers %v, cidrs %v", p.specs, p.peers, p.cidrs)
			}
			if tc.name == "bad operator" {
				if len(p.failClosed) != 0 {
					t.Errorf("fail-closed specs %+v without a subject", p.failClosed)
				}
				return
			}
			want := tables.PolicySpec{
				Subject: "k8s:io.kubernetes.pod.namespace=default",
				Ingress: tc.ingress, Egress: tc.egress, DefaultDenyIngress: tc.ingress, DefaultDenyEgress: tc.egress,
			}
			if len(p.failClosed) != 1 || p.failClosed[0].Subject != want.Subject ||
				p.failClosed[0].Ingress != want.Ingress || p.failClosed[0].Egress != want.Egress ||
				p.failClosed[0].DefaultDenyIngress != want.DefaultDenyIngress || p.failClosed[0].DefaultDenyEgress != want.DefaultDenyEgress ||
				len(p.failClosed[0].Rules) != 0 {
				t.Errorf("fail-closed specs %+v, want [%+v]", p.failClosed, want)
			}
		})
	}
}

// The valid forms: what each becomes in the rule model.
func TestNetworkPolicyParse(t *testing.T) {
	np := decodeNetpol(t, `
podSelector: {matchLabels: {app: web}}
ingress:
- from:
  - podSelector: {matchLabels: {app: a}}
    namespaceSelector: {matchExpressions: [{key: env, operator: In, values: [prod, dev]}]}
  ports: [{port: 80, endPort: 80}, {protocol: SCTP}]
- {}
egress:
- ports: [{port: dns, protocol: UDP}]`)
	p := parseNetworkPolicy("netpol/default/p", np)
	if p.err != nil {
		t.Fatal(p.err)
	}
	got, _ := yaml.Marshal(p.specs)
	want := `- defaultDenyEgress: true
  defaultDenyIngress: true
  egress: true
  ingress: true
  rules:
  - direction: ingress
    peers:
    - k8s:app=a, k8s:io.cilium.k8s.namespace.labels.env in (dev,prod)
    ports:
    - port: 80
      protocol: TCP
    - protocol: SCTP
  - direction: ingress
    peers:
    - entity:all
  - direction: egress
    peers:
    - entity:all
    ports:
    - name: dns
      protocol: UDP
  subject: k8s:app=web, k8s:io.kubernetes.pod.namespace=default
`
	if string(got) != want {
		t.Errorf("specs:\n%s\nwant:\n%s", got, want)
	}
}

// An ipBlock's peer is a selector of its own, which the entries of its
// rules mark as matching pods' addresses (tables.MatchesPodAddrs), where a
// CNP's toCIDR of the same prefixes is not: both select the same CIDR
// identities, and neither a pod's.
func TestNetworkPolicyIPBlockPeer(t *testing.T) {
	np := decodeNetpol(t, `
podSelector: {}
egress: [{to: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16, 10.0.0.0/16]}}]}]`)
	p := parseNetworkPolicy("netpol/default/p", np)
	if p.err != nil {
		t.Fatal(p.err)
	}
	if len(p.peers) != 1 {
		t.Fatalf("peers %v, want the ipBlock's", p.peers)
	}
	block := p.peers[0]
	cidr, err := ParseCIDR("10.0.0.0/8", []string{"10.1.0.0/16", "10.0.0.0/16"})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := block.String(), "ipblock:10.0.0.0/8 except 10.0.0.0/16 except 10.1.0.0/16"; got != want {
		t.Errorf("ipBlock selector %q, want %q", got, want)
	}
	if !tables.MatchesPodAddrs(block.String()) || tables.MatchesPodAddrs(cidr.String()) {
		t.Errorf("MatchesPodAddrs: ipBlock %v, toCIDR %v; want true, false",
			tables.MatchesPodAddrs(block.String()), tables.MatchesPodAddrs(cidr.String()))
	}
	if got := p.specs[0].Rules[0].Peers; len(got) != 1 || got[0] != block.String() {
		t.Errorf("rule peers %v, want [%s]", got, block)
	}
	for _, tc := range []struct {
		labels tables.Labels
		want   bool
	}{
		{tables.NewLabels("cidr:10.0.0.0/8", tables.LabelWorld), true},
		{tables.NewLabels("cidr:10.2.0.0/16", tables.LabelWorld), true},
		{tables.NewLabels("cidr:10.1.2.0/24", tables.LabelWorld), false},
		{tables.NewLabels("cidr:10.0.0.5/32", tables.LabelWorld), false},
		{tables.NewLabels("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"), false},
	} {
		if got := block.Matches(tc.labels); got != tc.want || cidr.Matches(tc.labels) != got {
			t.Errorf("%v: ipBlock selects %v, toCIDR %v; want both %v", tc.labels, got, cidr.Matches(tc.labels), tc.want)
		}
	}
}
