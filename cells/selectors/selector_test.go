package selectors

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/tables"
)

func TestCIDRSelector(t *testing.T) {
	l := tables.NewLabels
	for _, tc := range []struct {
		cidr   string
		except []string
		labels tables.Labels
		want   bool
	}{
		{"192.0.2.0/24", nil, l("cidr:192.0.2.0/24", "reserved:world"), true},
		// Prefix-aware: the /25 only carries its own label.
		{"192.0.2.0/24", nil, l("cidr:192.0.2.128/25", "reserved:world"), true},
		{"192.0.2.128/25", nil, l("cidr:192.0.2.0/24", "reserved:world"), false},
		{"192.0.2.0/24", nil, l("cidr:198.51.100.0/24"), false},
		{"192.0.2.0/24", []string{"192.0.2.128/25"}, l("cidr:192.0.2.192/26"), false},
		{"192.0.2.0/24", []string{"192.0.2.128/25"}, l("cidr:192.0.2.0/25"), true},
		{"192.0.2.0/24", []string{"192.0.2.128/25"}, l("cidr:192.0.2.0/24"), true},
		{"0.0.0.0/0", nil, l("reserved:world"), true},
		{"0.0.0.0/0", nil, l("reserved:world-ipv6"), false},
		{"::/0", nil, l("cidr:fd00::/64", "reserved:world-ipv6"), true},
		{"fd00::/16", nil, l("cidr:10.0.0.0/8"), false},
		{"192.0.2.0/24", nil, l("fqdn:*.example.com", "reserved:world"), false},
	} {
		s, err := ParseCIDR(tc.cidr, tc.except)
		if err != nil {
			t.Fatal(err)
		}
		if got := s.Matches(tc.labels); got != tc.want {
			t.Errorf("%s matches %s: %v, want %v", s, tc.labels, got, tc.want)
		}
	}
}

// A ClusterNetworkPolicy networks peer selects what the CIDR rule of its
// prefix does, and the pods whose addresses are inside it (podnet:); a
// CIDR rule never selects a pod.
func TestNetworksSelector(t *testing.T) {
	l := tables.NewLabels
	pod := func(net string) tables.Labels { return l("k8s:app=web", "podnet:"+net) }
	for _, tc := range []struct {
		prefix           string
		labels           tables.Labels
		networks, asCIDR bool
	}{
		{"10.0.0.0/8", l("cidr:10.0.0.0/8", "reserved:world"), true, true},
		{"10.0.0.0/8", pod("10.0.1.0/24"), true, false},
		{"10.0.0.0/8", pod("10.0.0.0/8"), true, false},
		{"10.0.1.0/24", pod("10.0.0.0/8"), false, false},
		{"10.0.2.0/24", pod("10.0.1.0/24"), false, false},
		{"fd00::/16", pod("10.0.1.0/24"), false, false},
		{"10.0.0.0/8", l("k8s:app=web"), false, false},
	} {
		s, err := ParseCIDR(tc.prefix, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got := s.Matches(tc.labels); got != tc.asCIDR {
			t.Errorf("%s matches %s: %v, want %v", s, tc.labels, got, tc.asCIDR)
		}
		s.networks()
		if got := s.Matches(tc.labels); got != tc.networks {
			t.Errorf("%s matches %s: %v, want %v", s, tc.labels, got, tc.networks)
		}
		if s.String() != "networks:"+tc.prefix {
			t.Errorf("text %q", s.String())
		}
	}
}

func TestEndpointSelector(t *testing.T) {
	web := tables.NewLabels("k8s:app=web", "k8s:tier=front", "k8s:io.kubernetes.pod.namespace=default")
	for _, tc := range []struct {
		name  string
		es    EndpointSelector
		ns    string
		text  string
		match bool
		err   string
	}{
		{name: "match labels", es: EndpointSelector{MatchLabels: map[string]string{"app": "web"}}, ns: "default",
			text: "any:app=web, k8s:io.kubernetes.pod.namespace=default", match: true},
		{name: "other namespace", es: EndpointSelector{MatchLabels: map[string]string{"app": "web"}}, ns: "prod",
			text: "any:app=web, k8s:io.kubernetes.pod.namespace=prod", match: false},
		{name: "explicit namespace wins", es: EndpointSelector{MatchLabels: map[string]string{"k8s:io.kubernetes.pod.namespace": "default"}}, ns: "prod",
			text: "k8s:io.kubernetes.pod.namespace=default", match: true},
		{name: "source must match", es: EndpointSelector{MatchLabels: map[string]string{"reserved:app": "web"}},
			text: "reserved:app=web", match: false},
		{name: "in", es: EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "tier", Operator: "In", Values: []string{"front", "back"}}}},
			text: "any:tier in (back,front)", match: true},
		{name: "notin", es: EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "tier", Operator: "NotIn", Values: []string{"front"}}}},
			text: "any:tier notin (front)", match: false},
		{name: "exists", es: EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "k8s:app", Operator: "Exists"}}},
			text: "k8s:app", match: true},
		{name: "does not exist", es: EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "app", Operator: "DoesNotExist"}}},
			text: "!any:app", match: false},
		{name: "all", es: EndpointSelector{}, text: "all", match: true},
		{name: "bad operator", es: EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "app", Operator: "Like"}}},
			err: "unknown operator"},
		{name: "in without values", es: EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "app", Operator: "In"}}},
			err: "needs values"},
		{name: "empty key", es: EndpointSelector{MatchLabels: map[string]string{"k8s:": "x"}}, err: "empty"},
		// Its text would be an entity selector's.
		{name: "entity source", es: EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "entity:world", Operator: "Exists"}}},
			err: "is not a label source"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parse := ParseEndpointSelector
			if tc.ns == "" {
				parse = func(es EndpointSelector, _ string) (*LabelSelector, error) { return ParseLabelSelector(es) }
			}
			s, err := parse(tc.es, tc.ns)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("got %v, want an error with %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if s.String() != tc.text {
				t.Errorf("text %q, want %q", s, tc.text)
			}
			if got := s.Matches(web); got != tc.match {
				t.Errorf("matches %v, want %v", got, tc.match)
			}
		})
	}
	// CIDR identities are selected by CIDR selectors only.
	all, _ := ParseLabelSelector(EndpointSelector{})
	if all.Matches(tables.NewLabels("cidr:10.0.0.0/8", "reserved:world")) {
		t.Error("the empty label selector selects a CIDR identity")
	}
}

func FuzzParseSelectors(f *testing.F) {
	f.Add("10.0.0.0/8", "10.1.0.0/16", "k8s:app", "In", "web")
	f.Add("fd00::/8", "", "tier", "Exists", "")
	f.Fuzz(func(t *testing.T, cidr, except, key, op, value string) {
		if s, err := ParseCIDR(cidr, []string{except}); err == nil {
			s.Matches(tables.NewLabels("cidr:"+cidr, "cidr:"+except))
			for _, e := range s.Except {
				if !s.Prefix.Contains(e.Addr()) || e.Bits() < s.Prefix.Bits() {
					t.Fatalf("%s: except %s outside", s, e)
				}
			}
		}
		es := EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: key, Operator: op, Values: []string{value}}}}
		if s, err := ParseEndpointSelector(es, "ns"); err == nil {
			s.Matches(tables.NewLabels(key + "=" + value))
			if s.String() == "" {
				t.Fatal("empty selector text")
			}
		}
		ParseFQDN(FQDNSelector{MatchPattern: value})
	})
}

// reservedLabels are the label sets of the reserved identities, by number,
// as identity.Reserved has them.
var reservedLabels = map[uint32]tables.Labels{
	1:  tables.NewLabels(tables.LabelHost),
	2:  tables.NewLabels(tables.LabelWorld),
	3:  tables.NewLabels(tables.LabelUnmanaged),
	4:  tables.NewLabels(tables.LabelHealth),
	5:  tables.NewLabels(tables.LabelInit),
	6:  tables.NewLabels(tables.LabelRemoteNode),
	7:  tables.NewLabels(tables.LabelKubeAPIServer, tables.LabelRemoteNode),
	8:  tables.NewLabels(tables.LabelIngress),
	9:  tables.NewLabels(tables.LabelWorldIPv4),
	10: tables.NewLabels(tables.LabelWorldIPv6),
}

// entityTestIdentities are reservedLabels and identities of every other
// kind: workloads, CIDRs (IPv4 and IPv6, with --enable-ipv6's world
// labels too), FQDN names.
func entityTestIdentities() map[uint32]tables.Labels {
	ids := map[uint32]tables.Labels{
		256:      tables.NewLabels("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"),
		257:      tables.NewLabels("k8s:app=db", "k8s:io.kubernetes.pod.namespace=prod"),
		16777217: tables.NewLabels("cidr:192.0.2.0/24", tables.LabelWorld),
		16777218: tables.NewLabels("cidr:192.0.2.0/24", tables.LabelWorldIPv4),
		16777219: tables.NewLabels("cidr:2001:db8::/64", tables.LabelWorldIPv6),
		16777220: tables.NewLabels("fqdn:*.example.com", tables.LabelWorld),
		16777221: tables.NewLabels("cidr:198.51.100.0/24", "fqdn:*.example.com", tables.LabelWorld),
	}
	for id, l := range reservedLabels {
		ids[id] = l
	}
	return ids
}

// entitySelections are what each entity selects of entityTestIdentities.
var entitySelections = map[string][]uint32{
	EntityWorld:     {2, 9, 10, 16777217, 16777218, 16777219, 16777220, 16777221},
	EntityWorldIPv4: {2, 9, 16777217, 16777218, 16777220, 16777221},
	EntityWorldIPv6: {2, 10, 16777219, 16777220},
	EntityHost:      {1},
	// The API server's identity is a remote node's too.
	EntityRemoteNode: {6, 7},
	EntityCluster:    {1, 3, 4, 5, 6, 7, 8, 256, 257},
}

func TestEntitySelector(t *testing.T) {
	ids := entityTestIdentities()
	for _, tc := range []struct {
		entity string
		text   string
	}{
		{EntityWorld, "entity:world"},
		{EntityWorldIPv4, "entity:world-ipv4"},
		{EntityWorldIPv6, "entity:world-ipv6"},
		{EntityHost, "entity:host"},
		{EntityRemoteNode, "entity:remote-node"},
		{EntityCluster, "entity:cluster"},
	} {
		sel, peer, err := ParseEntity(tc.entity)
		if err != nil || sel == nil || sel.String() != tc.text || peer != tc.text {
			t.Fatalf("ParseEntity(%s) = %v, %q, %v; want the selector %s", tc.entity, sel, peer, err, tc.text)
		}
		var got []uint32
		for id, l := range ids {
			if sel.Matches(l) {
				got = append(got, id)
			}
		}
		slices.Sort(got)
		if want := entitySelections[tc.entity]; !slices.Equal(got, want) {
			t.Errorf("%s selects %v, want %v", sel, got, want)
		}
	}
	// The world and the cluster split every identity between them.
	for id, l := range ids {
		world := slices.Contains(entitySelections[EntityWorld], id)
		cluster := slices.Contains(entitySelections[EntityCluster], id)
		if world == cluster {
			t.Errorf("identity %d (%s): world %v, cluster %v", id, l, world, cluster)
		}
	}
	if sel, peer, err := ParseEntity(EntityAll); sel != nil || peer != tables.AnyPeer || err != nil {
		t.Errorf("ParseEntity(all) = %v, %q, %v; want AnyPeer", sel, peer, err)
	}
	for _, bad := range []string{"", "World", "Remote-Node", "health", "kube-apiserver", "none"} {
		if _, _, err := ParseEntity(bad); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("unknown entity %q", bad)) {
			t.Errorf("ParseEntity(%q): %v, want an error naming it", bad, err)
		}
	}
}

// TestLabelSelectorsUnchanged pins what label selectors select of the
// reserved identities and the others, which entity selectors must not
// have changed: everything of the cluster, never the world.
func TestLabelSelectorsUnchanged(t *testing.T) {
	ids := entityTestIdentities()
	for _, tc := range []struct {
		es   EndpointSelector
		ns   string
		want []uint32
	}{
		{EndpointSelector{}, "", []uint32{1, 3, 4, 5, 6, 7, 8, 256, 257}},
		{EndpointSelector{}, "default", []uint32{256}},
		{EndpointSelector{MatchLabels: map[string]string{"reserved:host": ""}}, "", []uint32{1}}, // a label without value is ""
		{EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "reserved:host", Operator: opExists}}}, "", []uint32{1}},
		{EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "reserved:world", Operator: opExists}}}, "", nil},
		{EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "app", Operator: opDoesNotExist}}}, "", []uint32{1, 3, 4, 5, 6, 7, 8}},
	} {
		sel, err := ParseEndpointSelector(tc.es, tc.ns)
		if tc.ns == "" {
			sel, err = ParseLabelSelector(tc.es)
		}
		if err != nil {
			t.Fatal(err)
		}
		var got []uint32
		for id, l := range ids {
			if sel.Matches(l) {
				got = append(got, id)
			}
		}
		slices.Sort(got)
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s selects %v, want %v", sel, got, tc.want)
		}
	}
}

// TestNamespaceRules: the namespace requirement a policy adds to its
// selectors, as the reference adds it (classes 1–4 of issue 24), by the
// identities each selects among pods of two namespaces, the host and the
// other reserved identities.
func TestNamespaceRules(t *testing.T) {
	ids := map[uint32]tables.Labels{
		1: tables.NewLabels(tables.LabelHost),
		4: tables.NewLabels(tables.LabelHealth),
		// alpha/web, beta/web, beta/server in a namespace labelled env=dev,
		// gamma/server in one labelled env=prod.
		300: tables.NewLabels("k8s:app=web", "k8s:io.kubernetes.pod.namespace=alpha"),
		301: tables.NewLabels("k8s:app=web", "k8s:io.kubernetes.pod.namespace=beta", "k8s:io.cilium.k8s.namespace.labels.env=dev"),
		302: tables.NewLabels("k8s:app=server", "k8s:io.kubernetes.pod.namespace=beta", "k8s:io.cilium.k8s.namespace.labels.env=dev"),
		303: tables.NewLabels("k8s:app=server", "k8s:io.kubernetes.pod.namespace=gamma", "k8s:io.cilium.k8s.namespace.labels.env=prod"),
		304: tables.NewLabels("k8s:app=server", "k8s:io.kubernetes.pod.namespace=delta", "k8s:io.cilium.k8s.namespace.labels.env=dev"),
	}
	ml := func(kv ...string) EndpointSelector {
		m := map[string]string{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return EndpointSelector{MatchLabels: m}
	}
	for _, tc := range []struct {
		name    string
		subject bool
		ns      string // "" for a clusterwide policy
		es      EndpointSelector
		want    []uint32
	}{
		// Class 1: a namespaced policy's subjects are in its namespace.
		{"subject naming another namespace (any:) selects nothing", true, "beta",
			ml("app", "web", "io.kubernetes.pod.namespace", "alpha"), nil},
		{"subject naming another namespace (k8s:) is overridden", true, "beta",
			ml("app", "web", "k8s:io.kubernetes.pod.namespace", "alpha"), []uint32{301}},
		{"subject with a namespace expression stays in its namespace", true, "beta",
			EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "io.kubernetes.pod.namespace", Operator: opIn, Values: []string{"alpha", "beta"}}}},
			[]uint32{301, 302}},
		{"empty subject: every pod of the namespace", true, "beta", EndpointSelector{}, []uint32{301, 302}},
		{"clusterwide subject is not restricted", true, "", ml("app", "web"), []uint32{300, 301}},
		// A peer naming a namespace selects there.
		{"peer naming another namespace", false, "beta",
			ml("app", "web", "io.kubernetes.pod.namespace", "alpha"), []uint32{300}},
		{"peer of a namespaced policy: its namespace", false, "beta", ml("app", "server"), []uint32{302}},
		// Class 2: namespace labels select across namespaces.
		{"peer on namespace labels: every such namespace", false, "beta",
			ml("app", "server", "io.cilium.k8s.namespace.labels.env", "dev"), []uint32{302, 304}},
		{"peer on namespace labels (k8s:, expression)", false, "beta",
			EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "k8s:io.cilium.k8s.namespace.labels.env", Operator: opExists}}},
			[]uint32{301, 302, 303, 304}},
		// Class 3: reserved: keys get no namespace.
		{"reserved:host in a namespaced policy", false, "beta", ml("reserved:host", ""), []uint32{1}},
		{"reserved:health expression in a namespaced policy", false, "beta",
			EndpointSelector{MatchExpressions: []LabelSelectorRequirement{{Key: "reserved:health", Operator: opExists}}}, []uint32{4}},
		{"reserved:host in a clusterwide policy", false, "", ml("reserved:host", ""), []uint32{1}},
		// Class 4: a clusterwide policy's peers are pods.
		{"empty clusterwide peer: every pod, not the host", false, "", EndpointSelector{}, []uint32{300, 301, 302, 303, 304}},
		{"clusterwide peer by label", false, "", ml("app", "server"), []uint32{302, 303, 304}},
		{"empty namespaced peer: the namespace's pods", false, "beta", EndpointSelector{}, []uint32{301, 302}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parse := ParseEndpointSelector
			if tc.subject {
				parse = ParseSubjectSelector
			}
			sel, err := parse(tc.es, tc.ns)
			if err != nil {
				t.Fatal(err)
			}
			var got []uint32
			for id, l := range ids {
				if sel.Matches(l) {
					got = append(got, id)
				}
			}
			slices.Sort(got)
			if !slices.Equal(got, tc.want) {
				t.Errorf("%s selects %v, want %v", sel, got, tc.want)
			}
		})
	}
}
