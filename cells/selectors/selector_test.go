package selectors

import (
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
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := ParseEndpointSelector(tc.es, tc.ns)
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
	all, _ := ParseEndpointSelector(EndpointSelector{}, "")
	if all.Matches(tables.NewLabels("cidr:10.0.0.0/8", "reserved:world")) {
		t.Error("the empty label selector selects a CIDR identity")
	}
}

func TestParsePolicyErrors(t *testing.T) {
	sel := &EndpointSelector{}
	for _, tc := range []struct {
		name string
		rule Rule
		err  string
	}{
		{"no subject", Rule{}, "endpointSelector: missing"},
		{"bad cidr", Rule{EndpointSelector: sel, Egress: []EgressRule{{ToCIDR: []string{"10.0.0.0/40"}}}}, `egress[0].toCIDR[0]: invalid CIDR "10.0.0.0/40"`},
		{"except outside", Rule{EndpointSelector: sel, Egress: []EgressRule{{ToCIDRSet: []CIDRRule{{CIDR: "10.0.0.0/8", Except: []string{"11.0.0.0/16"}}}}}}, "except 11.0.0.0/16 is not inside 10.0.0.0/8"},
		{"fqdn both", Rule{EndpointSelector: sel, Egress: []EgressRule{{ToFQDNs: []FQDNSelector{{MatchName: "a.com", MatchPattern: "*.a.com"}}}}}, "both"},
		{"fqdn star in name", Rule{EndpointSelector: sel, Egress: []EgressRule{{ToFQDNs: []FQDNSelector{{MatchName: "*.a.com"}}}}}, "not allowed"},
		{"bad peer", Rule{EndpointSelector: sel, Ingress: []IngressRule{{FromEndpoints: []EndpointSelector{{MatchExpressions: []LabelSelectorRequirement{{Key: "a", Operator: "Exists", Values: []string{"x"}}}}}}}}, "ingress[0].fromEndpoints[0]"},
	} {
		p := parsePolicy("cnp/default/x", "default", &tc.rule, nil)
		if p.err == nil || !strings.Contains(p.errorText(), tc.err) {
			t.Errorf("%s: got %v, want an error with %q", tc.name, p.err, tc.err)
		}
		if len(p.cidrs) != 0 || len(p.selectors()) != 0 {
			t.Errorf("%s: an invalid policy contributes selectors or prefixes", tc.name)
		}
	}
	if p := parsePolicy("cnp/default/x", "default", nil, nil); p.err == nil {
		t.Error("a policy without spec is valid")
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

func TestUnknownFields(t *testing.T) {
	data := []byte(`{"apiVersion":"cilium.io/v2","kind":"CiliumNetworkPolicy","metadata":{"name":"x","labels":{"a":"b"}},
	"spec":{"endpointSelector":{"matchLabels":{"app":"web"}},"nodeSelector":{},
	  "egress":[{"toCIDR":["10.0.0.0/8"],"toPorts":[{"ports":[{"port":"80"}]}]}],
	  "ingressDeny":[{}]},
	"specs":[{"endpointSelector":{},"egress":[{"toFQDNs":[{"matchName":"a.com","extra":1}]}]}]}`)
	var p CiliumNetworkPolicy
	if err := p.UnmarshalJSON(data); err != nil {
		t.Fatal(err)
	}
	want := []string{"spec.egress[0].toPorts", "spec.ingressDeny", "spec.nodeSelector", "specs[0].egress[0].toFQDNs[0].extra"}
	if got := p.UnknownFields(); strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("unknown fields %v, want %v", got, want)
	}
	if p.Spec == nil || len(p.Spec.Egress) != 1 || p.Spec.Egress[0].ToCIDR[0] != "10.0.0.0/8" || p.Name != "x" {
		t.Errorf("decoded %+v", p)
	}
	if cp := p.DeepCopyObject().(*CiliumNetworkPolicy); len(cp.UnknownFields()) != 4 || cp.Name != "x" {
		t.Errorf("deep copy lost fields: %+v", cp)
	}
}
