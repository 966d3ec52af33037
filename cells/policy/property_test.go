package policy

// A property test of policy enforcement against a from-scratch
// computation: random namespaces, pods, policies and changes to them; the
// agent's verdicts (parser, selectors, the engine updated incrementally,
// the datapath's lookup) must equal those an oracle computes from the
// policy objects alone, written here again from the reference's rules
// without the agent's code.

import (
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/tables"
)

// oracle computes verdicts from the cluster itself.
type oracle struct {
	c        cluster
	filter   *endpoints.LabelFilter
	policies []oraclePolicy
	// admin are the ClusterNetworkPolicies (see clusterNetpolVerdict).
	admin []*selectors.ClusterNetworkPolicy
	cache map[peerRef]map[string]map[string]string
	// path says which layer made the last verdict, for the tests to
	// count how often each path was taken.
	path string
	// byNetworks: the tier rule of the last verdict matched the peer by
	// a networks peer (its address), which path then says.
	byNetworks map[string]bool
}

type oraclePolicy struct {
	ns    string // "" for clusterwide
	rules []selectors.Rule
}

// peerRef is a probe's peer: a pod, or a reserved identity.
type peerRef struct {
	pod      *testPod
	reserved uint32
}

func newOracle(t testing.TB, c cluster) *oracle {
	f, err := endpoints.NewLabelFilter(c.identityLabels)
	if err != nil {
		t.Fatal(err)
	}
	o := &oracle{c: c, filter: f, cache: map[peerRef]map[string]map[string]string{}}
	for _, doc := range c.policies {
		js, err := yaml.YAMLToJSON([]byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		var p struct {
			Kind     string
			Metadata struct{ Namespace string }
			Spec     *selectors.Rule
			Specs    []selectors.Rule
		}
		if err := json.Unmarshal(js, &p); err != nil {
			t.Fatal(err)
		}
		if p.Kind == "ClusterNetworkPolicy" {
			var cn selectors.ClusterNetworkPolicy
			if err := json.Unmarshal(js, &cn); err != nil {
				t.Fatal(err)
			}
			o.admin = append(o.admin, &cn)
			continue
		}
		op := oraclePolicy{ns: p.Metadata.Namespace}
		if p.Kind == "CiliumClusterwideNetworkPolicy" {
			op.ns = ""
		}
		if p.Spec != nil {
			op.rules = append(op.rules, *p.Spec)
		}
		op.rules = append(op.rules, p.Specs...)
		o.policies = append(o.policies, op)
	}
	return o
}

// labels returns the labels of a peer as key → value per source.
func (o *oracle) labels(p peerRef) map[string]map[string]string {
	if l, ok := o.cache[p]; ok {
		return l
	}
	l := o.computeLabels(p)
	o.cache[p] = l
	return l
}

func (o *oracle) computeLabels(p peerRef) map[string]map[string]string {
	if p.pod == nil {
		name := map[uint32]string{identity.IDHost: "host", identity.IDWorld: "world", 4: "health"}[p.reserved]
		return map[string]map[string]string{"reserved": {name: ""}}
	}
	k8s := map[string]string{}
	add := func(k, v string) {
		if o.filter.Keep("k8s", k) {
			k8s[k] = v
		}
	}
	for k, v := range p.pod.labels {
		add(k, v)
	}
	for k, v := range o.c.namespaces[p.pod.ns] {
		add("io.cilium.k8s.namespace.labels."+k, v)
	}
	add("io.kubernetes.pod.namespace", p.pod.ns)
	return map[string]map[string]string{"k8s": k8s}
}

// req is one requirement of a selector: source "" for any.
type req struct {
	source, key, op string
	values          []string
}

func splitKey(k string) (string, string) {
	if src, rest, ok := strings.Cut(k, ":"); ok {
		if src == "any" {
			src = ""
		}
		return src, rest
	}
	return "", k
}

func (r req) holds(l map[string]map[string]string) bool {
	v, has := "", false
	for src, kv := range l {
		if r.source != "" && r.source != src {
			continue
		}
		if x, ok := kv[r.key]; ok {
			v, has = x, true
		}
	}
	switch r.op {
	case "In":
		return has && slices.Contains(r.values, v)
	case "NotIn":
		return !has || !slices.Contains(r.values, v)
	case "Exists":
		return has
	}
	return !has
}

// selects applies the reference's namespace rules to es (written in a
// policy of namespace ns, "" for clusterwide; subject: its
// endpointSelector) and matches a peer. World is never selected by labels.
func selects(es selectors.EndpointSelector, ns string, subject bool, l map[string]map[string]string, isWorld bool) bool {
	if isWorld {
		return false
	}
	var reqs []req
	reserved, nsKey, nsLabels := false, false, false
	note := func(r req) {
		switch {
		case r.source == "reserved":
			reserved = true
		case (r.source == "" || r.source == "k8s") && r.key == "io.kubernetes.pod.namespace":
			nsKey = true
		case (r.source == "" || r.source == "k8s") && strings.HasPrefix(r.key, "io.cilium.k8s.namespace.labels."):
			nsLabels = true
		}
	}
	for k, v := range es.MatchLabels {
		if subject && ns != "" && k == "k8s:io.kubernetes.pod.namespace" {
			continue // replaced by the policy's namespace
		}
		src, key := splitKey(k)
		r := req{src, key, "In", []string{v}}
		note(r)
		reqs = append(reqs, r)
	}
	for _, e := range es.MatchExpressions {
		src, key := splitKey(e.Key)
		r := req{src, key, e.Operator, e.Values}
		note(r)
		reqs = append(reqs, r)
	}
	nsIs := req{"k8s", "io.kubernetes.pod.namespace", "In", []string{ns}}
	switch {
	case subject && ns != "":
		reqs = append(reqs, nsIs)
	case subject, reserved, nsKey:
	case ns == "":
		reqs = append(reqs, req{"k8s", "io.kubernetes.pod.namespace", "Exists", nil})
	case !nsLabels:
		reqs = append(reqs, nsIs)
	}
	for _, r := range reqs {
		if !r.holds(l) {
			return false
		}
	}
	return true
}

// portMatches reports whether a toPorts list lets proto/port through,
// named ports resolved in scope (ambiguous names match nothing).
func portMatches(ports []selectors.PortRule, scope []tables.NamedPort, proto uint8, port uint16) bool {
	if len(ports) == 0 {
		return true
	}
	for _, pr := range ports {
		for _, pp := range pr.Ports {
			p := strings.ToUpper(pp.Protocol)
			if p == "" {
				p = "ANY"
			}
			if p != "ANY" && tables.Proto(proto).String() != p {
				continue
			}
			s := string(pp.Port)
			var n, end int
			if _, err := fmt.Sscanf(s, "%d", &n); err != nil && s != "" {
				// A name: the numbers it has for proto.
				var nums []uint16
				for _, np := range scope {
					npProto := np.Protocol
					if npProto == "" {
						npProto = "TCP"
					}
					if np.Name == s && npProto == tables.Proto(proto).String() && !slices.Contains(nums, np.Port) {
						nums = append(nums, np.Port)
					}
				}
				if len(nums) == 1 && nums[0] == port {
					return true
				}
				continue
			}
			fmt.Sscanf(string(pp.EndPort), "%d", &end)
			switch {
			case n == 0:
				return true
			case end > n && int(port) >= n && int(port) <= end:
				return true
			case int(port) == n:
				return true
			}
		}
	}
	return false
}

// verdict is the reference's verdict for a connection of the local pod ep.
func (o *oracle) verdict(ep *testPod, dir string, peer peerRef, proto uint8, port uint16) string {
	epLabels := o.labels(peerRef{pod: ep})
	peerLabels := o.labels(peer)
	isWorld := peer.pod == nil && peer.reserved == identity.IDWorld
	var scope []tables.NamedPort
	if dir == tables.DirIngress {
		scope = ep.ports
	} else {
		for _, p := range o.c.pods {
			if !p.remote {
				scope = append(scope, p.ports...)
			}
		}
	}
	enforced, defaultDeny, allowed, denied := false, false, false, false
	o.byNetworks = map[string]bool{}
	admin := o.clusterNetpolVerdict("Admin", ep, dir, peer, scope, proto, port)
	switch admin {
	case "deny":
		// The API: "Deny: Drops the selected traffic" (no EPERM).
		o.path = "admin deny" + o.networksNote("Admin")
		return "drop"
	case "allow":
		o.path = "admin " + admin + o.networksNote("Admin")
		return admin
	}
	o.path = ""
	if admin == "pass" {
		o.path = "pass, "
	}
	baseline := o.clusterNetpolVerdict("Baseline", ep, dir, peer, scope, proto, port)
	if admin != "" || baseline != "" {
		enforced = true
	}
	for _, pol := range o.policies {
		for _, r := range pol.rules {
			if r.EndpointSelector == nil || !selects(*r.EndpointSelector, pol.ns, true, epLabels, false) {
				continue
			}
			type peerRule struct {
				endpoints []selectors.EndpointSelector
				entities  []string
				ports     []selectors.PortRule
				deny      bool
			}
			var rules []peerRule
			var dd *bool
			if dir == tables.DirIngress {
				for _, x := range r.Ingress {
					rules = append(rules, peerRule{x.FromEndpoints, x.FromEntities, x.ToPorts, false})
				}
				for _, x := range r.IngressDeny {
					rules = append(rules, peerRule{x.FromEndpoints, x.FromEntities, x.ToPorts, true})
				}
				if r.EnableDefaultDeny != nil {
					dd = r.EnableDefaultDeny.Ingress
				}
			} else {
				for _, x := range r.Egress {
					rules = append(rules, peerRule{x.ToEndpoints, x.ToEntities, x.ToPorts, false})
				}
				for _, x := range r.EgressDeny {
					rules = append(rules, peerRule{x.ToEndpoints, x.ToEntities, x.ToPorts, true})
				}
				if r.EnableDefaultDeny != nil {
					dd = r.EnableDefaultDeny.Egress
				}
			}
			if len(rules) == 0 {
				continue
			}
			enforced = true
			if dd == nil || *dd {
				defaultDeny = true
			}
			for _, pr := range rules {
				peerOK := false
				switch {
				case (pr.endpoints != nil && len(pr.endpoints) == 0) || (pr.entities != nil && len(pr.entities) == 0):
				case pr.endpoints == nil && pr.entities == nil:
					peerOK = len(pr.ports) > 0
				default:
					for _, es := range pr.endpoints {
						peerOK = peerOK || selects(es, pol.ns, false, peerLabels, isWorld)
					}
					for _, e := range pr.entities {
						switch e {
						case "all":
							peerOK = true
						case "host":
							peerOK = peerOK || (peer.pod == nil && peer.reserved == identity.IDHost)
						case "world":
							peerOK = peerOK || isWorld
						case "cluster":
							peerOK = peerOK || !isWorld
						}
					}
				}
				if !peerOK || !portMatches(pr.ports, scope, proto, port) {
					continue
				}
				if pr.deny {
					denied = true
				} else {
					allowed = true
				}
			}
		}
	}
	switch {
	case !enforced:
		o.path += "not enforced"
		return "allow"
	case denied:
		o.path += "rules deny"
		return "deny"
	case allowed:
		o.path += "rules allow"
		return "allow"
	case !defaultDeny && (baseline == "allow" || baseline == "deny"):
		// No NetworkPolicy or CNP decided: the Baseline tier does; its
		// Deny drops as the Admin tier's.
		o.path += "baseline " + baseline + o.networksNote("Baseline")
		if baseline == "deny" {
			return "drop"
		}
		return baseline
	case !defaultDeny:
		o.path += "default allow"
		return "allow"
	case dir == tables.DirIngress && peer.pod == nil && peer.reserved == identity.IDHost && o.c.localhost != LocalhostPolicy:
		return "allow"
	}
	o.path += "default deny"
	return "deny"
}

// networksNote is what o.path adds when tier's rule matched by networks.
func (o *oracle) networksNote(tier string) string {
	if o.byNetworks[tier] {
		return " by networks"
	}
	return ""
}

// randomCluster makes a cluster of a few namespaces, pods and policies.
type generator struct {
	rng *rand.Rand
	// networks: clusterNetpol writes networks peers too.
	networks bool
}

func (g generator) pick(s ...string) string { return s[g.rng.IntN(len(s))] }

func (g generator) pod(i int) testPod {
	// Addresses without the generator, so that other streams stay: pods
	// of even and odd numbers in two /24s (clusterNetpol's networks).
	p := testPod{ns: g.pick("alpha", "beta", "gamma"), name: fmt.Sprintf("pod-%d", i), labels: map[string]string{},
		addr: fmt.Sprintf("10.0.%d.%d", i%2, 10+i%200)}
	p.labels["app"] = g.pick("web", "api", "db")
	if g.rng.IntN(2) == 0 {
		p.labels["tier"] = g.pick("front", "back")
	}
	if g.rng.IntN(3) == 0 {
		p.labels["kubernetes.io/arch"] = g.pick("amd64", "arm64")
	}
	switch g.rng.IntN(4) {
	case 0:
		p.ports = []tables.NamedPort{{Name: "http", Port: 8080, Protocol: "TCP"}}
	case 1:
		p.ports = []tables.NamedPort{{Name: "http", Port: 9090, Protocol: "TCP"}}
	case 2:
		p.ports = []tables.NamedPort{{Name: "dns", Port: 53, Protocol: "UDP"}}
	}
	p.remote = g.rng.IntN(5) == 0
	return p
}

func (g generator) selector() string {
	switch g.rng.IntN(12) {
	case 0:
		return "{}"
	case 1:
		return fmt.Sprintf("{matchLabels: {app: %s, io.kubernetes.pod.namespace: %s}}", g.pick("web", "api", "db"), g.pick("alpha", "beta", "gamma"))
	case 2:
		return fmt.Sprintf(`{matchLabels: {app: %s, "k8s:io.kubernetes.pod.namespace": %s}}`, g.pick("web", "api", "db"), g.pick("alpha", "beta", "gamma"))
	case 3:
		return fmt.Sprintf("{matchLabels: {io.cilium.k8s.namespace.labels.env: %s}}", g.pick("dev", "prod"))
	case 4:
		return `{matchLabels: {"reserved:host": ""}}`
	case 5:
		return fmt.Sprintf("{matchExpressions: [{key: tier, operator: %s}]}", g.pick("Exists", "DoesNotExist"))
	case 6:
		return fmt.Sprintf("{matchExpressions: [{key: app, operator: NotIn, values: [%s]}]}", g.pick("web", "api"))
	case 7:
		return fmt.Sprintf("{matchLabels: {kubernetes.io/arch: %s}}", g.pick("amd64", "arm64"))
	default:
		return fmt.Sprintf("{matchLabels: {app: %s}}", g.pick("web", "api", "db"))
	}
}

func (g generator) ports() string {
	switch g.rng.IntN(6) {
	case 0, 1:
		return ""
	case 2:
		return fmt.Sprintf(`, toPorts: [{ports: [{port: "%s", protocol: %s}]}]`, g.pick("80", "8080", "53"), g.pick("TCP", "UDP", "ANY"))
	case 3:
		return `, toPorts: [{ports: [{port: "8000", endPort: 9000, protocol: TCP}]}]`
	default:
		return fmt.Sprintf(`, toPorts: [{ports: [{port: %s}]}]`, g.pick("http", "dns"))
	}
}

func (g generator) rule(peerField, entityField string) string {
	switch g.rng.IntN(6) {
	case 0:
		return fmt.Sprintf("{%s: [%s, %s]%s}", peerField, g.selector(), g.selector(), g.ports())
	case 1:
		return fmt.Sprintf("{%s: [%s]%s}", entityField, g.pick("host", "world", "cluster", "all"), g.ports())
	case 2:
		return fmt.Sprintf("{%s: []%s}", g.pick(peerField, entityField), g.ports())
	case 3:
		if p := g.ports(); p != "" {
			return "{" + strings.TrimPrefix(p, ", ") + "}"
		}
		return "{}"
	default:
		return fmt.Sprintf("{%s: [%s]%s}", peerField, g.selector(), g.ports())
	}
}

func (g generator) policy(i int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "endpointSelector: %s\n", g.selector())
	for _, sec := range []struct{ name, peer, entity string }{
		{"ingress", "fromEndpoints", "fromEntities"}, {"ingressDeny", "fromEndpoints", "fromEntities"},
		{"egress", "toEndpoints", "toEntities"}, {"egressDeny", "toEndpoints", "toEntities"},
	} {
		if g.rng.IntN(3) != 0 {
			continue
		}
		var rules []string
		for range 1 + g.rng.IntN(2) {
			rules = append(rules, g.rule(sec.peer, sec.entity))
		}
		fmt.Fprintf(&b, "%s: [%s]\n", sec.name, strings.Join(rules, ", "))
	}
	if g.rng.IntN(6) == 0 {
		fmt.Fprintf(&b, "enableDefaultDeny: {%s: false}\n", g.pick("ingress", "egress"))
	}
	if g.rng.IntN(3) == 0 {
		return ccnp(fmt.Sprintf("p%d", i), b.String())
	}
	return cnp(g.pick("alpha", "beta", "gamma"), fmt.Sprintf("p%d", i), b.String())
}

// TestPolicyProperty: after every random change (pods added, deleted,
// replaced and relabelled, namespaces relabelled, policies added and
// deleted, named ports changed), the agent's verdict of every probe equals
// the oracle's, and the engine, updated incrementally, holds exactly what
// it computes from scratch.
func TestPolicyProperty(t *testing.T) {
	runPolicyProperty(t, 24, 3, generator.policy)
}

// runPolicyProperty runs the property test with up to maxPolicies
// policies at first from newPolicy, the random streams numbered stream. It
// returns how often the oracle took each path (oracle.path) where the
// endpoint was enforced.
func runPolicyProperty(t *testing.T, stream uint64, maxPolicies int, newPolicy func(g generator, i int) string) map[string]int {
	seeds, steps := 20, 25
	if testing.Short() {
		seeds = 5
	}
	// APIARY_PROPERTY_SEEDS runs more (or fewer) random clusters.
	if n, err := strconv.Atoi(os.Getenv("APIARY_PROPERTY_SEEDS")); err == nil && n > 0 {
		seeds = n
	}
	// How often each verdict came out where the endpoint was enforced:
	// a run that never denies (or never allows) proves nothing.
	verdicts, paths := map[string]int{}, map[string]int{}
	// How many policy-set references the runs with sets made: a run
	// that never shares proves nothing of the sets.
	shared := 0
	for seed := range seeds {
		g := generator{rng: rand.New(rand.NewPCG(uint64(seed), stream))}
		// Without policy sets, with every shareable allow in one, and with
		// a threshold that selectors cross as pods come and go.
		c := cluster{namespaces: map[string]map[string]string{}, shareMin: []int{0, 1, 3}[seed%3]}
		for _, ns := range []string{"alpha", "beta", "gamma"} {
			c.namespaces[ns] = map[string]string{"env": g.pick("dev", "prod")}
		}
		for i := range 6 {
			c.pods = append(c.pods, g.pod(i))
		}
		for i := range 1 + g.rng.IntN(maxPolicies) {
			c.policies = append(c.policies, newPolicy(g, i))
		}
		c.localhost = g.pick(LocalhostAlways, LocalhostPolicy)
		if g.rng.IntN(4) == 0 {
			c.identityLabels = []string{"!tier"}
		}
		m := newAgentModel(t, c.localhost)
		for step := range steps {
			var what string
			switch op := g.rng.IntN(9); {
			case step == 0:
				what = "start"
			case op == 0:
				i := g.rng.IntN(len(c.pods))
				name, addr := c.pods[i].name, c.pods[i].addr
				c.pods[i] = g.pod(0)
				c.pods[i].name, c.pods[i].addr = name, addr
				what = "replace pod " + c.pods[i].key()
			case op == 1:
				i := g.rng.IntN(len(c.pods))
				labels := map[string]string{}
				for k, v := range c.pods[i].labels {
					labels[k] = v
				}
				labels["app"] = g.pick("web", "api", "db")
				c.pods[i].labels = labels
				what = "relabel pod " + c.pods[i].key()
			case op == 2:
				ns := g.pick("alpha", "beta", "gamma")
				c.namespaces = map[string]map[string]string{"alpha": c.namespaces["alpha"], "beta": c.namespaces["beta"], "gamma": c.namespaces["gamma"]}
				c.namespaces[ns] = map[string]string{"env": g.pick("dev", "prod")}
				what = "relabel namespace " + ns
			case op == 3 && len(c.policies) > 0:
				i := g.rng.IntN(len(c.policies))
				c.policies = slices.Delete(slices.Clone(c.policies), i, i+1)
				what = "delete a policy"
			case op == 4:
				c.policies = append(slices.Clone(c.policies), newPolicy(g, 100+step))
				what = "add a policy"
			case op == 7 && len(c.pods) > 2:
				i := g.rng.IntN(len(c.pods))
				what = "delete pod " + c.pods[i].key()
				c.pods = slices.Delete(slices.Clone(c.pods), i, i+1)
			case op == 8:
				// A name no earlier pod had: a new endpoint and identity.
				c.pods = append(slices.Clone(c.pods), g.pod(10+step))
				what = "add pod " + c.pods[len(c.pods)-1].key()
			default:
				i := g.rng.IntN(len(c.pods))
				c.pods[i].ports = g.pod(i).ports
				what = "change named ports of " + c.pods[i].key()
			}
			c.pods = slices.Clone(c.pods)
			m.apply(c)
			m.sameAsFromScratch(c, fmt.Sprintf("seed %d step %d (%s)", seed, step, what))
			for _, e := range m.out.entries {
				if e.Identity == tables.PolicySetRef {
					shared++
				}
			}
			o := newOracle(t, c)
			var peers []peerRef
			for _, id := range []uint32{identity.IDHost, identity.IDWorld, 4} {
				peers = append(peers, peerRef{reserved: id})
			}
			for i := range c.pods {
				peers = append(peers, peerRef{pod: &c.pods[i]})
			}
			for i := range c.pods {
				ep := &c.pods[i]
				if ep.remote {
					continue
				}
				for _, dir := range []string{tables.DirIngress, tables.DirEgress} {
					for _, peer := range peers {
						id := peer.reserved
						if peer.pod != nil {
							id = m.podIDs[peer.pod.key()]
						}
						for _, proto := range []uint8{protoTCP, protoUDP} {
							for _, port := range []uint16{53, 80, 8080, 8500, 9090} {
								want := o.verdict(ep, dir, peer, proto, port)
								if row := m.out.endpoints[ep.key()]; (dir == tables.DirIngress && row.Ingress != tables.EnforceOff) ||
									(dir == tables.DirEgress && row.Egress != tables.EnforceOff) {
									// A drop is a denial, as the count goes.
									verdicts[strings.Replace(want, "drop", "deny", 1)]++
									paths[o.path]++
								}
								if got := m.verdict(ep.key(), dir, id, proto, port); got != want {
									pname := fmt.Sprint(peer.reserved)
									if peer.pod != nil {
										pname = peer.pod.key()
									}
									t.Fatalf("seed %d step %d (%s): %s %s peer %s (identity %d) %s/%d: agent %s, oracle %s\npolicies:\n%s\npods: %+v\nnamespaces: %v\nentries: %v",
										seed, step, what, ep.key(), dir, pname, id, tables.Proto(proto), port, got, want,
										strings.Join(c.policies, "---\n"), c.pods, c.namespaces, m.out.list(ep.key()))
								}
							}
						}
					}
				}
			}
		}
	}
	t.Logf("verdicts of enforced directions: %v; policy-set references: %d", verdicts, shared)
	if seeds >= 3 && shared == 0 {
		t.Errorf("no endpoint shared a policy set")
	}
	if verdicts["allow"] < 1000 || verdicts["deny"] < 1000 {
		t.Errorf("verdicts of enforced directions %v: the generator hardly enforces anything", verdicts)
	}
	return paths
}

// sameAsFromScratch fails the test unless the incremental engine's output
// equals that of a new engine given cluster c at once, with the same
// identity and cgroup numbers: entries, endpoint rows (but for the
// endpoint IDs, numbered in the order endpoints came) and warnings
// (leftovers of earlier steps that no verdict shows, such as a stale
// entry shadowed by a longer one, show here).
func (m *agentModel) sameAsFromScratch(c cluster, when string) {
	m.t.Helper()
	fresh := newAgentModel(m.t, c.localhost)
	fresh.eng.shareMin = c.shareMin
	fresh.ids, fresh.labels, fresh.next = maps.Clone(m.ids), maps.Clone(m.labels), m.next
	fresh.cgroups = maps.Clone(m.cgroups)
	fresh.apply(c)
	describe := func(o *tableOutput) []string {
		var out []string
		// Policy sets are named by their IDs, which differ: each is
		// named by the endpoints that refer to it instead.
		sets := map[string][]string{}
		for _, e := range o.entries {
			if e.Identity == tables.PolicySetRef {
				sets[e.Policies[0]] = append(sets[e.Policies[0]], e.Endpoint+" "+e.Direction)
			}
		}
		rename := func(name string) string {
			if users, ok := sets[name]; ok {
				slices.Sort(users)
				return "set of " + strings.Join(users, ",")
			}
			return name
		}
		// Endpoint IDs are handed out in the order endpoints come, which
		// differs; the names say which endpoint.
		for _, e := range o.entries {
			e := *e
			e.EndpointID = 0
			e.Endpoint = rename(e.Endpoint)
			if e.Identity == tables.PolicySetRef {
				e.Cookie = 0
			}
			e.Policies = slices.Clone(e.Policies)
			for i, p := range e.Policies {
				e.Policies[i] = rename(p)
			}
			if strings.HasPrefix(e.Endpoint, "set of") {
				e.Cookie = 0
			}
			out = append(out, fmt.Sprintf("entry %s: %+v", e.Key(), e))
		}
		for name, e := range o.endpoints {
			e := *e
			e.ID = 0
			e.Name = rename(e.Name)
			out = append(out, fmt.Sprintf("endpoint %s: %+v", rename(name), e))
		}
		slices.Sort(out)
		return out
	}
	got, want := describe(m.out), describe(fresh.out)
	if !slices.Equal(got, want) {
		var diff []string
		for _, l := range got {
			if !slices.Contains(want, l) {
				diff = append(diff, "- incremental only: "+l)
			}
		}
		for _, l := range want {
			if !slices.Contains(got, l) {
				diff = append(diff, "+ from scratch only: "+l)
			}
		}
		m.t.Fatalf("%s: the incremental engine's output differs from a computation from scratch:\n%s", when, strings.Join(diff, "\n"))
	}
	if gw, fw := fmt.Sprint(m.warnings), fmt.Sprint(fresh.warnings); gw != fw {
		m.t.Fatalf("%s: warnings %s, from scratch %s", when, gw, fw)
	}
}
