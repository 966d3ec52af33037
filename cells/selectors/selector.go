package selectors

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/apiary-net/apiary/cells/fqdn/pattern"
	"github.com/apiary-net/apiary/tables"
)

// Selector selects identities by their labels. Four kinds exist: label
// selectors (Kubernetes semantics over security labels), CIDR selectors
// (prefix-aware over cidr: labels), FQDN selectors (identities carrying
// the selector's fqdn: label, which the DNS proxy gives the IPs of names it
// matches) and entity selectors (world, host, remote-node, cluster).
type Selector interface {
	// String is the canonical form: two selectors with the same string
	// select the same identities, and share a row of the selectors table.
	String() string
	// Matches reports whether the selector selects an identity with the
	// labels l.
	Matches(l tables.Labels) bool
}

// Label selector operators.
const (
	opIn           = "In"
	opNotIn        = "NotIn"
	opExists       = "Exists"
	opDoesNotExist = "DoesNotExist"
)

// requirement is one condition of a label selector. An empty source (from
// a key without one) matches any source.
type requirement struct {
	source, key string
	op          string
	values      []string // sorted
}

func (r requirement) label() string {
	src := r.source
	if src == "" {
		src = "any"
	}
	return src + ":" + r.key
}

func (r requirement) String() string {
	switch r.op {
	case opIn:
		if len(r.values) == 1 {
			return r.label() + "=" + r.values[0]
		}
		return r.label() + " in (" + strings.Join(r.values, ",") + ")"
	case opNotIn:
		return r.label() + " notin (" + strings.Join(r.values, ",") + ")"
	case opExists:
		return r.label()
	default:
		return "!" + r.label()
	}
}

// value returns the value of the label the requirement is about.
func (r requirement) value(l tables.Labels) (string, bool) {
	for _, s := range l {
		src, key, value, _ := tables.SplitLabel(s)
		if key == r.key && (r.source == "" || r.source == src) {
			return value, true
		}
	}
	return "", false
}

func (r requirement) matches(l tables.Labels) bool {
	v, ok := r.value(l)
	switch r.op {
	case opIn:
		return ok && slices.Contains(r.values, v)
	case opNotIn:
		return !ok || !slices.Contains(r.values, v)
	case opExists:
		return ok
	default:
		return !ok
	}
}

// LabelSelector is a conjunction of requirements. It never selects
// identities without workload or reserved labels of the cluster: CIDR and
// FQDN identities are selected by CIDR and FQDN selectors only.
type LabelSelector struct {
	reqs []requirement
	text string
}

// String implements Selector.
func (s *LabelSelector) String() string { return s.text }

// Matches implements Selector.
func (s *LabelSelector) Matches(l tables.Labels) bool {
	if outsideCluster(l) {
		return false
	}
	for _, r := range s.reqs {
		if !r.matches(l) {
			return false
		}
	}
	return true
}

// outsideCluster reports whether l is the label set of addresses outside
// the cluster: only cidr:, fqdn: and world labels.
func outsideCluster(l tables.Labels) bool {
	for _, s := range l {
		switch s {
		case tables.LabelWorld, tables.LabelWorldIPv4, tables.LabelWorldIPv6:
			continue
		}
		if src, _, _, _ := tables.SplitLabel(s); src != tables.SourceCIDR && src != tables.SourceFQDN {
			return false
		}
	}
	return true
}

// NamespaceLabel is the label of a pod's namespace.
const NamespaceLabel = "io.kubernetes.pod.namespace"

// NamespaceLabelsPrefix starts the keys of the labels a pod gets from its
// namespace's labels.
const NamespaceLabelsPrefix = "io.cilium.k8s.namespace.labels."

// parsedSelector is a label selector's requirements as written, and what
// decides the namespace requirement a policy adds to it.
type parsedSelector struct {
	reqs []requirement
	// namespaceKey: a requirement on the namespace label (k8s: or any
	// source); nsLabels: on a namespace's label; reserved: on a reserved:
	// label.
	namespaceKey, nsLabels, reserved bool
}

// ParseLabelSelector returns the label selector of es as written, without
// any namespace requirement.
func ParseLabelSelector(es EndpointSelector) (*LabelSelector, error) {
	p, err := parseRequirements(es, false)
	if err != nil {
		return nil, err
	}
	return newLabelSelector(p.reqs), nil
}

// ParseSubjectSelector returns the selector of a policy's endpointSelector.
// namespace is the policy's, empty for a clusterwide policy. As in the
// reference, a namespaced policy selects only pods of its namespace,
// whatever the selector says: a matchLabels entry
// k8s:io.kubernetes.pod.namespace is replaced by the policy's namespace,
// and any other requirement on the namespace must hold as well (so one
// naming another namespace selects nothing).
func ParseSubjectSelector(es EndpointSelector, namespace string) (*LabelSelector, error) {
	p, err := parseRequirements(es, namespace != "")
	if err != nil {
		return nil, err
	}
	if namespace != "" {
		p.reqs = append(p.reqs, requirement{source: tables.SourceK8s, key: NamespaceLabel, op: opIn, values: []string{namespace}})
	}
	return newLabelSelector(p.reqs), nil
}

// ParseEndpointSelector returns the selector of a peer (a fromEndpoints or
// toEndpoints entry) of a policy in namespace, empty for a clusterwide
// policy. The reference's rules, which it adds to the selector as written:
//
//   - a selector with a reserved: key (reserved:host, …) gets nothing: it
//     selects reserved identities, which have no namespace;
//   - a selector naming the namespace label (k8s: or any source, in
//     matchLabels or matchExpressions) gets nothing;
//   - in a namespaced policy, a selector on namespace labels
//     (io.cilium.k8s.namespace.labels.*) gets nothing: it selects pods of
//     every namespace with those labels; any other is restricted to the
//     policy's namespace;
//   - in a clusterwide policy, any other gets "has a namespace": it selects
//     pods (of every namespace), never the host or other reserved
//     identities, even when empty.
func ParseEndpointSelector(es EndpointSelector, namespace string) (*LabelSelector, error) {
	p, err := parseRequirements(es, false)
	if err != nil {
		return nil, err
	}
	switch {
	case p.reserved, p.namespaceKey:
	case namespace == "":
		p.reqs = append(p.reqs, requirement{source: tables.SourceK8s, key: NamespaceLabel, op: opExists})
	case !p.nsLabels:
		p.reqs = append(p.reqs, requirement{source: tables.SourceK8s, key: NamespaceLabel, op: opIn, values: []string{namespace}})
	}
	return newLabelSelector(p.reqs), nil
}

// parseRequirements checks and parses the requirements of es. dropK8sNamespace
// leaves out a matchLabels entry k8s:io.kubernetes.pod.namespace, which a
// namespaced policy's endpointSelector replaces.
func parseRequirements(es EndpointSelector, dropK8sNamespace bool) (parsedSelector, error) {
	var p parsedSelector
	add := func(key, op string, values []string, matchLabel bool) error {
		source, k := "", key
		if src, rest, ok := strings.Cut(key, ":"); ok {
			source, k = src, rest
		}
		if source == "any" {
			source = ""
		}
		if source == sourceEntity {
			// No identity has entity: labels; and the selector's text
			// could be that of an entity selector, whose row it would share.
			return fmt.Errorf("selector key %q: %s: is not a label source (use fromEntities or toEntities)", key, sourceEntity)
		}
		if k == "" {
			return fmt.Errorf("selector key %q is empty", key)
		}
		if strings.ContainsAny(k, " ,=()!") {
			return fmt.Errorf("selector key %q holds a character that is not allowed", key)
		}
		switch op {
		case opIn, opNotIn:
			if len(values) == 0 {
				return fmt.Errorf("selector %q: operator %s needs values", key, op)
			}
		case opExists, opDoesNotExist:
			if len(values) != 0 {
				return fmt.Errorf("selector %q: operator %s takes no values", key, op)
			}
		default:
			return fmt.Errorf("selector %q: unknown operator %q (want In, NotIn, Exists or DoesNotExist)", key, op)
		}
		k8sOrAny := source == "" || source == tables.SourceK8s
		switch {
		case source == tables.SourceReserved:
			p.reserved = true
		case k8sOrAny && k == NamespaceLabel:
			p.namespaceKey = true
			if matchLabel && dropK8sNamespace && source == tables.SourceK8s {
				return nil
			}
		case k8sOrAny && strings.HasPrefix(k, NamespaceLabelsPrefix):
			p.nsLabels = true
		}
		vs := slices.Clone(values)
		slices.Sort(vs)
		p.reqs = append(p.reqs, requirement{source: source, key: k, op: op, values: slices.Compact(vs)})
		return nil
	}
	for key, value := range es.MatchLabels {
		if err := add(key, opIn, []string{value}, true); err != nil {
			return p, err
		}
	}
	for _, e := range es.MatchExpressions {
		if err := add(e.Key, e.Operator, e.Values, false); err != nil {
			return p, err
		}
	}
	return p, nil
}

// newLabelSelector returns the selector of reqs, with its canonical text.
func newLabelSelector(reqs []requirement) *LabelSelector {
	parts := make([]string, len(reqs))
	for i, r := range reqs {
		parts[i] = r.String()
	}
	slices.Sort(parts)
	parts = slices.Compact(parts)
	text := strings.Join(parts, ", ")
	if text == "" {
		text = "all"
	}
	return &LabelSelector{reqs: reqs, text: text}
}

// CIDRSelector selects the identities labelled with a cidr: label of a
// prefix inside Prefix but not inside any of Except. Selection is
// prefix-aware: cidr:192.0.2.0/24 selects an identity labelled only
// cidr:192.0.2.128/25, since the ipcache keeps only the longest cidr:
// label of each prefix.
type CIDRSelector struct {
	Prefix netip.Prefix
	Except []netip.Prefix
	// Pods: it selects the pods whose addresses are inside Prefix too
	// (their podnet: labels), as a ClusterNetworkPolicy networks peer
	// does (see networks).
	Pods bool
	text string
}

// ParseCIDR returns the selector of cidr minus except. Every prefix of
// except must lie inside cidr.
func ParseCIDR(cidr string, except []string) (*CIDRSelector, error) {
	p, err := parsePrefix(cidr)
	if err != nil {
		return nil, err
	}
	s := &CIDRSelector{Prefix: p}
	for _, e := range except {
		ep, err := parsePrefix(e)
		if err != nil {
			return nil, fmt.Errorf("except of %s: %w", p, err)
		}
		if ep.Addr().Is4() != p.Addr().Is4() || ep.Bits() < p.Bits() || !p.Contains(ep.Addr()) {
			return nil, fmt.Errorf("except %s is not inside %s", ep, p)
		}
		s.Except = append(s.Except, ep)
	}
	slices.SortFunc(s.Except, func(a, b netip.Prefix) int { return strings.Compare(a.String(), b.String()) })
	s.Except = slices.Compact(s.Except)
	s.text = tables.CIDRLabel(p)
	for _, e := range s.Except {
		s.text += " except " + tables.CIDRLabel(e)
	}
	return s, nil
}

// ipBlock makes s a NetworkPolicy ipBlock's selector: the same
// identities, under its own text (tables.IPBlockPeerPrefix), so that the
// entries of its rules match pods' addresses inside it and those of a CNP
// CIDR rule of the same prefixes do not.
func (s *CIDRSelector) ipBlock() {
	s.text = tables.IPBlockPeerPrefix + s.Prefix.String()
	for _, e := range s.Except {
		s.text += " except " + e.String()
	}
}

// networks makes s a ClusterNetworkPolicy networks peer's selector: the
// addresses outside the cluster inside its prefix (their cidr: labels, as
// a CIDR rule's) and the pods whose addresses are inside it (the podnet:
// label the ipcache gives a pod's address inside a prefix that PodNets
// lists, tables.SourcePodNet), under its own text, so that a CNP CIDR
// rule of the same prefix still never selects a pod.
func (s *CIDRSelector) networks() {
	s.Pods = true
	s.text = "networks:" + s.Prefix.String()
}

// PodNets returns the prefixes whose pods the selector selects by
// address: each needs its podnet: label in the ipcache.
func (s *CIDRSelector) PodNets() []netip.Prefix {
	if !s.Pods {
		return nil
	}
	return []netip.Prefix{s.Prefix}
}

// parsePrefix parses a CIDR or a bare address (a host prefix).
func parsePrefix(s string) (netip.Prefix, error) {
	if p, err := netip.ParsePrefix(s); err == nil {
		return tables.CanonicalPrefix(p), nil
	}
	if a, err := netip.ParseAddr(s); err == nil {
		return tables.HostPrefix(a), nil
	}
	return netip.Prefix{}, fmt.Errorf("invalid CIDR %q", s)
}

// String implements Selector.
func (s *CIDRSelector) String() string { return s.text }

// Prefixes returns the prefixes the selector names; each needs its own
// cidr: label in the ipcache so that Except can tell them apart.
func (s *CIDRSelector) Prefixes() []netip.Prefix {
	return append([]netip.Prefix{s.Prefix}, s.Except...)
}

// Matches implements Selector.
func (s *CIDRSelector) Matches(l tables.Labels) bool {
	inside := func(outer, inner netip.Prefix) bool {
		return outer.Addr().Is4() == inner.Addr().Is4() && outer.Bits() <= inner.Bits() && outer.Contains(inner.Addr())
	}
	for _, label := range l {
		q, ok := tables.ParseCIDRLabel(label)
		if !ok && s.Pods {
			// A pod inside the prefix (networks has no except).
			if q, ok := tables.ParsePodNetLabel(label); ok && inside(s.Prefix, q) {
				return true
			}
			continue
		}
		if !ok || !inside(s.Prefix, q) {
			continue
		}
		excluded := false
		for _, e := range s.Except {
			if inside(e, q) {
				excluded = true
				break
			}
		}
		if !excluded {
			return true
		}
	}
	if s.Prefix.Bits() == 0 && len(s.Except) == 0 {
		// The whole address family: the world as well.
		world := tables.LabelWorldIPv6
		if s.Prefix.Addr().Is4() {
			world = tables.LabelWorldIPv4
		}
		return l.Has(world) || l.Has(tables.LabelWorld)
	}
	return false
}

// ParseFQDN returns the selector of a toFQDNs entry.
func ParseFQDN(f FQDNSelector) (*FQDNPeer, error) {
	switch {
	case f.MatchPattern != "" && f.MatchName != "":
		return nil, fmt.Errorf("toFQDNs entry has both matchName %q and matchPattern %q", f.MatchName, f.MatchPattern)
	case f.MatchPattern == "" && f.MatchName == "":
		return nil, fmt.Errorf("toFQDNs entry has neither matchName nor matchPattern")
	}
	// The rules of names and patterns live in one place, shared with the
	// DNS proxy that matches names against them.
	var (
		p   *pattern.Pattern
		err error
	)
	if f.MatchPattern != "" {
		p, err = pattern.ParsePattern(f.MatchPattern)
	} else {
		p, err = pattern.ParseName(f.MatchName)
	}
	if err != nil {
		return nil, fmt.Errorf("toFQDNs: %w", err)
	}
	return &FQDNPeer{Label: tables.SourceFQDN + ":" + p.String()}, nil
}

// FQDNPeer is the selector of a toFQDNs entry: it selects the identities
// carrying its Label, which the DNS proxy gives the IPs of the names the
// pattern matches.
type FQDNPeer struct {
	// Label is "fqdn:<pattern>".
	Label string
}

// String implements Selector.
func (s *FQDNPeer) String() string { return s.Label }

// Matches implements Selector.
func (s *FQDNPeer) Matches(l tables.Labels) bool { return l.Has(s.Label) }

// Entities of fromEntities and toEntities.
const (
	// EntityWorld is every address outside the cluster: the identities
	// with a world label (reserved 2, 9, 10 and every CIDR and FQDN
	// identity).
	EntityWorld = "world"
	// EntityWorldIPv4 and EntityWorldIPv6 are the world of one family:
	// the identities labelled world-ipv4 (world-ipv6), or world where
	// the agent is not dual-stack, less those of a CIDR of the other
	// family.
	EntityWorldIPv4 = "world-ipv4"
	EntityWorldIPv6 = "world-ipv6"
	// EntityHost is the local node: identity 1.
	EntityHost = "host"
	// EntityRemoteNode is every other node of the cluster: identity 6,
	// the addresses of the Node objects (cells/clusternodes).
	EntityRemoteNode = "remote-node"
	// EntityCluster is everything inside the cluster: workloads and the
	// reserved identities that are not world ones.
	EntityCluster = "cluster"
	// EntityAll is every peer; it is tables.AnyPeer (identity 0), not a
	// selector.
	EntityAll = "all"
)

// sourceEntity is the prefix of entity selectors' text.
const sourceEntity = "entity"

// EntitySelector selects the identities of an entity (world, host or
// cluster). Its text is "entity:<name>".
type EntitySelector struct {
	Entity string
}

// ParseEntity returns the peer of a fromEntities or toEntities entry:
// an entity selector, or tables.AnyPeer for "all" (nil selector).
func ParseEntity(name string) (*EntitySelector, string, error) {
	switch name {
	case EntityWorld, EntityWorldIPv4, EntityWorldIPv6, EntityHost, EntityRemoteNode, EntityCluster:
		s := &EntitySelector{Entity: name}
		return s, s.String(), nil
	case EntityAll:
		return nil, tables.AnyPeer, nil
	}
	return nil, "", fmt.Errorf("unknown entity %q (apiary supports %s, %s, %s, %s, %s, %s and %s)",
		name, EntityWorld, EntityWorldIPv4, EntityWorldIPv6, EntityHost, EntityRemoteNode, EntityCluster, EntityAll)
}

// String implements Selector.
func (s *EntitySelector) String() string { return sourceEntity + ":" + s.Entity }

// Matches implements Selector.
func (s *EntitySelector) Matches(l tables.Labels) bool {
	switch s.Entity {
	case EntityWorld:
		return hasWorld(l)
	case EntityWorldIPv4:
		return l.Has(tables.LabelWorldIPv4) || l.Has(tables.LabelWorld) && !hasCIDROf(l, false)
	case EntityWorldIPv6:
		return l.Has(tables.LabelWorldIPv6) || l.Has(tables.LabelWorld) && !hasCIDROf(l, true)
	case EntityHost:
		return l.Has(tables.LabelHost)
	case EntityRemoteNode:
		return l.Has(tables.LabelRemoteNode)
	case EntityCluster:
		return !outsideCluster(l)
	}
	return false
}

// hasCIDROf reports whether l holds a cidr: label of IPv4 (ipv4) or IPv6.
func hasCIDROf(l tables.Labels, ipv4 bool) bool {
	for _, label := range l {
		if p, ok := tables.ParseCIDRLabel(label); ok && p.Addr().Is4() == ipv4 {
			return true
		}
	}
	return false
}

// hasWorld reports whether l holds one of the world labels.
func hasWorld(l tables.Labels) bool {
	return l.Has(tables.LabelWorld) || l.Has(tables.LabelWorldIPv4) || l.Has(tables.LabelWorldIPv6)
}
