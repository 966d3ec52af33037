package selectors

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
)

// parsedPolicy is what a policy contributes: the selectors of its subjects
// and peers and the prefixes that need cidr: labels. An invalid policy
// contributes nothing and carries the error.
type parsedPolicy struct {
	name     string
	subjects []Selector
	peers    []Selector
	cidrs    []netip.Prefix
	err      error
}

// parsePolicy parses the rules of a policy. namespace is empty for a
// clusterwide policy; for a namespaced one it restricts the endpoint
// selectors to the policy's namespace.
func parsePolicy(name, namespace string, spec *Rule, specs []Rule) *parsedPolicy {
	p := &parsedPolicy{name: name}
	rules := specs
	if spec != nil {
		rules = append([]Rule{*spec}, specs...)
	}
	if len(rules) == 0 {
		p.err = errors.New("the policy has neither spec nor specs")
		return p
	}
	var errs []error
	addErr := func(rule int, what string, err error) {
		if len(rules) > 1 {
			what = fmt.Sprintf("specs[%d].%s", rule, what)
		}
		errs = append(errs, fmt.Errorf("%s: %w", what, err))
	}
	subjects := map[string]Selector{}
	peers := map[string]Selector{}
	cidrs := map[netip.Prefix]struct{}{}
	addCIDR := func(s *CIDRSelector) {
		peers[s.String()] = s
		for _, pfx := range s.Prefixes() {
			cidrs[pfx] = struct{}{}
		}
	}
	endpoints := func(rule int, what string, list []EndpointSelector) {
		for i, es := range list {
			sel, err := ParseEndpointSelector(es, namespace)
			if err != nil {
				addErr(rule, fmt.Sprintf("%s[%d]", what, i), err)
				continue
			}
			peers[sel.String()] = sel
		}
	}
	cidrList := func(rule int, what string, list []string) {
		for i, c := range list {
			sel, err := ParseCIDR(c, nil)
			if err != nil {
				addErr(rule, fmt.Sprintf("%s[%d]", what, i), err)
				continue
			}
			addCIDR(sel)
		}
	}
	cidrSets := func(rule int, what string, list []CIDRRule) {
		for i, c := range list {
			sel, err := ParseCIDR(c.CIDR, c.Except)
			if err != nil {
				addErr(rule, fmt.Sprintf("%s[%d]", what, i), err)
				continue
			}
			addCIDR(sel)
		}
	}
	for r, rule := range rules {
		if rule.EndpointSelector == nil {
			addErr(r, "endpointSelector", errors.New("missing"))
		} else if sel, err := ParseEndpointSelector(*rule.EndpointSelector, namespace); err != nil {
			addErr(r, "endpointSelector", err)
		} else {
			subjects[sel.String()] = sel
		}
		for i, in := range rule.Ingress {
			endpoints(r, fmt.Sprintf("ingress[%d].fromEndpoints", i), in.FromEndpoints)
			cidrList(r, fmt.Sprintf("ingress[%d].fromCIDR", i), in.FromCIDR)
			cidrSets(r, fmt.Sprintf("ingress[%d].fromCIDRSet", i), in.FromCIDRSet)
		}
		for i, out := range rule.Egress {
			endpoints(r, fmt.Sprintf("egress[%d].toEndpoints", i), out.ToEndpoints)
			cidrList(r, fmt.Sprintf("egress[%d].toCIDR", i), out.ToCIDR)
			cidrSets(r, fmt.Sprintf("egress[%d].toCIDRSet", i), out.ToCIDRSet)
			for j, f := range out.ToFQDNs {
				sel, err := ParseFQDN(f)
				if err != nil {
					addErr(r, fmt.Sprintf("egress[%d].toFQDNs[%d]", i, j), err)
					continue
				}
				peers[sel.String()] = sel
			}
		}
	}
	if len(errs) > 0 {
		p.err = errors.Join(errs...)
		return p
	}
	p.subjects = sortedSelectors(subjects)
	p.peers = sortedSelectors(peers)
	// Sorted as text, each prefix formatted once.
	type named struct {
		text string
		pfx  netip.Prefix
	}
	byText := make([]named, 0, len(cidrs))
	for pfx := range cidrs {
		byText = append(byText, named{pfx.String(), pfx})
	}
	slices.SortFunc(byText, func(a, b named) int { return strings.Compare(a.text, b.text) })
	for _, n := range byText {
		p.cidrs = append(p.cidrs, n.pfx)
	}
	return p
}

func sortedSelectors(m map[string]Selector) []Selector {
	out := make([]Selector, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, m[k])
	}
	return out
}

// selectors returns every selector of the policy, subjects first.
func (p *parsedPolicy) selectors() []Selector {
	return append(slices.Clone(p.subjects), p.peers...)
}

// errorText is the error in one line, for the policies table and health.
func (p *parsedPolicy) errorText() string {
	if p.err == nil {
		return ""
	}
	return strings.ReplaceAll(p.err.Error(), "\n", "; ")
}
