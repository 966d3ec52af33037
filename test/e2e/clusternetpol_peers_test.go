package e2e

// ClusterNetworkPolicy nodes and domainNames peers, and the status
// condition of --config-dir (issue 38), on the shipped binary.

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

const (
	uidNodePeerClient = "39393939-0000-4000-8000-000000000001"
	ipNodePeerClient  = "127.0.39.1"
	ipNodePeerNode    = "127.0.39.200"
	// ipNodePeerRemote is another node's address: labelled, never connected to.
	ipNodePeerRemote = "192.0.2.39"
)

// clusterNetpolNodes are this node (e2e-node, role=db) and another
// (other-node, role=web), and a pod of this node in namespace np.
const clusterNetpolNodes = `apiVersion: v1
kind: Namespace
metadata: {name: np}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: np, uid: ` + uidNodePeerClient + `, labels: {app: client}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipNodePeerClient + `, podIPs: [{ip: ` + ipNodePeerClient + `}]}
`

func nodesDoc(hereRole, otherRole string) string {
	return `apiVersion: v1
kind: Node
metadata: {name: e2e-node, labels: {role: ` + hereRole + `}}
status: {addresses: [{type: InternalIP, address: ` + ipNodePeerNode + `}]}
---
apiVersion: v1
kind: Node
metadata: {name: other-node, labels: {role: ` + otherRole + `}}
status: {addresses: [{type: InternalIP, address: ` + ipNodePeerRemote + `}]}
`
}

// TestClusterNetworkPolicyNodePeers: an Admin Deny to the nodes labelled
// role=db denies a pod this node's address (the host identity) while this
// node is role=db, and no longer once its label changes; the other node,
// relabelled role=db, gets an identity of its own carrying the peer's
// label (not remote-node's 6). The policy's status condition, with no API
// server, is in the clusternetpol-status table.
func TestClusterNetworkPolicyNodePeers(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	cg := filepath.Join(root, "kubepods", "pod"+uidNodePeerClient, "ctr")
	if err := os.MkdirAll(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for p := cg; p != root; p = filepath.Dir(p) {
			removeCgroup(p)
		}
	})
	listen(t, ipNodePeerNode+":7100", ipNodePeerNode+":7101")
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), clusterNetpolNodes)
	writeFile(t, filepath.Join(configDir, "nodes.yaml"), nodesDoc("db", "web"))
	writeFile(t, filepath.Join(configDir, "policy.yaml"), clusterNetpolDoc("no-db-nodes", `  tier: Admin
  priority: 10
  subject: {namespaces: {matchLabels: {kubernetes.io/metadata.name: np}}}
  egress:
  - name: db-nodes-7100
    action: Deny
    to: [{nodes: {matchLabels: {role: db}}}]
    protocols: [{tcp: {destinationPort: {number: 7100}}}]
`))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + ipNodePeerNode,
	}})
	a.waitEndpointPolicy(t, map[string]string{"np/client": "off default-allow"})

	expect := func(what string, want map[string]string) {
		t.Helper()
		testenv.Eventually(t, waitTimeout, what, func() (bool, string) {
			ok, report := true, []string{}
			for _, addr := range slices.Sorted(func(yield func(string) bool) {
				for k := range want {
					if !yield(k) {
						return
					}
				}
			}) {
				got := connectFrom(t, cg, addr, ipNodePeerClient)
				good := got == want[addr] || want[addr] == "ok" && strings.HasPrefix(got, "ok")
				ok = ok && good
				report = append(report, fmt.Sprintf("%s: %s (want %s)", addr, got, want[addr]))
			}
			return ok, strings.Join(report, "; ")
		})
	}
	expect("this node (role=db) denied on 7100 only", map[string]string{ipNodePeerNode + ":7100": "EPERM", ipNodePeerNode + ":7101": "ok"})

	type ipcacheRow struct {
		Prefix   string
		Identity uint32
		Labels   []string
	}
	remoteRow := func() (ipcacheRow, bool) {
		var rows []ipcacheRow
		if err := a.dump("ipcache", &rows); err != nil {
			return ipcacheRow{}, false
		}
		for _, r := range rows {
			if r.Prefix == ipNodePeerRemote+"/32" {
				return r, true
			}
		}
		return ipcacheRow{}, false
	}
	testenv.Eventually(t, waitTimeout, "the other node (role=web) is remote-node, identity 6", func() (bool, string) {
		r, ok := remoteRow()
		return ok && r.Identity == 6, fmt.Sprintf("%+v", r)
	})

	writeFile(t, filepath.Join(configDir, "nodes.yaml"), nodesDoc("web", "db"))
	expect("this node (now role=web) open", map[string]string{ipNodePeerNode + ":7100": "ok"})
	testenv.Eventually(t, waitTimeout, "the other node (now role=db) has the peer's label and an identity of its own", func() (bool, string) {
		r, ok := remoteRow()
		return ok && r.Identity != 6 && r.Identity != 0 && slices.Contains(r.Labels, "nodes:{role=db}") &&
			slices.Contains(r.Labels, "reserved:remote-node"), fmt.Sprintf("%+v", r)
	})
	testenv.Eventually(t, waitTimeout, "the ipcache map has the other node's identity", func() (bool, string) {
		r, _ := remoteRow()
		m, err := a.ipcacheMap()
		if err != nil {
			return false, err.Error()
		}
		return m[ipNodePeerRemote+"/32"] == r.Identity, fmt.Sprintf("map %d, row %d", m[ipNodePeerRemote+"/32"], r.Identity)
	})

	// No API server: the condition is in the table only, which `apiary db
	// show` prints.
	testenv.Eventually(t, waitTimeout, "clusternetpol-status", func() (bool, string) {
		var rows []struct{ Name, Type, Status, Reason, Written string }
		if err := a.showJSON("clusternetpol-status", &rows); err != nil {
			return false, err.Error()
		}
		want := "clusternetpol/no-db-nodes Ready-On-Node-e2e-node True Enforced no API server"
		got := fmt.Sprint(rows)
		return len(rows) == 1 && fmt.Sprintf("%s %s %s %s %s", rows[0].Name, rows[0].Type, rows[0].Status, rows[0].Reason, rows[0].Written) == want, got
	})
}

// clusterNetpolDomainNames: pod client-a may reach what names under
// allowed.test resolve to (the API's "*.": one label or more) on 8080,
// the resolver on 53, and nothing else outside the cluster.
const clusterNetpolDomainNames = `  tier: Admin
  priority: 10
  subject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: client}}}}
  egress:
  - name: names
    action: Accept
    to: [{domainNames: ["*.allowed.test"]}]
    protocols: [{tcp: {destinationPort: {number: 8080}}}]
  - name: dns
    action: Accept
    to: [{networks: [%s/32]}]
    protocols: [{udp: {destinationPort: {number: 53}}}, {tcp: {destinationPort: {number: 53}}}]
  - name: nothing-else
    action: Deny
    to: [{networks: [0.0.0.0/0]}]
`

// TestClusterNetworkPolicyDomainNames: a domainNames Accept over a Deny
// of every address outside the cluster, through the DNS proxy. The
// subject's DNS is intercepted although no rule of it is a DNS rule, and
// every name may still be looked up (the rule allows addresses, not
// lookups); the addresses of names *.allowed.test matches — a.b.allowed.test
// too — are reachable on 8080, those of denied.test are not.
func TestClusterNetworkPolicyDomainNames(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	digBin := testenv.RequireProgram(t, "dig")
	resolver, allowedIP, deniedIP := startResolver(t)
	root := testenv.Cgroup(t)
	cgA, _, cgC := mkCgroups(t, root)
	listen(t, allowedIP+":8080", deniedIP+":8080")
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(t, filepath.Join(configDir, "svc.yaml"), `apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: kube-dns-1, namespace: default, labels: {kubernetes.io/service-name: kube-dns}}
addressType: IPv4
ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
endpoints: [{addresses: ["`+resolver+`"], conditions: {ready: true}}]
`)
	writeFile(t, filepath.Join(configDir, "names.yaml"), clusterNetpolDoc("names", fmt.Sprintf(clusterNetpolDomainNames, resolver)))
	proxy := net.JoinHostPort("127.0.0.1", fmt.Sprint(freePort(t)))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root,
		"--dns-proxy-addr=" + proxy, "--dns-upstream=127.0.0.1:1",
		"--tofqdns-proxy-response-max-delay=15s",
		"--dns-cluster-service=default/kube-dns",
	}})
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-allow", "default/client-c": "off off"})
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")

	ask := func(dir, name string) (string, []string) {
		t.Helper()
		out, err := digIn(dir, digBin, resolver, name, false)
		if err != nil {
			t.Fatalf("dig %s in %s: %v", name, dir, err)
		}
		return answerOf(out)
	}
	for _, name := range []string{"www.allowed.test", "a.b.allowed.test"} {
		if status, ips := ask(cgA, name); status != "NOERROR" || !slices.Equal(ips, []string{allowedIP}) {
			t.Fatalf("dig %s from client-a: %s %v, want NOERROR [%s]", name, status, ips, allowedIP)
		}
		// The answer was held until the policy allowed its address.
		if got := connectFrom(t, cgA, allowedIP+":8080", ""); got != "ok: hello from "+allowedIP+":8080" {
			t.Errorf("connect to %s after resolving %s: %s", allowedIP, name, got)
		}
	}
	// Every name may be looked up; what denied.test resolves to stays
	// denied.
	if status, ips := ask(cgA, "www.denied.test"); status != "NOERROR" || !slices.Equal(ips, []string{deniedIP}) {
		t.Errorf("dig www.denied.test from client-a: %s %v, want NOERROR [%s]", status, ips, deniedIP)
	}
	if got := connectFrom(t, cgA, deniedIP+":8080", ""); got != "EPERM" {
		t.Errorf("connect to %s: %s, want EPERM", deniedIP, got)
	}
	// Only the subject's DNS is intercepted, and the names it looked up
	// label addresses.
	var eps []struct {
		Name string
		DNS  []struct{ Pattern, Policy string }
	}
	if err := a.dump("endpoint-policy", &eps); err != nil {
		t.Fatal(err)
	}
	for _, ep := range eps {
		want := ""
		if ep.Name == "default/client-a" {
			want = "[{* clusternetpol/names}]"
		}
		if got := fmt.Sprint(ep.DNS); ep.Name != "default/server-b" && got != want && !(want == "" && len(ep.DNS) == 0) {
			t.Errorf("%s: DNS rules %s, want %s", ep.Name, got, want)
		}
	}
	if status, ips := ask(cgC, "www.denied.test"); status != "NOERROR" || !slices.Equal(ips, []string{deniedIP}) {
		t.Errorf("dig www.denied.test from client-c: %s %v", status, ips)
	}
	var names []fqdnNameRow
	if err := a.showJSON("fqdn-names", &names); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range names {
		got = append(got, r.Name)
	}
	slices.Sort(got)
	if want := []string{"a.b.allowed.test", "www.allowed.test"}; !slices.Equal(got, want) {
		t.Errorf("fqdn-names: %v, want %v", got, want)
	}
}
