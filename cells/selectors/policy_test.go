package selectors

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/tables"
)

// decodeCNP decodes a CiliumNetworkPolicy called "p" in namespace default
// whose body (spec, specs) is given in YAML, the way the cell gets it:
// through its UnmarshalJSON, which notes unknown fields.
func decodeCNP(t *testing.T, body string) *CiliumNetworkPolicy {
	t.Helper()
	doc := "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {name: p, namespace: default}\n" + body
	js, err := yaml.YAMLToJSON([]byte(doc))
	if err != nil {
		t.Fatalf("bad test YAML: %v", err)
	}
	var p CiliumNetworkPolicy
	if err := json.Unmarshal(js, &p); err != nil {
		t.Fatalf("decode: %v", err)
	}
	return &p
}

// parseYAML parses a policy body as the cell does, namespaced in default
// or, with clusterwide, without a namespace.
func parseYAML(t *testing.T, body string, clusterwide bool) *parsedPolicy {
	t.Helper()
	p := decodeCNP(t, body)
	ns := "default"
	if clusterwide {
		ns = ""
	}
	return parsePolicy("cnp/default/p", ns, p.Spec, p.Specs, p.UnsupportedFields())
}

func toJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// Selector texts used below.
const (
	webSubject    = "any:app=web, k8s:io.kubernetes.pod.namespace=default"
	clientPeer    = "any:app=client, k8s:io.kubernetes.pod.namespace=default"
	dnsPeer       = "any:k8s-app=kube-dns, k8s:io.kubernetes.pod.namespace=kube-system"
	entityWorld   = "entity:world"
	entityHost    = "entity:host"
	entityCluster = "entity:cluster"
)

func TestParsePolicySpecs(t *testing.T) {
	type (
		spec = tables.PolicySpec
		rule = tables.PolicyRule
		port = tables.PortRule
	)
	in := func(deny bool, peers []string, ports ...port) rule {
		return rule{Direction: tables.DirIngress, Deny: deny, Peers: peers, Ports: ports}
	}
	out := func(deny bool, peers []string, ports ...port) rule {
		return rule{Direction: tables.DirEgress, Deny: deny, Peers: peers, Ports: ports}
	}
	peers := func(p ...string) []string { return append([]string{}, p...) }
	any := peers(tables.AnyPeer)
	tcp := func(p uint16) port { return port{Protocol: tables.ProtoTCP, Port: p} }
	for _, tc := range []struct {
		name        string
		body        string
		clusterwide bool
		want        []spec
		// wantPeers and wantCIDRs are the policies row's Peers and CIDRs.
		wantPeers []string
		wantCIDRs []string
	}{
		{
			name: "fromEndpoints on a port",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "80", protocol: TCP}]}]`,
			want: []spec{{Subject: webSubject, Ingress: true, DefaultDenyIngress: true,
				Rules: []rule{in(false, peers(clientPeer), tcp(80))}}},
			wantPeers: peers(clientPeer),
		},
		{
			name: "CIDRs, CIDR sets and FQDNs, every port",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toCIDR: [192.0.2.0/24, "2001:db8::1"]
    toCIDRSet: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16]}]
  - toFQDNs: [{matchName: api.example.com}, {matchPattern: "*.Example.org"}]
  ingress:
  - fromCIDR: [198.51.100.7]
    fromCIDRSet: [{cidr: 203.0.113.0/24}]`,
			want: []spec{{Subject: webSubject, Ingress: true, Egress: true, DefaultDenyIngress: true, DefaultDenyEgress: true,
				Rules: []rule{
					in(false, peers("cidr:198.51.100.7/32", "cidr:203.0.113.0/24")),
					out(false, peers("cidr:10.0.0.0/8 except cidr:10.1.0.0/16", "cidr:192.0.2.0/24", "cidr:2001:db8::1/128")),
					out(false, peers("fqdn:*.example.org", "fqdn:api.example.com")),
				}}},
			wantPeers: peers("cidr:10.0.0.0/8 except cidr:10.1.0.0/16", "cidr:192.0.2.0/24", "cidr:198.51.100.7/32",
				"cidr:2001:db8::1/128", "cidr:203.0.113.0/24", "fqdn:*.example.org", "fqdn:api.example.com"),
			wantCIDRs: peers("10.0.0.0/8", "10.1.0.0/16", "192.0.2.0/24", "198.51.100.7/32", "2001:db8::1/128", "203.0.113.0/24"),
		},
		{
			name: "entities",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEntities: [host, cluster]
  - fromEntities: [all]
    toPorts: [{ports: [{port: "8080"}]}]
  egress:
  - toEntities: [world]
  - toEntities: [all, world]
    toEndpoints: [{matchLabels: {app: client}}]`,
			want: []spec{{Subject: webSubject, Ingress: true, Egress: true, DefaultDenyIngress: true, DefaultDenyEgress: true,
				Rules: []rule{
					in(false, peers(entityCluster, entityHost)),
					in(false, any, port{Protocol: tables.ProtoAny, Port: 8080}),
					out(false, peers(entityWorld)),
					// all does not swallow the other peers: the rule says them.
					out(false, peers(clientPeer, tables.AnyPeer, entityWorld)),
				}}},
			wantPeers: peers(clientPeer, entityCluster, entityHost, entityWorld),
		},
		{
			name: "ports without peers apply to every peer",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toPorts: [{ports: [{port: "53", protocol: UDP}, {port: "53", protocol: TCP}]}]`,
			want: []spec{{Subject: webSubject, Egress: true, DefaultDenyEgress: true,
				Rules: []rule{out(false, any, port{Protocol: tables.ProtoUDP, Port: 53}, tcp(53))}}},
			wantPeers: peers(),
		},
		{
			name: "an empty rule only puts the subject into default deny",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress: [{}]`,
			want: []spec{{Subject: webSubject, Ingress: true, DefaultDenyIngress: true,
				Rules: []rule{in(false, peers())}}},
			wantPeers: peers(),
		},
		{
			name: "an empty list is no section",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress: []
  egressDeny: []`,
			want:      []spec{{Subject: webSubject}},
			wantPeers: peers(),
		},
		{
			name: "deny rules",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingressDeny:
  - fromCIDRSet: [{cidr: 0.0.0.0/0}]
    toPorts: [{ports: [{port: "22", protocol: TCP}]}]
  egressDeny:
  - toEntities: [host]
  - toEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "6379"}]}]`,
			want: []spec{{Subject: webSubject, Ingress: true, Egress: true, DefaultDenyIngress: true, DefaultDenyEgress: true,
				Rules: []rule{
					in(true, peers("cidr:0.0.0.0/0"), tcp(22)),
					out(true, peers(entityHost)),
					out(true, peers(clientPeer), port{Protocol: tables.ProtoAny, Port: 6379}),
				}}},
			wantPeers: peers(clientPeer, "cidr:0.0.0.0/0", entityHost),
			wantCIDRs: peers("0.0.0.0/0"),
		},
		{
			name: "allow and deny in one direction",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress: [{toEntities: [world]}]
  egressDeny: [{toCIDR: [192.0.2.0/24]}]`,
			want: []spec{{Subject: webSubject, Egress: true, DefaultDenyEgress: true,
				Rules: []rule{out(false, peers(entityWorld)), out(true, peers("cidr:192.0.2.0/24"))}}},
			wantPeers: peers("cidr:192.0.2.0/24", entityWorld),
			wantCIDRs: peers("192.0.2.0/24"),
		},
		{
			name: "enableDefaultDeny turns default deny off per direction",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  enableDefaultDeny: {ingress: false, egress: true}
  ingress: [{fromEntities: [cluster]}]
  egress: [{toEntities: [world]}]`,
			want: []spec{{Subject: webSubject, Ingress: true, Egress: true, DefaultDenyEgress: true,
				Rules: []rule{in(false, peers(entityCluster)), out(false, peers(entityWorld))}}},
			wantPeers: peers(entityCluster, entityWorld),
		},
		{
			name: "enableDefaultDeny does not turn it on without rules",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  enableDefaultDeny: {ingress: true, egress: true}
  egressDeny: [{toEntities: [world]}]`,
			want: []spec{{Subject: webSubject, Egress: true, DefaultDenyEgress: true,
				Rules: []rule{out(true, peers(entityWorld))}}},
			wantPeers: peers(entityWorld),
		},
		{
			name: "ports in canonical form",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEntities: [cluster]
    toPorts:
    - ports:
      - {port: "80"}                                     # ANY by default
      - {port: 443, protocol: TCP}                       # a YAML number
      - {port: "0080", protocol: TCP}                    # leading zeros
      - {port: "443", protocol: TCP}                     # the same port again: once
      - {protocol: UDP}                                  # no port: every UDP port
      - {port: "0", protocol: SCTP}                      # port 0: every SCTP port
      - {port: "8000", endPort: 8099, protocol: TCP}     # a range
      - {port: "9000", endPort: "9000", protocol: TCP}   # a range of one port is the port
      - {port: "9100", endPort: 0}                       # endPort 0 is unset
    - ports:
      - {port: http-alt, protocol: TCP}                  # a named port
      - {port: "65535", protocol: ANY}`,
			want: []spec{{Subject: webSubject, Egress: true, DefaultDenyEgress: true,
				Rules: []rule{out(false, peers(entityCluster),
					port{Protocol: tables.ProtoAny, Port: 80},
					tcp(443), tcp(80),
					port{Protocol: tables.ProtoUDP},
					port{Protocol: tables.ProtoSCTP},
					port{Protocol: tables.ProtoTCP, Port: 8000, EndPort: 8099},
					tcp(9000),
					port{Protocol: tables.ProtoAny, Port: 9100},
					port{Protocol: tables.ProtoTCP, Name: "http-alt"},
					port{Protocol: tables.ProtoAny, Port: 65535},
				)}}},
			wantPeers: peers(entityCluster),
		},
		{
			name: "spec and specs: one PolicySpec each, in order",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress: [{toEndpoints: [{matchLabels: {k8s:io.kubernetes.pod.namespace: kube-system, k8s-app: kube-dns}}]}]
specs:
- endpointSelector: {matchLabels: {app: web}}
  ingress: [{fromEndpoints: [{matchLabels: {app: client}}]}]
- endpointSelector: {matchLabels: {app: client}}
  egress: [{toEndpoints: [{matchLabels: {app: web}}]}]`,
			want: []spec{
				{Subject: webSubject, Egress: true, DefaultDenyEgress: true, Rules: []rule{out(false, peers(dnsPeer))}},
				{Subject: webSubject, Ingress: true, DefaultDenyIngress: true, Rules: []rule{in(false, peers(clientPeer))}},
				{Subject: clientPeer, Egress: true, DefaultDenyEgress: true, Rules: []rule{out(false, peers(webSubject))}},
			},
			wantPeers: peers(clientPeer, webSubject, dnsPeer),
		},
		{
			// Class 5 of issue 24: an empty list selects nothing, where an
			// absent one leaves the rule to every peer.
			name: "an empty peer list selects nothing",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEndpoints: []
    toPorts: [{ports: [{port: "443", protocol: TCP}]}]
  - toCIDR: [192.0.2.0/24]
    toEntities: []
  - toPorts: [{ports: [{port: "53", protocol: UDP}]}]
  ingressDeny:
  - fromCIDRSet: []
    toPorts: [{ports: [{port: "22", protocol: TCP}]}]`,
			want: []spec{{Subject: webSubject, Ingress: true, Egress: true, DefaultDenyIngress: true, DefaultDenyEgress: true,
				Rules: []rule{
					in(true, peers(), tcp(22)),
					out(false, peers(), tcp(443)),
					out(false, peers()),
					out(false, any, port{Protocol: tables.ProtoUDP, Port: 53}),
				}}},
			wantPeers: peers(),
		},
		{
			name:        "clusterwide: no namespace",
			clusterwide: true,
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress: [{fromEndpoints: [{}], fromEntities: [host]}]`,
			want: []spec{{Subject: "any:app=web", Ingress: true, DefaultDenyIngress: true,
				Rules: []rule{in(false, peers(entityHost, "k8s:io.kubernetes.pod.namespace"))}}},
			wantPeers: peers(entityHost, "k8s:io.kubernetes.pod.namespace"),
		},
		{
			name: "empty unsupported fields and fields outside rules are ignored",
			body: `
spec:
  description: why
  nodeSelector: {}
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEntities: [world]
    icmps: []
    toRequires: null
    toPorts: [{ports: [{port: "443"}], rules: {}}]`,
			want: []spec{{Subject: webSubject, Egress: true, DefaultDenyEgress: true,
				Rules: []rule{out(false, peers(entityWorld), port{Protocol: tables.ProtoAny, Port: 443})}}},
			wantPeers: peers(entityWorld),
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := parseYAML(t, tc.body, tc.clusterwide)
			if p.err != nil {
				t.Fatalf("invalid: %s", p.errorText())
			}
			row := policyRow("cnp/default/p", p, true)
			if got, want := toJSON(t, row.Specs), toJSON(t, tc.want); got != want {
				t.Errorf("specs:\n%s\nwant:\n%s", got, want)
			}
			if !slices.Equal(row.Peers, tc.wantPeers) {
				t.Errorf("peers %q, want %q", row.Peers, tc.wantPeers)
			}
			if !slices.Equal(row.CIDRs, tc.wantCIDRs) {
				t.Errorf("CIDRs %q, want %q", row.CIDRs, tc.wantCIDRs)
			}
			if row.Status != tables.PolicyOK || row.Error != "" {
				t.Errorf("status %s %q", row.Status, row.Error)
			}
			// Every subject and peer the specs name is a selector the
			// policy registers (AnyPeer excepted), and no other.
			registered := map[string]bool{}
			for _, s := range p.selectors() {
				registered[s.String()] = true
			}
			named := map[string]bool{}
			for _, s := range row.Specs {
				named[s.Subject] = true
				for _, r := range s.Rules {
					for _, peer := range r.Peers {
						if peer != tables.AnyPeer {
							named[peer] = true
						}
					}
				}
			}
			for s := range named {
				if !registered[s] {
					t.Errorf("the specs name %s, which is not registered", s)
				}
			}
			for s := range registered {
				if !named[s] {
					t.Errorf("%s is registered but no spec names it", s)
				}
			}
			if slices.Contains(row.Peers, tables.AnyPeer) || registered[tables.AnyPeer] {
				t.Errorf("AnyPeer is a selector: peers %q", row.Peers)
			}
		})
	}
}

func TestParsePolicyErrors(t *testing.T) {
	const web = "\nspec:\n  endpointSelector: {matchLabels: {app: web}}\n"
	for _, tc := range []struct {
		name string
		body string
		err  string // the whole error text
	}{
		{"no spec", "", "the policy has neither spec nor specs"},
		{"no subject", "spec: {ingress: [{}]}", "endpointSelector: missing"},
		{"bad CIDR", web + "  egress: [{toCIDR: [10.0.0.0/40]}]", `egress[0].toCIDR[0]: invalid CIDR "10.0.0.0/40"`},
		{"bad fromCIDR in deny", web + "  ingressDeny: [{}, {fromCIDR: [nope]}]", `ingressDeny[1].fromCIDR[0]: invalid CIDR "nope"`},
		{"except outside", web + "  egress: [{toCIDRSet: [{cidr: 10.0.0.0/8, except: [11.0.0.0/16]}]}]",
			"egress[0].toCIDRSet[0]: except 11.0.0.0/16 is not inside 10.0.0.0/8"},
		{"FQDN with both", web + "  egress: [{toFQDNs: [{matchName: a.com, matchPattern: '*.a.com'}]}]",
			`egress[0].toFQDNs[0]: toFQDNs entry has both matchName "a.com" and matchPattern "*.a.com"`},
		{"FQDN star in a name", web + "  egress: [{toFQDNs: [{matchName: '*.a.com'}]}]", "egress[0].toFQDNs[0]: toFQDNs:"},
		{"bad peer selector", web + "  ingress: [{fromEndpoints: [{matchExpressions: [{key: a, operator: Exists, values: [x]}]}]}]",
			`ingress[0].fromEndpoints[0]: selector "a": operator Exists takes no values`},
		{"entity as a label source", web + "  egressDeny: [{toEndpoints: [{matchLabels: {'entity:world': ''}}]}]",
			`egressDeny[0].toEndpoints[0]: selector key "entity:world": entity: is not a label source (use fromEntities or toEntities)`},
		{"unknown entity", web + "  ingress: [{fromEntities: [host, kube-apiserver]}]",
			`ingress[0].fromEntities[1]: unknown entity "kube-apiserver" (apiary supports world, world-ipv4, world-ipv6, host, remote-node, cluster and all)`},
		{"entities are lower case", web + "  egress: [{toEntities: [World]}]",
			`egress[0].toEntities[0]: unknown entity "World" (apiary supports world, world-ipv4, world-ipv6, host, remote-node, cluster and all)`},
		{"toFQDNs in a deny rule", web + "  egressDeny: [{toFQDNs: [{matchName: a.com}]}]",
			"egressDeny[0].toFQDNs: not allowed in a deny rule"},
		{"toPorts without ports", web + "  egress: [{toPorts: [{ports: [{port: '80'}]}, {}]}]",
			"egress[0].toPorts[1].ports: missing: list at least one port (port 0 for every port)"},
		{"endPort below port", `
specs:
- endpointSelector: {}
- endpointSelector: {}
  egress: [{toPorts: [{ports: [{port: "80", endPort: 79}]}]}]`,
			"specs[1].egress[0].toPorts[0].ports[0].endPort: 79 is below port 80"},
		{"endPort of a named port", web + "  ingress: [{toPorts: [{ports: [{port: '443'}, {port: https, endPort: 444}]}]}]",
			`ingress[0].toPorts[0].ports[1].endPort: 444 needs a numeric port, not the port name "https"`},
		{"endPort without port", web + "  ingress: [{toPorts: [{ports: [{endPort: 90, protocol: TCP}]}]}]",
			"ingress[0].toPorts[0].ports[0].endPort: 90 needs a port to start the range at (port 0 is every port)"},
		{"endPort not a number", web + "  ingress: [{toPorts: [{ports: [{port: '80', endPort: -1}]}]}]",
			"ingress[0].toPorts[0].ports[0].endPort: -1 is not a port number (0-65535)"},
		{"endPort too big", web + "  ingress: [{toPorts: [{ports: [{port: '80', endPort: 65536}]}]}]",
			"ingress[0].toPorts[0].ports[0].endPort: 65536 is not a port number (0-65535)"},
		{"port too big", web + "  egress: [{toPorts: [{ports: [{port: '65536'}]}]}]",
			"egress[0].toPorts[0].ports[0].port: 65536 is not a port number (0-65535)"},
		{"port not an integer", web + "  egress: [{toPorts: [{ports: [{port: 80.5}]}]}]",
			`egress[0].toPorts[0].ports[0].port: "80.5" is neither a port number`},
		{"protocol", web + "  egress: [{toPorts: [{ports: [{port: '8', protocol: ICMP}]}]}]",
			`egress[0].toPorts[0].ports[0].protocol: "ICMP" is not TCP, UDP, SCTP or ANY`},
		// The CRD's enum is upper case; the API server refuses the rest.
		{"protocol in lower case", web + "  egress: [{toPorts: [{ports: [{port: '8', protocol: tcp}]}]}]",
			`egress[0].toPorts[0].ports[0].protocol: "tcp" is not TCP, UDP, SCTP or ANY (the names are upper case)`},
		{"protocol in mixed case", web + "  ingress: [{toPorts: [{ports: [{port: '8', protocol: Udp}]}]}]",
			`ingress[0].toPorts[0].ports[0].protocol: "Udp" is not TCP, UDP, SCTP or ANY (the names are upper case)`},
		{"protocol any", web + "  ingress: [{toPorts: [{ports: [{port: '8', protocol: any}]}]}]",
			`ingress[0].toPorts[0].ports[0].protocol: "any" is not TCP, UDP, SCTP or ANY (the names are upper case)`},
		// Unsupported fields in rules, each named.
		{"L7 rules", web + "  egress: [{toPorts: [{ports: [{port: '80'}], rules: {http: [{method: GET}]}}]}]",
			"egress[0].toPorts[0].rules.http: not supported"},
		{"DNS rules beside others", web + "  egress: [{toPorts: [{ports: [{port: '53'}], rules: {dns: [{matchPattern: '*'}], kafka: [{}]}}]}]",
			"egress[0].toPorts[0].rules.kafka: not supported"},
		{"TLS and listener", web + "  egress: [{toPorts: [{ports: [{port: '443'}], serverNames: [a.com], listener: {name: x}, originatingTLS: {secret: {name: s}}}]}]",
			"egress[0].toPorts[0].listener: not supported; egress[0].toPorts[0].originatingTLS: not supported; egress[0].toPorts[0].serverNames: not supported"},
		{"toServices", web + "  egress: [{toServices: [{k8sService: {serviceName: a}}]}]", "egress[0].toServices: not supported"},
		{"toRequires", web + "  egress: [{toRequires: [{matchLabels: {a: b}}]}]", "egress[0].toRequires: not supported"},
		{"fromRequires", web + "  ingress: [{fromRequires: [{matchLabels: {a: b}}]}]", "ingress[0].fromRequires: not supported"},
		{"icmps", web + "  ingressDeny: [{icmps: [{fields: [{type: 8}]}]}]", "ingressDeny[0].icmps: not supported"},
		{"toGroups", web + "  egress: [{toGroups: [{aws: {labels: {a: b}}}]}]", "egress[0].toGroups: not supported"},
		{"authentication", web + "  ingress: [{fromEntities: [cluster], authentication: {mode: required}}]", "ingress[0].authentication: not supported"},
		{"toNodes", web + "  egress: [{toNodes: [{}]}]", "egress[0].toNodes: not supported"},
		{"an unknown field of a port", web + "  egress: [{toPorts: [{ports: [{port: '80', portName: x}]}]}]", "egress[0].toPorts[0].ports[0].portName: not supported"},
		{"cidrGroupRef", web + "  egress: [{toCIDRSet: [{cidrGroupRef: g}]}]",
			`egress[0].toCIDRSet[0]: invalid CIDR ""; egress[0].toCIDRSet[0].cidrGroupRef: not supported`},
		{"paths in specs", `
spec:
  endpointSelector: {}
  egress: [{toServices: [{}, {}]}]
specs:
- endpointSelector: {}
  ingress: [{fromEntities: [moon]}]`,
			`specs[0].ingress[0].fromEntities[0]: unknown entity "moon" (apiary supports world, world-ipv4, world-ipv6, host, remote-node, cluster and all); spec.egress[0].toServices: not supported`},
		{"several errors", web + "  egress: [{toEntities: [nope], toPorts: [{ports: [{port: '1', endPort: '0x10'}]}]}]",
			`egress[0].toEntities[0]: unknown entity "nope" (apiary supports world, world-ipv4, world-ipv6, host, remote-node, cluster and all); ` +
				`egress[0].toPorts[0].ports[0].endPort: 0x10 is not a port number (0-65535)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := parseYAML(t, tc.body, false)
			if p.err == nil {
				t.Fatalf("valid, want the error %q", tc.err)
			}
			// A few messages come from elsewhere (the FQDN pattern
			// parser) or are long: their start is enough.
			prefixOnly := strings.HasSuffix(tc.err, "neither a port number") || strings.HasSuffix(tc.err, "toFQDNs:")
			if got := p.errorText(); got != tc.err && !(prefixOnly && strings.HasPrefix(got, tc.err)) {
				t.Errorf("error:\n%s\nwant:\n%s", got, tc.err)
			}
			// An invalid policy contributes no peer, prefix or rule; its
			// row says why, and keeps its subjects and the directions it
			// fails closed in.
			if len(p.cidrs) != 0 || len(p.peers) != 0 || len(p.specs) != 0 {
				t.Errorf("an invalid policy contributes peers %v, prefixes %v or specs %v", p.peers, p.cidrs, p.specs)
			}
			row := policyRow("cnp/default/p", p, true)
			if row.Status != tables.PolicyError || row.Error != p.errorText() || len(row.Peers) != 0 ||
				row.FailClosed != (len(row.Specs) > 0) {
				t.Errorf("row %+v", row)
			}
			for _, s := range row.Specs {
				if len(s.Rules) != 0 || s.DefaultDenyIngress != s.Ingress || s.DefaultDenyEgress != s.Egress ||
					!(s.Ingress || s.Egress) || !slices.Contains(row.Subjects, s.Subject) {
					t.Errorf("fail-closed spec %+v (subjects %q)", s, row.Subjects)
				}
			}
		})
	}
}

func TestPortNames(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"http", true},
		{"h", true},
		{"http-alt", true},
		{"h2c", true},
		{"8080-http", true},
		{"a-b-c-d-e-f-g-h", true},   // 15
		{"a-b-c-d-e-f-g-hi", false}, // 16
		{"", false},
		{"HTTP", false}, // container port names are lower case
		{"-http", false},
		{"http-", false},
		{"my--port", false},
		{"123-456", false}, // no letter
		{"web_port", false},
		{"héllo", false},
	} {
		if got := isPortName(tc.name); got != tc.ok {
			t.Errorf("isPortName(%q) = %v, want %v", tc.name, got, tc.ok)
		}
		if tc.ok {
			got, err := parsePort(PortProtocol{Port: PortValue(tc.name)})
			if err != nil || got != (tables.PortRule{Protocol: tables.ProtoAny, Name: tc.name}) {
				t.Errorf("parsePort(%q) = %+v, %v", tc.name, got, err)
			}
		}
	}
}

func TestUnknownFields(t *testing.T) {
	p := decodeCNP(t, `
spec:
  endpointSelector: {matchLabels: {app: web}}
  nodeSelector: {}
  description: ignored
  egress:
  - toCIDR: [10.0.0.0/8]
    toPorts: [{ports: [{port: 80}], rules: {http: [{}]}}]
  - toEndpoints: [{matchLabels: {k8s-app: kube-dns}}]
    toPorts: [{ports: [{port: "53", protocol: ANY}], rules: {dns: [{matchPattern: "*"}]}}]
  ingressDeny: [{icmps: []}]
  enableDefaultDeny: {ingress: false, audit: true}
specs:
- endpointSelector: {}
  egress: [{toFQDNs: [{matchName: a.com, extra: 1}]}]
`)
	// description is a field of Rule, so not unknown.
	wantIgnored := []string{"spec.enableDefaultDeny.audit", "spec.ingressDeny[0].icmps", "spec.nodeSelector"}
	// DNS rules are accepted (the DNS proxy enforces them); other L7 rules are not.
	wantUnsupported := []string{"spec.egress[0].toPorts[0].rules.http", "specs[0].egress[0].toFQDNs[0].extra"}
	if got := p.UnknownFields(); !slices.Equal(got, wantIgnored) {
		t.Errorf("unknown fields %q, want %q", got, wantIgnored)
	}
	if got := p.UnsupportedFields(); !slices.Equal(got, wantUnsupported) {
		t.Errorf("unsupported fields %q, want %q", got, wantUnsupported)
	}
	if p.Spec == nil || len(p.Spec.Egress) != 2 || p.Spec.Egress[0].ToCIDR[0] != "10.0.0.0/8" ||
		p.Spec.Egress[0].ToPorts[0].Ports[0].Port != "80" || p.Name != "p" {
		t.Errorf("decoded %+v", p)
	}
	cp := p.DeepCopyObject().(*CiliumNetworkPolicy)
	if !slices.Equal(cp.UnknownFields(), wantIgnored) || !slices.Equal(cp.UnsupportedFields(), wantUnsupported) ||
		cp.Spec.Egress[0].ToPorts[0].Ports[0].Port != "80" {
		t.Errorf("deep copy lost fields: %+v", cp)
	}
	ccnp := &CiliumClusterwideNetworkPolicy{}
	if err := json.Unmarshal([]byte(`{"spec":{"ingress":[{"fromRequires":[{}]}]}}`), ccnp); err != nil {
		t.Fatal(err)
	}
	// fromRequires: [{}] is not empty (it lists a selector).
	if got := ccnp.UnsupportedFields(); !slices.Equal(got, []string{"spec.ingress[0].fromRequires"}) {
		t.Errorf("clusterwide unsupported fields %q", got)
	}
}

// FuzzParsePort: whatever is written, a port entry either is an error or
// comes out canonical.
func FuzzParsePort(f *testing.F) {
	f.Add("80", "90", "tcp")
	f.Add("http-alt", "", "")
	f.Add("0", "0", "ANY")
	f.Add("65535", "70000", "Udp")
	f.Fuzz(func(t *testing.T, port, endPort, protocol string) {
		got, err := parsePort(PortProtocol{Port: PortValue(port), EndPort: PortValue(endPort), Protocol: protocol})
		if err != nil {
			return
		}
		switch got.Protocol {
		case tables.ProtoTCP, tables.ProtoUDP, tables.ProtoSCTP, tables.ProtoAny:
		default:
			t.Fatalf("%q %q %q: protocol %q", port, endPort, protocol, got.Protocol)
		}
		if got.Name != "" && (got.Port != 0 || got.EndPort != 0 || !isPortName(got.Name)) {
			t.Fatalf("%q %q %q: named port %+v", port, endPort, protocol, got)
		}
		if got.EndPort != 0 && (got.Port == 0 || got.EndPort <= got.Port) {
			t.Fatalf("%q %q %q: range %+v", port, endPort, protocol, got)
		}
	})
}

func TestAuditAnnotation(t *testing.T) {
	for _, tc := range []struct {
		value     *string
		wantAudit bool
		wantErr   string
	}{
		{nil, false, ""},
		{ptr("true"), true, ""},
		{ptr(" TRUE "), true, ""},
		{ptr("false"), false, ""},
		{ptr("yes"), false, `annotation apiary.io/audit: "yes" is neither true nor false`},
	} {
		annotations := map[string]string{}
		if tc.value != nil {
			annotations[AuditAnnotation] = *tc.value
		}
		p := (&parsedPolicy{name: "cnp/default/p"}).withAudit(annotations)
		if p.audit != tc.wantAudit || p.errorText() != tc.wantErr {
			t.Errorf("%v: audit %t error %q, want %t %q", annotations, p.audit, p.errorText(), tc.wantAudit, tc.wantErr)
		}
	}
}

func ptr[T any](v T) *T { return &v }

// TestEmptyPeerListSurvivesCopy: informer stores hand out copies made
// through JSON; an empty peer list must stay empty there, not become an
// absent one (which would open the rule to every peer).
func TestEmptyPeerListSurvivesCopy(t *testing.T) {
	p := decodeCNP(t, `
spec:
  endpointSelector: {}
  egress: [{toEndpoints: [], toPorts: [{ports: [{port: "443", protocol: TCP}]}]}]`)
	c := p.DeepCopyObject().(*CiliumNetworkPolicy)
	got := parsePolicy("cnp/default/p", "default", c.Spec, c.Specs, c.UnsupportedFields())
	if got.err != nil {
		t.Fatal(got.err)
	}
	if peers := got.specs[0].Rules[0].Peers; len(peers) != 0 {
		t.Errorf("after a copy the rule's peers are %q, want none", peers)
	}
}

// TestFailClosedSpecs: what an invalid policy leaves to enforce, and
// whether its row enforces it.
func TestFailClosedSpecs(t *testing.T) {
	type spec = tables.PolicySpec
	deny := func(subject string, in, out bool) spec {
		return spec{Subject: subject, Ingress: in, Egress: out, DefaultDenyIngress: in, DefaultDenyEgress: out}
	}
	const http = `
    toPorts: [{ports: [{port: "80", protocol: TCP}], rules: {http: [{method: GET}]}}]`
	for _, tc := range []struct {
		name        string
		body        string
		annotations map[string]string
		mode        bool // failClosed
		want        []spec
		wantRow     bool // row.FailClosed
	}{
		{
			name: "an L7 rule in the only egress rule: egress denied",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEndpoints: [{matchLabels: {app: client}}]` + http,
			mode: true, want: []spec{deny(webSubject, false, true)}, wantRow: true,
		},
		{
			name: "ignored: the row keeps what it would deny, not enforced",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toEndpoints: [{matchLabels: {app: client}}]` + http,
			mode: false, want: []spec{deny(webSubject, false, true)}, wantRow: false,
		},
		{
			name: "every spec of the policy, the valid ones too, in their directions",
			body: `
specs:
- endpointSelector: {matchLabels: {app: web}}
  ingress: [{fromEntities: [cluster]}]
- endpointSelector: {matchLabels: {app: client}}
  egress: [{toEntities: [moon]}]
  ingressDeny: [{fromEntities: [world]}]`,
			mode: true, want: []spec{deny(webSubject, true, false), deny(clientPeer, true, true)}, wantRow: true,
		},
		{
			name: "enableDefaultDeny false does not keep a direction open",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  enableDefaultDeny: {egress: false}
  egressDeny:
  - toCIDR: [10.0.0.0/33]`,
			mode: true, want: []spec{deny(webSubject, false, true)}, wantRow: true,
		},
		{
			name: "a subject that does not parse selects nobody",
			body: `
specs:
- endpointSelector: {matchExpressions: [{key: app, operator: Exists, values: [x]}]}
  egress: [{}]
- endpointSelector: {matchLabels: {app: web}}
  ingress: [{}]`,
			mode: true, want: []spec{deny(webSubject, true, false)}, wantRow: true,
		},
		{
			name: "no direction: nothing to deny",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress: [{toPorts: [{ports: [{port: "80", protocol: tcp}]}]}]
specs:
- endpointSelector: {matchLabels: {app: client}}`,
			mode: true, want: []spec{deny(webSubject, false, true)}, wantRow: true,
		},
		{
			name: "an invalid audit annotation: the parsed rules fail closed",
			body: `
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress: [{toEntities: [world]}]`,
			annotations: map[string]string{AuditAnnotation: "maybe"},
			mode:        true, want: []spec{deny(webSubject, false, true)}, wantRow: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := parseYAML(t, tc.body, false).withAudit(tc.annotations)
			if p.err == nil {
				t.Fatal("valid")
			}
			row := policyRow("cnp/default/p", p, tc.mode)
			if got, want := toJSON(t, row.Specs), toJSON(t, tc.want); got != want {
				t.Errorf("specs:\n%s\nwant:\n%s", got, want)
			}
			if row.FailClosed != tc.wantRow || row.Status != tables.PolicyError {
				t.Errorf("row: failClosed %t status %s, want %t", row.FailClosed, row.Status, tc.wantRow)
			}
			if len(row.Peers) != 0 || len(row.CIDRs) != 0 || len(p.peers) != 0 {
				t.Errorf("peers %q, CIDRs %q", row.Peers, row.CIDRs)
			}
		})
	}
}

// TestDNSRules: the names of an egress allow rule's DNS rules are kept on
// the rule, normalized and each once; an empty list allows every name;
// ingress and deny rules carry none; a bad entry makes the policy invalid.
func TestDNSRules(t *testing.T) {
	const web = "spec:\n  endpointSelector: {matchLabels: {app: web}}\n"
	for _, tc := range []struct {
		name, body string
		want       [][]string // DNS of each rule
		err        string
	}{
		{"names and patterns", web + `  egress:
  - toPorts:
    - ports: [{port: "53", protocol: UDP}]
      rules: {dns: [{matchPattern: "*.Example.COM."}, {matchName: api.example.org}]}
    - ports: [{port: "53", protocol: TCP}]
      rules: {dns: [{matchPattern: "*.example.com"}]}`, [][]string{{"*.example.com", "api.example.org"}}, ""},
		{"an empty list allows every name", web + `  egress: [{toPorts: [{ports: [{port: "53"}], rules: {dns: []}}]}]`, [][]string{{"*"}}, ""},
		{"no DNS rule", web + `  egress: [{toPorts: [{ports: [{port: "53"}]}]}]`, [][]string{nil}, ""},
		{"ingress carries none", web + `  ingress: [{toPorts: [{ports: [{port: "53"}], rules: {dns: [{matchName: a.com}]}}]}]`, [][]string{nil}, ""},
		{"deny carries none", web + `  egressDeny: [{toPorts: [{ports: [{port: "53"}], rules: {dns: [{matchName: a.com}]}}]}]`, [][]string{nil}, ""},
		{"neither name nor pattern", web + `  egress: [{toPorts: [{ports: [{port: "53"}], rules: {dns: [{}]}}]}]`, nil,
			"egress[0].toPorts[0].rules.dns[0]: toFQDNs entry has neither matchName nor matchPattern"},
		{"a bad pattern", web + `  egress: [{toPorts: [{ports: [{port: "53"}], rules: {dns: [{matchPattern: "a..b"}]}}]}]`, nil,
			"egress[0].toPorts[0].rules.dns[0]: toFQDNs:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pp := parseYAML(t, tc.body, false)
			if tc.err != "" {
				if pp.err == nil || !strings.Contains(pp.err.Error(), tc.err) {
					t.Fatalf("error %v, want one with %q", pp.err, tc.err)
				}
				return
			}
			if pp.err != nil {
				t.Fatalf("error: %v", pp.err)
			}
			var got [][]string
			for _, r := range pp.specs[0].Rules {
				got = append(got, r.DNS)
			}
			if toJSON(t, got) != toJSON(t, tc.want) {
				t.Errorf("DNS of the rules: %v, want %v", got, tc.want)
			}
		})
	}
}
