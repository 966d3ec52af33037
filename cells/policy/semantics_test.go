package policy

// The policy semantics of the reference (Cilium v1.19), class by class
// (issue 24): each case is a cluster (namespaces, pods, policies as YAML)
// and probes (a pod of this node, a direction, a peer, a port) with the
// verdict the reference gives. The verdicts are computed the way the agent
// computes them: policies parsed as the selectors cell parses them,
// selectors matched against the identities of the pods' filtered labels,
// the engine's entries, looked up as the datapath looks them up.

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/tables"
)

// testPod is a pod of the test cluster.
type testPod struct {
	ns, name string
	labels   map[string]string
	ports    []tables.NamedPort
	remote   bool // on another node: a peer, not an endpoint here
	// addr is the pod's address, if the case needs one: a peer pod
	// without an identity entry allowing it is looked up by address
	// among the policy prefixes (see verdictOf).
	addr string
}

func (p testPod) key() string { return p.ns + "/" + p.name }

// cluster is the input of a verdict computation.
type cluster struct {
	namespaces map[string]map[string]string // name → labels
	pods       []testPod
	policies   []string // YAML, CNP, CCNP or NetworkPolicy
	// cidrs are addresses outside the cluster, each with the identity of
	// the policy prefix it falls in (its cidr: label, and world), as the
	// ipcache gives it; a probe names one as "cidr:<prefix>".
	cidrs []string
	// identityLabels is --identity-labels; policyMode --allow-localhost.
	identityLabels []string
	localhost      string
	// shareMin is --policy-share-min-identities (0: no policy sets).
	shareMin int
}

// Reserved identities of the test cluster.
var reservedIdentities = map[uint32]tables.Labels{
	identity.IDHost:  tables.NewLabels(tables.LabelHost),
	identity.IDWorld: tables.NewLabels(tables.LabelWorld),
	4:                tables.NewLabels(tables.LabelHealth),
}

// decodePolicy decodes a CNP, CCNP or NetworkPolicy written in YAML, as
// the cell gets it; a NetworkPolicy through the input path netpolPath
// (see decodeNetworkPolicy).
func decodePolicy(t testing.TB, doc, netpolPath string) (string, selectors.Parsed, error) {
	t.Helper()
	js, err := yaml.YAMLToJSON([]byte(doc))
	if err != nil {
		t.Fatalf("bad test YAML: %v\n%s", err, doc)
	}
	var kind struct{ Kind string }
	json.Unmarshal(js, &kind)
	if kind.Kind == "NetworkPolicy" {
		np := decodeNetworkPolicy(t, doc, netpolPath)
		parsed, err := selectors.ParseNetworkPolicy(np)
		return selectors.NetpolPrefix + np.Namespace + "/" + np.Name, parsed, err
	}
	if kind.Kind == "ClusterNetworkPolicy" {
		var p selectors.ClusterNetworkPolicy
		if err := json.Unmarshal(js, &p); err != nil {
			t.Fatal(err)
		}
		parsed, err := selectors.ParseClusterNetworkPolicy(&p)
		return selectors.ClusterNetpolPrefix + p.Name, parsed, err
	}
	if kind.Kind == "CiliumClusterwideNetworkPolicy" {
		var p selectors.CiliumClusterwideNetworkPolicy
		if err := json.Unmarshal(js, &p); err != nil {
			t.Fatal(err)
		}
		parsed, err := selectors.ParseCCNP(&p)
		return "ccnp/" + p.Name, parsed, err
	}
	var p selectors.CiliumNetworkPolicy
	if err := json.Unmarshal(js, &p); err != nil {
		t.Fatal(err)
	}
	parsed, err := selectors.ParseCNP(&p)
	return "cnp/" + p.Namespace + "/" + p.Name, parsed, err
}

// agentModel runs the engine on a cluster, change after change, as the
// controller feeds it from the tables.
type agentModel struct {
	t         testing.TB
	eng       *engine
	out       *tableOutput
	ids       map[string]uint32 // label set key → identity
	labels    map[uint32]tables.Labels
	next      uint32
	selectors map[string]selectors.Selector
	policies  map[string]bool
	endpoints map[string]bool
	cgroups   map[string]uint64
	podIDs    map[string]uint32 // pod key → identity
	warnings  map[string][]string
	// byGroup indexes the entries by endpoint, identity and direction.
	byGroup map[string][]*tables.PolicyEntry
	// cidrIDs are the identities of the cluster's cidrs and of the
	// prefixes the policies name: the policy-prefixes table.
	cidrIDs map[string]uint32
	// podAddrs are the pods' addresses, by pod key.
	podAddrs map[string]netip.Addr
	// netpolPath is how NetworkPolicies reach the agent: pathK8s or
	// pathConfigDir (see decodeNetworkPolicy).
	netpolPath string
}

func groupOf(ep string, id uint32, dir string) string { return fmt.Sprintf("%s %d %s", ep, id, dir) }

func newAgentModel(t testing.TB, localhost string) *agentModel {
	m := &agentModel{
		t: t, eng: newEngine(ModeDefault, false, nil), out: newTableOutput(),
		ids: map[string]uint32{}, labels: map[uint32]tables.Labels{}, next: 256,
		selectors: map[string]selectors.Selector{}, policies: map[string]bool{}, endpoints: map[string]bool{},
		cgroups: map[string]uint64{}, podIDs: map[string]uint32{},
	}
	m.eng.allowLocalhost = localhost != LocalhostPolicy
	for id, l := range reservedIdentities {
		m.labels[id] = l
	}
	return m
}

// podObject is the Pod of p.
func podObject(p testPod) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: p.ns, Name: p.name, Labels: p.labels}}
}

// apply brings the engine to cluster c and flushes it.
func (m *agentModel) apply(c cluster) {
	m.t.Helper()
	m.eng.shareMin = c.shareMin
	filter, err := endpoints.NewLabelFilter(c.identityLabels)
	if err != nil {
		m.t.Fatal(err)
	}
	live := map[uint32]bool{1: true, 2: true, 4: true}
	m.cidrIDs = map[string]uint32{}
	addCIDR := func(c string) {
		l := tables.NewLabels(tables.CIDRLabel(netip.MustParsePrefix(c)), tables.LabelWorld)
		m.cidrIDs[c] = m.identity(l)
		live[m.cidrIDs[c]] = true
	}
	for _, c := range c.cidrs {
		addCIDR(c)
	}
	// Policies, then the selectors they name.
	sels := map[string]selectors.Selector{}
	seen := map[string]bool{}
	for _, doc := range c.policies {
		name, parsed, err := decodePolicy(m.t, doc, m.netpolPath)
		seen[name] = true
		if err != nil {
			m.eng.setPolicy(name, nil, false, "")
			continue
		}
		m.eng.setPolicy(name, parsed.Specs, parsed.Audit, "")
		maps.Copy(sels, parsed.Selectors)
		// The prefixes a policy names get CIDR identities, as the
		// selectors cell has the ipcache give them.
		for _, s := range parsed.Selectors {
			if cs, ok := s.(*selectors.CIDRSelector); ok {
				for _, p := range cs.Prefixes() {
					if _, ok := m.cidrIDs[p.String()]; !ok {
						addCIDR(p.String())
					}
				}
			}
		}
	}
	for name := range m.policies {
		if !seen[name] {
			m.eng.setPolicy(name, nil, false, "")
		}
	}
	m.policies = seen
	// Identities of the pods' label sets; unused ones stay (harmless). A
	// pod whose address is inside a prefix a ClusterNetworkPolicy
	// networks peer names gets the longest such prefix's podnet: label,
	// as the ipcache gives it.
	var podNets []netip.Prefix
	for _, s := range sels {
		if cs, ok := s.(*selectors.CIDRSelector); ok {
			podNets = append(podNets, cs.PodNets()...)
		}
	}
	m.podIDs = map[string]uint32{}
	m.podAddrs = map[string]netip.Addr{}
	for _, p := range c.pods {
		var podNet netip.Prefix
		if p.addr != "" {
			addr := netip.MustParseAddr(p.addr)
			m.podAddrs[p.key()] = addr
			for _, n := range podNets {
				if n.Contains(addr) && (!podNet.IsValid() || n.Bits() > podNet.Bits()) {
					podNet = n
				}
			}
		}
		var nsLabels map[string]string
		if labels, ok := c.namespaces[p.ns]; ok {
			nsLabels = endpoints.NamespaceLabels(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: p.ns, Labels: labels}})
		}
		l := endpoints.SecurityLabels(podObject(p), nsLabels, filter)
		if podNet.IsValid() {
			l = tables.NewLabels(append(slices.Clone(l), tables.PodNetLabel(podNet))...)
		}
		live[m.identity(l)] = true
		m.podIDs[p.key()] = m.identity(l)
	}
	for text, s := range sels {
		ids := []uint32{}
		for id, l := range m.labels {
			if live[id] && s.Matches(l) {
				ids = append(ids, id)
			}
		}
		slices.Sort(ids)
		m.eng.setSelector(text, ids)
	}
	for text := range m.selectors {
		if _, ok := sels[text]; !ok {
			m.eng.setSelector(text, nil)
		}
	}
	m.selectors = sels
	// The endpoints of this node.
	eps := map[string]bool{}
	for _, p := range c.pods {
		if p.remote {
			continue
		}
		if m.cgroups[p.key()] == 0 {
			m.cgroups[p.key()] = uint64(1000 + len(m.cgroups))
		}
		eps[p.key()] = true
		m.eng.setEndpoint(p.key(), &tables.Endpoint{
			Name: p.key(), Identity: m.podIDs[p.key()], CgroupID: m.cgroups[p.key()], Cgroup: "pod" + p.key(),
			NamedPorts: slices.Clone(p.ports),
		})
	}
	for name := range m.endpoints {
		if !eps[name] {
			m.eng.setEndpoint(name, nil)
		}
	}
	m.endpoints = eps
	m.eng.flush(m.out)
	m.warnings = m.eng.warnings()
	m.byGroup = map[string][]*tables.PolicyEntry{}
	for _, e := range m.out.entries {
		g := groupOf(e.Endpoint, e.Identity, e.Direction)
		m.byGroup[g] = append(m.byGroup[g], e)
	}
}

// identity returns the identity of the label set l, allocating one for a
// new set; unused ones stay (harmless).
func (m *agentModel) identity(l tables.Labels) uint32 {
	id, ok := m.ids[l.Key()]
	if !ok {
		id = m.next
		m.next++
		m.ids[l.Key()] = id
		m.labels[id] = l
	}
	return id
}

// peerID returns the identity of a probe's peer: "host", "world",
// "health", "cidr:<prefix>" of the cluster's cidrs or a pod's key.
func (m *agentModel) peerID(peer string) uint32 {
	if c, ok := strings.CutPrefix(peer, "cidr:"); ok {
		id, ok := m.cidrIDs[c]
		if !ok {
			m.t.Fatalf("no cidr %s in the cluster", c)
		}
		return id
	}
	switch peer {
	case "host":
		return identity.IDHost
	case "world":
		return identity.IDWorld
	case "health":
		return 4
	}
	id, ok := m.podIDs[peer]
	if !ok {
		m.t.Fatalf("no pod %s", peer)
	}
	return id
}

// verdictOf is the verdict of a probe as the datapath gives it: by the
// peer's identity (verdict), and for a pod peer with an address that no
// entry decides for (default deny), by its address: the entry of the
// longest policy prefix holding it, if an allow that matches pods'
// addresses (tables.PolicyEntry.PodAddrs).
func (m *agentModel) verdictOf(p probe) string {
	id := m.peerID(p.peer)
	v, byEntry := m.judge(p.ep, p.dir, id, p.proto, p.port)
	addr, ok := m.podAddrs[p.peer]
	if v == "allow" || byEntry || !ok {
		return v
	}
	var longest netip.Prefix
	for c := range m.cidrIDs {
		if pfx := netip.MustParsePrefix(c); pfx.Contains(addr) && (!longest.IsValid() || pfx.Bits() > longest.Bits()) {
			longest = pfx
		}
	}
	if !longest.IsValid() {
		return v
	}
	if e := m.lookup(p.ep, p.dir, m.cidrIDs[longest.String()], p.proto, p.port); e != nil && !e.Deny && e.PodAddrs {
		return "allow"
	}
	return v
}

// verdict looks up a connection as the datapath does: an endpoint not
// enforced in the direction allows; otherwise the longest entry of the
// peer's identity and the longest of identity 0, a deny in either wins,
// else an entry in either allows, else default deny. A final entry of the
// peer's identity decides alone; a pass one counts as none.
func (m *agentModel) verdict(ep, dir string, peer uint32, proto uint8, port uint16) string {
	v, _ := m.judge(ep, dir, peer, proto, port)
	return v
}

// judge is verdict, and whether an entry decided (not the default deny).
func (m *agentModel) judge(ep, dir string, peer uint32, proto uint8, port uint16) (string, bool) {
	row := m.out.endpoints[ep]
	if row == nil {
		m.t.Fatalf("no endpoint-policy row for %s", ep)
	}
	if state := row.Ingress; (dir == tables.DirEgress && row.Egress == tables.EnforceOff) || (dir == tables.DirIngress && state == tables.EnforceOff) {
		return "allow", false
	}
	exact := m.lookup(ep, dir, peer, proto, port)
	switch {
	case exact != nil && exact.Final && exact.Deny && !exact.Audit && exact.Drop:
		// A ClusterNetworkPolicy Deny: dropped (at the interface, where
		// the socket hooks let it through), not refused.
		return "drop", true
	case exact != nil && exact.Final && exact.Deny && !exact.Audit:
		return "deny", true
	case exact != nil && exact.Final:
		return "allow", true
	case exact != nil && exact.Pass:
		exact = nil
	}
	wild := m.lookup(ep, dir, 0, proto, port)
	switch {
	case (exact != nil && exact.Deny) || (wild != nil && wild.Deny):
		return "deny", true
	case exact != nil || wild != nil:
		return "allow", true
	}
	// The endpoint's policy set: its reference entry, then the set's
	// entry of the peer, an allow.
	if ref := m.lookup(ep, dir, tables.PolicySetRef, proto, port); ref != nil && peer != 0 {
		set := m.out.endpoints[ref.Policies[0]]
		if set == nil || !set.Set || set.ID != ref.Cookie {
			m.t.Fatalf("%s: reference entry %+v names no policy set row (%+v)", ep, ref, set)
		}
		if e := m.lookup(set.Name, dir, peer, proto, port); e != nil {
			if e.Deny || e.EndpointID != set.ID {
				m.t.Fatalf("policy set %s: entry %+v", set.Name, e)
			}
			return "allow", true
		}
	}
	return "deny", false
}

// lookup returns the entry of ep for identity id that the datapath's
// longest-prefix match finds, or nil.
func (m *agentModel) lookup(ep, dir string, id uint32, proto uint8, port uint16) *tables.PolicyEntry {
	var best *tables.PolicyEntry
	bestLen := -1
	for _, e := range m.byGroup[groupOf(ep, id, dir)] {
		l := 0
		if e.Protocol != 0 {
			if e.Protocol != proto {
				continue
			}
			mask := ^uint16(0) << (16 - uint(e.PortBits))
			if e.PortBits == 0 {
				mask = 0
			}
			if port&mask != e.Port&mask {
				continue
			}
			l = 8 + int(e.PortBits)
		}
		if l > bestLen {
			best, bestLen = e, l
		}
	}
	return best
}

// probe is a connection whose verdict a case asserts.
type probe struct {
	ep, dir, peer string
	proto         uint8
	port          uint16
	want          string
}

func (p probe) String() string {
	arrow := "←"
	if p.dir == tables.DirEgress {
		arrow = "→"
	}
	return fmt.Sprintf("%s %s %s %s/%d", p.ep, arrow, p.peer, tables.Proto(p.proto), p.port)
}

const protoTCP, protoUDP = unix.IPPROTO_TCP, unix.IPPROTO_UDP

func in(ep, peer string, port uint16, want string) probe {
	return probe{ep, tables.DirIngress, peer, protoTCP, port, want}
}

func out(ep, peer string, port uint16, want string) probe {
	return probe{ep, tables.DirEgress, peer, protoTCP, port, want}
}

// baseCluster: namespaces alpha (env=dev), beta (env=prod), gamma
// (env=dev); pods alpha/web (http 8080), beta/web, beta/client,
// beta/server (http 9090), gamma/server, all on this node.
func baseCluster(policies ...string) cluster {
	return cluster{
		namespaces: map[string]map[string]string{"alpha": {"env": "dev"}, "beta": {"env": "prod"}, "gamma": {"env": "dev"}},
		pods: []testPod{
			{ns: "alpha", name: "web", labels: map[string]string{"app": "web"}, ports: []tables.NamedPort{{Name: "http", Port: 8080, Protocol: "TCP"}}},
			{ns: "beta", name: "web", labels: map[string]string{"app": "web"}},
			{ns: "beta", name: "client", labels: map[string]string{"app": "client", "kubernetes.io/arch": "amd64", "topology.kubernetes.io/zone": "a"}},
			{ns: "beta", name: "server", labels: map[string]string{"app": "server"}, ports: []tables.NamedPort{{Name: "http", Port: 9090, Protocol: "TCP"}}},
			{ns: "gamma", name: "server", labels: map[string]string{"app": "server"}},
		},
		policies: policies,
	}
}

func cnp(ns, name, spec string) string {
	return fmt.Sprintf("apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {name: %s, namespace: %s}\nspec:\n%s", name, ns, indent(spec))
}

func ccnp(name, spec string) string {
	return fmt.Sprintf("apiVersion: cilium.io/v2\nkind: CiliumClusterwideNetworkPolicy\nmetadata: {name: %s}\nspec:\n%s", name, indent(spec))
}

func indent(s string) string {
	lines := strings.Split(strings.Trim(s, "\n"), "\n")
	for i, l := range lines {
		lines[i] = "  " + l
	}
	return strings.Join(lines, "\n") + "\n"
}

// sharedCases returns the cases with --policy-share-min-identities=1.
func sharedCases(cases []struct {
	name    string
	cluster cluster
	probes  []probe
}) []struct {
	name    string
	cluster cluster
	probes  []probe
} {
	out := slices.Clone(cases)
	for i := range out {
		out[i].name += ",shared"
		out[i].cluster.shareMin = 1
	}
	return out
}

// runCases checks each case's probes against the verdicts computed.
func runCases(t *testing.T, cases []struct {
	name    string
	cluster cluster
	probes  []probe
}) {
	t.Helper()
	// Each case without policy sets and with every shareable allow in one:
	// the verdicts are the same.
	for _, tc := range slices.Concat(cases, sharedCases(cases)) {
		t.Run(tc.name, func(t *testing.T) {
			m := newAgentModel(t, tc.cluster.localhost)
			m.apply(tc.cluster)
			for _, p := range tc.probes {
				if got := m.verdictOf(p); got != p.want {
					t.Errorf("%s: %s, want %s (the reference's)\nentries of %s: %v", p, got, p.want, p.ep, m.out.list(p.ep))
				}
			}
		})
	}
}

type semanticsCase = struct {
	name    string
	cluster cluster
	probes  []probe
}

// Class 1: a namespaced policy never selects pods outside its namespace,
// whatever its endpointSelector says about the namespace.
func TestSemanticsSubjectNamespace(t *testing.T) {
	runCases(t, []semanticsCase{
		{"any: namespace key naming another namespace selects nothing", baseCluster(cnp("beta", "deny-alpha", `
endpointSelector: {matchLabels: {app: web, io.kubernetes.pod.namespace: alpha}}
ingress: [{}]`)), []probe{
			in("alpha/web", "beta/client", 80, "allow"),
			in("beta/web", "beta/client", 80, "allow"),
		}},
		{"k8s: namespace key is replaced by the policy's", baseCluster(cnp("beta", "deny-alpha", `
endpointSelector: {matchLabels: {app: web, "k8s:io.kubernetes.pod.namespace": alpha}}
ingress: [{}]`)), []probe{
			in("alpha/web", "beta/client", 80, "allow"),
			in("beta/web", "beta/client", 80, "deny"),
		}},
		{"a namespace expression cannot widen it", baseCluster(cnp("beta", "open", `
endpointSelector: {matchExpressions: [{key: io.kubernetes.pod.namespace, operator: In, values: [alpha, beta]}]}
egress: [{}]`)), []probe{
			out("alpha/web", "beta/client", 80, "allow"),
			out("beta/web", "beta/client", 80, "deny"),
			out("beta/server", "beta/client", 80, "deny"),
		}},
		{"a clusterwide policy selects in every namespace", baseCluster(ccnp("web", `
endpointSelector: {matchLabels: {app: web}}
ingress: [{}]`)), []probe{
			in("alpha/web", "beta/client", 80, "deny"),
			in("beta/web", "beta/client", 80, "deny"),
			in("beta/server", "beta/client", 80, "allow"),
		}},
	})
}

// Class 2: a peer selector on namespace labels gets no namespace
// restriction: it selects pods of every namespace with those labels.
func TestSemanticsNamespaceLabelPeers(t *testing.T) {
	runCases(t, []semanticsCase{
		{"toEndpoints on namespace labels", baseCluster(cnp("beta", "client", `
endpointSelector: {matchLabels: {app: client}}
egress:
- toEndpoints: [{matchLabels: {app: server, io.cilium.k8s.namespace.labels.env: dev}}]`)), []probe{
			out("beta/client", "gamma/server", 443, "allow"), // gamma is env=dev
			out("beta/client", "beta/server", 443, "deny"),   // beta is env=prod
			out("beta/client", "alpha/web", 443, "deny"),
		}},
		{"fromEndpoints on a namespace label expression", baseCluster(cnp("beta", "server", `
endpointSelector: {matchLabels: {app: server}}
ingress:
- fromEndpoints: [{matchExpressions: [{key: "k8s:io.cilium.k8s.namespace.labels.env", operator: In, values: [dev]}]}]`)), []probe{
			in("beta/server", "alpha/web", 80, "allow"),
			in("beta/server", "gamma/server", 80, "allow"),
			in("beta/server", "beta/client", 80, "deny"),
		}},
		{"without namespace labels, the policy's namespace", baseCluster(cnp("beta", "server", `
endpointSelector: {matchLabels: {app: server}}
ingress: [{fromEndpoints: [{matchLabels: {app: web}}]}]`)), []probe{
			in("beta/server", "beta/web", 80, "allow"),
			in("beta/server", "alpha/web", 80, "deny"),
		}},
	})
}

// Class 3: reserved: keys in a namespaced policy's peers get no namespace
// restriction, so they select the reserved identities (and a deny of
// them denies).
func TestSemanticsReservedPeers(t *testing.T) {
	c := baseCluster(cnp("beta", "client", `
endpointSelector: {matchLabels: {app: client}}
egress:
- toEndpoints: [{matchLabels: {"reserved:host": ""}}]
ingressDeny:
- fromEndpoints: [{matchLabels: {"reserved:host": ""}}]
  toPorts: [{ports: [{port: "22", protocol: TCP}]}]`))
	runCases(t, []semanticsCase{
		{"toEndpoints reserved:host reaches the node; a deny of it denies", c, []probe{
			out("beta/client", "host", 10250, "allow"),
			out("beta/client", "world", 443, "deny"),
			out("beta/client", "beta/web", 443, "deny"),
			in("beta/client", "host", 22, "deny"),
			in("beta/client", "host", 80, "allow"), // --allow-localhost=always
		}},
		{"an expression on reserved:health", baseCluster(cnp("beta", "client", `
endpointSelector: {matchLabels: {app: client}}
egress: [{toEndpoints: [{matchExpressions: [{key: "reserved:health", operator: Exists}]}]}]`)), []probe{
			out("beta/client", "health", 4240, "allow"),
			out("beta/client", "host", 4240, "deny"),
		}},
	})
}

// Class 4: a clusterwide policy's empty peer selector means every pod, not
// the host or other reserved identities.
func TestSemanticsClusterwideEmptyPeer(t *testing.T) {
	runCases(t, []semanticsCase{
		{"toEndpoints [{}] in a CCNP", baseCluster(ccnp("pods", `
endpointSelector: {matchLabels: {app: client}}
egress: [{toEndpoints: [{}]}]`)), []probe{
			out("beta/client", "alpha/web", 443, "allow"),
			out("beta/client", "gamma/server", 443, "allow"),
			out("beta/client", "host", 443, "deny"),
			out("beta/client", "health", 443, "deny"),
			out("beta/client", "world", 443, "deny"),
		}},
		{"fromEndpoints [{}] in a CCNP, with allow-localhost=policy", cluster{
			namespaces: baseCluster().namespaces, pods: baseCluster().pods, localhost: LocalhostPolicy,
			policies: []string{ccnp("pods", `
endpointSelector: {matchLabels: {app: server}}
ingress: [{fromEndpoints: [{}]}]`)},
		}, []probe{
			in("gamma/server", "alpha/web", 80, "allow"),
			in("gamma/server", "host", 80, "deny"),
		}},
		{"toEndpoints [{}] in a CNP: its namespace", baseCluster(cnp("beta", "pods", `
endpointSelector: {matchLabels: {app: client}}
egress: [{toEndpoints: [{}]}]`)), []probe{
			out("beta/client", "beta/web", 443, "allow"),
			out("beta/client", "alpha/web", 443, "deny"),
			out("beta/client", "host", 443, "deny"),
		}},
	})
}

// Class 5: an empty, non-nil peer list selects nothing (where an absent
// one leaves a rule with ports to every peer).
func TestSemanticsEmptyPeerList(t *testing.T) {
	runCases(t, []semanticsCase{
		{"toEndpoints: [] with ports allows nothing", baseCluster(cnp("beta", "client", `
endpointSelector: {matchLabels: {app: client}}
egress: [{toEndpoints: [], toPorts: [{ports: [{port: "443", protocol: TCP}]}]}]`)), []probe{
			out("beta/client", "beta/web", 443, "deny"),
			out("beta/client", "world", 443, "deny"),
		}},
		{"no peer list with ports allows every peer", baseCluster(cnp("beta", "client", `
endpointSelector: {matchLabels: {app: client}}
egress: [{toPorts: [{ports: [{port: "443", protocol: TCP}]}]}]`)), []probe{
			out("beta/client", "beta/web", 443, "allow"),
			out("beta/client", "world", 443, "allow"),
			out("beta/client", "world", 80, "deny"),
		}},
		{"an empty list beside a full one: the rule selects nothing", baseCluster(cnp("beta", "client", `
endpointSelector: {matchLabels: {app: client}}
egress: [{toEntities: [], toEndpoints: [{matchLabels: {app: web}}]}]`)), []probe{
			out("beta/client", "beta/web", 443, "deny"),
		}},
		{"an empty deny list denies nothing", baseCluster(cnp("beta", "server", `
endpointSelector: {matchLabels: {app: server}}
ingress: [{fromEndpoints: [{matchLabels: {app: client}}]}]
ingressDeny: [{fromEntities: [], toPorts: [{ports: [{port: "80", protocol: TCP}]}]}]`)), []probe{
			in("beta/server", "beta/client", 80, "allow"),
		}},
	})
}

// Class 6: a port name that stands for two numbers (alpha/web's http is
// 8080, beta/server's 9090) is ambiguous: the rule allows neither, and the
// policy is warned about.
func TestSemanticsAmbiguousPortName(t *testing.T) {
	egress := cnp("beta", "client", `
endpointSelector: {matchLabels: {app: client}}
egress:
- toEndpoints: [{matchLabels: {app: web, io.kubernetes.pod.namespace: alpha}}, {matchLabels: {app: server}}]
  toPorts: [{ports: [{port: http, protocol: TCP}]}]`)
	runCases(t, []semanticsCase{
		{"ambiguous: neither number", baseCluster(egress), []probe{
			out("beta/client", "alpha/web", 8080, "deny"),
			out("beta/client", "beta/server", 9090, "deny"),
			out("beta/client", "beta/server", 8080, "deny"),
		}},
		{"one number once the other pod is gone", cluster{
			namespaces: baseCluster().namespaces, pods: slices.DeleteFunc(baseCluster().pods, func(p testPod) bool { return p.key() == "beta/server" }),
			policies: []string{egress},
		}, []probe{
			out("beta/client", "alpha/web", 8080, "allow"),
			out("beta/client", "alpha/web", 9090, "deny"),
		}},
		{"another protocol is another name", cluster{
			namespaces: baseCluster().namespaces,
			pods: append(baseCluster().pods, testPod{ns: "beta", name: "dns", labels: map[string]string{"app": "dns"},
				ports: []tables.NamedPort{{Name: "http", Port: 53, Protocol: "UDP"}}}),
			policies: []string{cnp("beta", "client", `
endpointSelector: {matchLabels: {app: client}}
egress: [{toEndpoints: [{matchLabels: {app: dns}}], toPorts: [{ports: [{port: http}]}]}]`)},
		}, []probe{
			{"beta/client", tables.DirEgress, "beta/dns", protoUDP, 53, "allow"},
			{"beta/client", tables.DirEgress, "beta/dns", protoTCP, 8080, "deny"},
		}},
	})
	m := newAgentModel(t, "")
	m.apply(baseCluster(egress))
	want := []string{`egress, among the pods of this node: port name "http" is TCP 8080 and 9090: ambiguous, the rule uses none of them`}
	if got := m.warnings["cnp/beta/client"]; !slices.Equal(got, want) {
		t.Errorf("warnings %q, want %q", got, want)
	}
}

// Class 7: the labels that make an identity are the reference's default
// filter's (and --identity-labels'): a label it leaves out cannot be
// selected.
func TestSemanticsIdentityLabels(t *testing.T) {
	byLabel := func(key string) string {
		return cnp("beta", "by-"+strings.ReplaceAll(key, "/", "-"), fmt.Sprintf(`
endpointSelector: {}
ingress: [{fromEndpoints: [{matchLabels: {"%s": "%s"}}]}]`, key, map[string]string{"kubernetes.io/arch": "amd64", "topology.kubernetes.io/zone": "a", "app": "client"}[key]))
	}
	withLabels := func(extra []string, policy string) cluster {
		c := baseCluster(policy)
		c.identityLabels = extra
		return c
	}
	runCases(t, []semanticsCase{
		{"kubernetes.io/arch is left out", baseCluster(byLabel("kubernetes.io/arch")), []probe{
			in("beta/server", "beta/client", 80, "deny"),
		}},
		// The reference's kubernetes.io exclusion is not anchored: a CNP
		// selecting zone=a selects nobody, as in the reference (issue 35
		// item 9).
		{"topology.kubernetes.io/zone is left out (kubernetes.io anywhere in the key)", baseCluster(byLabel("topology.kubernetes.io/zone")), []probe{
			in("beta/server", "beta/client", 80, "deny"),
		}},
		{"--identity-labels=topology.kubernetes.io/zone keeps it", withLabels([]string{`topology\.kubernetes\.io/zone`}, byLabel("topology.kubernetes.io/zone")), []probe{
			in("beta/server", "beta/client", 80, "allow"),
		}},
		{"--identity-labels=!app leaves app out", withLabels([]string{"!app"}, byLabel("app")), []probe{
			in("beta/server", "beta/client", 80, "deny"),
		}},
		{"--identity-labels=kubernetes.io/arch keeps it", withLabels([]string{`kubernetes\.io/arch`}, byLabel("kubernetes.io/arch")), []probe{
			in("beta/server", "beta/client", 80, "allow"),
		}},
	})
}

// Class 8: --allow-localhost. always (the default): the node reaches its
// pods whatever their ingress policy, but an explicit deny of the host
// wins; policy: the node is a peer like any other.
func TestSemanticsAllowLocalhost(t *testing.T) {
	deny := cnp("beta", "server", `
endpointSelector: {matchLabels: {app: server}}
ingress: [{fromEndpoints: [{matchLabels: {app: client}}]}]
ingressDeny: [{fromEntities: [host], toPorts: [{ports: [{port: "22", protocol: TCP}]}]}]`)
	allowHost := cnp("beta", "web", `
endpointSelector: {matchLabels: {app: web}}
ingress: [{fromEntities: [host], toPorts: [{ports: [{port: "8080", protocol: TCP}]}]}]`)
	with := func(mode string, policies ...string) cluster {
		c := baseCluster(policies...)
		c.localhost = mode
		return c
	}
	runCases(t, []semanticsCase{
		{"always", with(LocalhostAlways, deny, allowHost), []probe{
			in("beta/server", "host", 10250, "allow"),
			in("beta/server", "host", 22, "deny"),
			in("beta/server", "world", 10250, "deny"),
			in("beta/web", "host", 8080, "allow"),
			in("beta/web", "host", 80, "allow"),
			out("beta/server", "host", 80, "allow"), // egress is not enforced
		}},
		{"policy", with(LocalhostPolicy, deny, allowHost), []probe{
			in("beta/server", "host", 10250, "deny"),
			in("beta/server", "host", 22, "deny"),
			in("beta/web", "host", 8080, "allow"),
			in("beta/web", "host", 80, "deny"),
		}},
		{"always: an unenforced ingress stays open", with(LocalhostAlways, cnp("beta", "egress-only", `
endpointSelector: {matchLabels: {app: server}}
egress: [{}]`)), []probe{
			in("beta/server", "host", 80, "allow"),
			in("beta/server", "beta/client", 80, "allow"),
		}},
	})
}
