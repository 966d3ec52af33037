package selectors

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/apiary-net/apiary/tables"
)

// parsedPolicy is what a policy contributes: the selectors of its subjects
// and peers, the prefixes that need cidr: labels, and its specs in the
// form enforcement uses. An invalid policy carries the error, no peers, no
// prefixes and no specs; it keeps the subjects that parsed and, in
// failClosed, what it would have put its subjects into default deny in.
type parsedPolicy struct {
	name     string
	subjects []Selector
	peers    []Selector // every peer selector of every rule (not AnyPeer)
	cidrs    []netip.Prefix
	// podNets are the prefixes of cidrs whose pods the policy selects by
	// address (ClusterNetworkPolicy networks): they get podnet: labels.
	podNets []netip.Prefix
	specs   []tables.PolicySpec
	// failClosed are the specs an invalid policy leaves (see
	// failClosedSpecs).
	failClosed []tables.PolicySpec
	// audit: the policy's denies are audited (AuditAnnotation).
	audit bool
	// labelKeys are tables.Policy.SelectedLabelKeys.
	labelKeys []string
	err       error
}

// AuditAnnotation, set to "true" on a policy, makes what only that policy
// denies go through, reported as audited: a new policy can be tried on
// live traffic before it is enforced.
const AuditAnnotation = "apiary.io/audit"

// withAudit applies the policy's audit annotation to p: "true" or
// "false" (any case); anything else makes the policy invalid.
func (p *parsedPolicy) withAudit(annotations map[string]string) *parsedPolicy {
	v, ok := annotations[AuditAnnotation]
	if !ok {
		return p
	}
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "true":
		p.audit = true
	case "false":
	default:
		err := fmt.Errorf("annotation %s: %q is neither true nor false", AuditAnnotation, v)
		if p.err != nil {
			err = errors.Join(p.err, err)
		} else {
			p.invalidate(p.specs)
		}
		p.err = err
	}
	return p
}

// invalidate drops what an invalid policy no longer contributes, keeping
// its subjects and the fail-closed form of specs (every spec, parsed
// whole or not).
func (p *parsedPolicy) invalidate(specs []tables.PolicySpec) {
	p.failClosed = failClosedSpecs(specs)
	p.specs, p.peers, p.cidrs, p.podNets = nil, nil, nil, nil
}

// failClosedSpecs returns what is left of an invalid policy's specs: each
// spec whose subject parsed puts its subject into default deny in every
// direction it has rules in, and allows nothing. A policy that cannot be
// implemented thus denies more than it meant to, never less: its allows
// are lost, and so are the exceptions enableDefaultDeny: false makes, since
// the denies it meant to add are lost too.
func failClosedSpecs(specs []tables.PolicySpec) []tables.PolicySpec {
	var out []tables.PolicySpec
	for _, s := range specs {
		if s.Subject == "" || !(s.Ingress || s.Egress) {
			continue
		}
		out = append(out, tables.PolicySpec{
			Subject: s.Subject, Ingress: s.Ingress, Egress: s.Egress,
			DefaultDenyIngress: s.Ingress, DefaultDenyEgress: s.Egress,
		})
	}
	return out
}

// parsePolicy parses the rules of a policy. namespace is empty for a
// clusterwide policy; for a namespaced one it restricts the endpoint
// selectors to the policy's namespace. unsupported are the paths of the
// fields inside rules that apiary does not implement (UnsupportedFields),
// each an error.
//
// Errors name the field: "egress[0].toCIDR[1]: …" for a policy with only
// a spec, "spec.…" and "specs[2].…" for one with specs.
func parsePolicy(name, namespace string, spec *Rule, specs []Rule, unsupported []string) *parsedPolicy {
	p := &parsedPolicy{name: name}
	pp := &policyParser{
		namespace: namespace,
		subjects:  map[string]Selector{},
		peers:     map[string]Selector{},
		cidrs:     map[netip.Prefix]struct{}{},
	}
	type specAt struct {
		rule *Rule
		path string
	}
	var all []specAt
	if spec != nil {
		path := "spec."
		if len(specs) == 0 {
			path = "" // as the paths have always been for a single spec
		}
		all = append(all, specAt{spec, path})
	}
	for i := range specs {
		all = append(all, specAt{&specs[i], fmt.Sprintf("specs[%d].", i)})
	}
	if len(all) == 0 {
		p.err = errors.New("the policy has neither spec nor specs")
		return p
	}
	// Every spec, even one with errors: an invalid policy fails closed
	// with the subjects and directions that parsed.
	parsed := make([]tables.PolicySpec, 0, len(all))
	for _, s := range all {
		pp.prefix = s.path
		ps, _ := pp.spec(s.rule)
		parsed = append(parsed, ps)
	}
	for _, f := range unsupported {
		if spec != nil && len(specs) == 0 {
			f = strings.TrimPrefix(f, "spec.")
		}
		pp.errs = append(pp.errs, fmt.Errorf("%s: not supported", f))
	}
	p.subjects = sortedSelectors(pp.subjects)
	if len(pp.errs) > 0 {
		p.err = errors.Join(pp.errs...)
		p.invalidate(parsed)
		return p
	}
	p.specs = parsed
	p.peers = sortedSelectors(pp.peers)
	// Sorted as text, each prefix formatted once.
	type named struct {
		text string
		pfx  netip.Prefix
	}
	byText := make([]named, 0, len(pp.cidrs))
	for pfx := range pp.cidrs {
		byText = append(byText, named{pfx.String(), pfx})
	}
	slices.SortFunc(byText, func(a, b named) int { return strings.Compare(a.text, b.text) })
	for _, n := range byText {
		p.cidrs = append(p.cidrs, n.pfx)
	}
	return p
}

// policyParser collects what the specs of one policy contribute, and the
// errors, each with the path of its field.
type policyParser struct {
	namespace string
	prefix    string // of the spec being parsed: "", "spec." or "specs[i]."
	subjects  map[string]Selector
	peers     map[string]Selector
	cidrs     map[netip.Prefix]struct{}
	podNets   map[netip.Prefix]struct{}
	errs      []error
}

func (pp *policyParser) errorf(path string, format string, args ...any) {
	pp.errs = append(pp.errs, fmt.Errorf("%s%s: %s", pp.prefix, path, fmt.Sprintf(format, args...)))
}

func (pp *policyParser) fail(path string, err error) {
	pp.errs = append(pp.errs, fmt.Errorf("%s%s: %w", pp.prefix, path, err))
}

// ruleParts are the fields of an ingress or egress rule, of either list.
type ruleParts struct {
	endpoints   []EndpointSelector
	cidrs       []string
	cidrSets    []CIDRRule
	fqdns       []FQDNSelector
	entities    []string
	ports       []PortRule
	fieldPrefix string // "from" or "to"
}

// emptyList reports whether one of the rule's peer lists is present but
// empty, which makes the rule select no peer at all (the reference's
// rule: an empty list selects nothing, where an absent one leaves the
// rule to every peer).
func (r ruleParts) emptyList() bool {
	empty := func(n int, isNil bool) bool { return n == 0 && !isNil }
	return empty(len(r.endpoints), r.endpoints == nil) || empty(len(r.cidrs), r.cidrs == nil) ||
		empty(len(r.cidrSets), r.cidrSets == nil) || empty(len(r.entities), r.entities == nil)
}

// spec parses one spec; ok is false if it had errors (the spec then has
// its subject, if that parsed, and its directions, but not all its rules).
func (pp *policyParser) spec(r *Rule) (tables.PolicySpec, bool) {
	errs := len(pp.errs)
	var ps tables.PolicySpec
	if r.EndpointSelector == nil {
		pp.errorf("endpointSelector", "missing")
	} else if sel, err := ParseSubjectSelector(*r.EndpointSelector, pp.namespace); err != nil {
		pp.fail("endpointSelector", err)
	} else {
		pp.subjects[sel.String()] = sel
		ps.Subject = sel.String()
	}
	// Even an empty rule ({}) counts: it selects no peer but puts the
	// subject into default deny, as in the reference.
	ps.Ingress = len(r.Ingress)+len(r.IngressDeny) > 0
	ps.Egress = len(r.Egress)+len(r.EgressDeny) > 0
	ps.DefaultDenyIngress, ps.DefaultDenyEgress = ps.Ingress, ps.Egress
	if d := r.EnableDefaultDeny; d != nil {
		if d.Ingress != nil && !*d.Ingress {
			ps.DefaultDenyIngress = false
		}
		if d.Egress != nil && !*d.Egress {
			ps.DefaultDenyEgress = false
		}
	}
	ingress := func(list []IngressRule, field string, deny bool) {
		for i, in := range list {
			ps.Rules = append(ps.Rules, pp.rule(fmt.Sprintf("%s[%d]", field, i), tables.DirIngress, deny, ruleParts{
				endpoints: in.FromEndpoints, cidrs: in.FromCIDR, cidrSets: in.FromCIDRSet,
				entities: in.FromEntities, ports: in.ToPorts, fieldPrefix: "from",
			}))
		}
	}
	egress := func(list []EgressRule, field string, deny bool) {
		for i, out := range list {
			path := fmt.Sprintf("%s[%d]", field, i)
			if deny && len(out.ToFQDNs) > 0 {
				// The reference has no toFQDNs in deny rules; ignoring it
				// would deny less than the rule says.
				pp.errorf(path+".toFQDNs", "not allowed in a deny rule")
				continue
			}
			ps.Rules = append(ps.Rules, pp.rule(path, tables.DirEgress, deny, ruleParts{
				endpoints: out.ToEndpoints, cidrs: out.ToCIDR, cidrSets: out.ToCIDRSet, fqdns: out.ToFQDNs,
				entities: out.ToEntities, ports: out.ToPorts, fieldPrefix: "to",
			}))
		}
	}
	ingress(r.Ingress, "ingress", false)
	ingress(r.IngressDeny, "ingressDeny", true)
	egress(r.Egress, "egress", false)
	egress(r.EgressDeny, "egressDeny", true)
	return ps, len(pp.errs) == errs
}

// rule parses one element of a rule list.
func (pp *policyParser) rule(path, dir string, deny bool, r ruleParts) tables.PolicyRule {
	out := tables.PolicyRule{Direction: dir, Deny: deny, Peers: []string{}}
	peers := map[string]struct{}{}
	// A rule with an empty peer list selects no peer: its other peers
	// are checked, not used.
	none := r.emptyList()
	addPeer := func(s Selector) {
		if none {
			return
		}
		pp.peers[s.String()] = s
		peers[s.String()] = struct{}{}
	}
	field := func(name string) string { return path + "." + r.fieldPrefix + name }
	for i, es := range r.endpoints {
		sel, err := ParseEndpointSelector(es, pp.namespace)
		if err != nil {
			pp.fail(fmt.Sprintf("%s[%d]", field("Endpoints"), i), err)
			continue
		}
		addPeer(sel)
	}
	addCIDR := func(where string, cidr string, except []string) {
		sel, err := ParseCIDR(cidr, except)
		if err != nil {
			pp.fail(where, err)
			return
		}
		addPeer(sel)
		if none {
			return
		}
		for _, pfx := range sel.Prefixes() {
			pp.cidrs[pfx] = struct{}{}
		}
	}
	for i, c := range r.cidrs {
		addCIDR(fmt.Sprintf("%s[%d]", field("CIDR"), i), c, nil)
	}
	for i, c := range r.cidrSets {
		addCIDR(fmt.Sprintf("%s[%d]", field("CIDRSet"), i), c.CIDR, c.Except)
	}
	for i, f := range r.fqdns {
		sel, err := ParseFQDN(f)
		if err != nil {
			pp.fail(fmt.Sprintf("%s.toFQDNs[%d]", path, i), err)
			continue
		}
		addPeer(sel)
	}
	for i, name := range r.entities {
		sel, peer, err := ParseEntity(name)
		if err != nil {
			pp.fail(fmt.Sprintf("%s[%d]", field("Entities"), i), err)
			continue
		}
		if sel != nil {
			addPeer(sel)
		} else if !none {
			peers[peer] = struct{}{} // AnyPeer: identity 0, not a selector
		}
	}
	hasPorts := false
	for i, pr := range r.ports {
		where := fmt.Sprintf("%s.toPorts[%d]", path, i)
		if len(pr.Ports) == 0 {
			// Such an entry names no port: rather than guess whether
			// it means every port or none, say so.
			pp.errorf(where+".ports", "missing: list at least one port (port 0 for every port)")
			continue
		}
		hasPorts = true
		if pr.Rules != nil && pr.Rules.DNS != nil && r.fieldPrefix == "to" && !deny {
			out.DNS = pp.dnsRules(where+".rules.dns", pr.Rules.DNS, out.DNS)
		}
		for j, entry := range pr.Ports {
			port, err := parsePort(entry)
			if err != nil {
				pp.errs = append(pp.errs, fmt.Errorf("%s%s.ports[%d].%w", pp.prefix, where, j, err))
				continue
			}
			if !slices.Contains(out.Ports, port) {
				out.Ports = append(out.Ports, port)
			}
		}
	}
	switch {
	case none:
	case len(peers) == 0 && hasPorts:
		// A rule with ports but no peer applies to every peer on those
		// ports.
		peers[tables.AnyPeer] = struct{}{}
	}
	out.Peers = append(out.Peers, slices.Sorted(maps.Keys(peers))...)
	return out
}

// dnsRules adds the names of a toPorts entry's DNS rules to names, each
// once, in order: an empty list allows every name ("*").
func (pp *policyParser) dnsRules(path string, raw []json.RawMessage, names []string) []string {
	add := func(n string) {
		if !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	if len(raw) == 0 {
		add("*")
		return names
	}
	for i, r := range raw {
		var sel FQDNSelector
		if err := json.Unmarshal(r, &sel); err != nil {
			pp.fail(fmt.Sprintf("%s[%d]", path, i), err)
			continue
		}
		peer, err := ParseFQDN(sel)
		if err != nil {
			pp.fail(fmt.Sprintf("%s[%d]", path, i), err)
			continue
		}
		add(strings.TrimPrefix(peer.Label, tables.SourceFQDN+":"))
	}
	return names
}

// portFieldError is an error about one field of a port entry; wrapped
// after "ports[j]." it reads "ports[0].endPort: …".
type portFieldError struct {
	field string
	msg   string
}

func (e *portFieldError) Error() string { return e.field + ": " + e.msg }

// parsePort returns the canonical form of a port entry: the protocol (ANY
// when unset), a numeric port or a port name, EndPort only for a range of
// more than one port. The protocol is one of the CRD's enum, in its case:
// the API server refuses "tcp", and so does a policy from --config-dir.
func parsePort(p PortProtocol) (tables.PortRule, error) {
	var out tables.PortRule
	switch proto := p.Protocol; proto {
	case "":
		out.Protocol = tables.ProtoAny
	case tables.ProtoTCP, tables.ProtoUDP, tables.ProtoSCTP, tables.ProtoAny:
		out.Protocol = proto
	default:
		msg := fmt.Sprintf("%q is not TCP, UDP, SCTP or ANY", p.Protocol)
		if up := strings.ToUpper(proto); up == tables.ProtoTCP || up == tables.ProtoUDP || up == tables.ProtoSCTP || up == tables.ProtoAny {
			msg += " (the names are upper case)"
		}
		return out, &portFieldError{"protocol", msg}
	}
	port := string(p.Port)
	switch {
	case port == "":
	case isDigits(port):
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil {
			return out, &portFieldError{"port", fmt.Sprintf("%s is not a port number (0-65535)", port)}
		}
		out.Port = uint16(n)
	case isPortName(port):
		out.Name = port
	default:
		return out, &portFieldError{"port", fmt.Sprintf("%q is neither a port number (0-65535) nor a port name "+
			"(1-15 lowercase letters, digits and '-', with a letter, without '-' at either end or twice in a row)", port)}
	}
	if end := string(p.EndPort); end != "" {
		n, err := strconv.ParseUint(end, 10, 16)
		if !isDigits(end) || err != nil {
			return out, &portFieldError{"endPort", fmt.Sprintf("%s is not a port number (0-65535)", end)}
		}
		switch {
		case n == 0: // unset, as the CRD's integer default
		case out.Name != "":
			return out, &portFieldError{"endPort", fmt.Sprintf("%d needs a numeric port, not the port name %q", n, out.Name)}
		case out.Port == 0:
			return out, &portFieldError{"endPort", fmt.Sprintf("%d needs a port to start the range at (port 0 is every port)", n)}
		case uint16(n) < out.Port:
			return out, &portFieldError{"endPort", fmt.Sprintf("%d is below port %d", n, out.Port)}
		case uint16(n) > out.Port:
			out.EndPort = uint16(n)
		}
	}
	return out, nil
}

func isDigits(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}

// isPortName reports whether s is a valid IANA service name, as the names
// of container ports are: 1–15 lowercase letters, digits and '-', with at
// least one letter, no '-' at either end and no "--".
func isPortName(s string) bool {
	if len(s) == 0 || len(s) > 15 || s[0] == '-' || s[len(s)-1] == '-' || strings.Contains(s, "--") {
		return false
	}
	letter := false
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z':
			letter = true
		case r >= '0' && r <= '9', r == '-':
		default:
			return false
		}
	}
	return letter
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
