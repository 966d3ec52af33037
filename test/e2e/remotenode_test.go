package e2e

// Other nodes' addresses (issue 36): the agent gives the InternalIP and
// ExternalIP addresses of every Node object but its own the remote-node
// identity (6), so that toEntities/fromEntities remote-node selects them,
// and takes it back when the Node goes.

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/apiary-net/apiary/internal/testenv"
)

const (
	uidRemote   = "6e6e6e6e-0000-4000-8000-00000000006e"
	ipRemotePod = "127.0.6.3"
	// remoteAddr is the other node's address: on a veth of this host, so
	// that a connection to it is answered while it is the world.
	remoteAddr = "198.18.79.1"
	remoteLink = "apiary-rnode"
)

const remotePod = `apiVersion: v1
kind: Pod
metadata: {name: client, namespace: rnode, uid: ` + uidRemote + `, labels: {app: client}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipRemotePod + `, podIPs: [{ip: ` + ipRemotePod + `}]}
`

// The world is allowed, other nodes are not.
const worldNotRemoteNode = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: world-not-remote-node, namespace: rnode}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress: [{toEntities: [world]}]
  egressDeny: [{toEntities: [remote-node]}]
`

// The agent's own node, whose address stays the host's.
const localNode = `apiVersion: v1
kind: Node
metadata: {name: e2e-node}
status: {addresses: [{type: InternalIP, address: 192.0.2.250}, {type: Hostname, address: e2e-node}]}
`

// imposterNode claims the agent's own address (its --node-ips) beside one
// of its own.
const imposterNode = `apiVersion: v1
kind: Node
metadata: {name: e2e-imposter}
status: {addresses: [{type: InternalIP, address: 192.0.2.250}, {type: InternalIP, address: ` + remoteAddr + `}]}
`

const otherNode = `apiVersion: v1
kind: Node
metadata: {name: e2e-node-2}
status: {addresses: [{type: InternalIP, address: ` + remoteAddr + `}, {type: Hostname, address: e2e-node-2}]}
`

// TestRemoteNodeIdentity: an address is the world until a Node object
// names it; then it is reserved:remote-node (identity 6) in the ipcache
// table and map, and a pod whose egress allows the world but denies
// remote-node cannot connect to it; once the Node is deleted it is the
// world again and the pod connects. A Node claiming this node's own
// address does not make it remote-node.
func TestRemoteNodeIdentity(t *testing.T) {
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	cg := filepath.Join(root, "kubepods", "pod"+uidRemote, "ctr")
	if err := os.MkdirAll(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for p := cg; p != root; p = filepath.Dir(p) {
			removeCgroup(p)
		}
	})
	link := addLink(t, remoteLink)
	if err := netlink.AddrAdd(link, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP(remoteAddr), Mask: net.CIDRMask(32, 32)}}); err != nil {
		t.Fatalf("add %s to %s: %v", remoteAddr, remoteLink, err)
	}
	addr := remoteAddr + ":7078"
	listen(t, addr)

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), remotePod)
	writeFile(t, filepath.Join(configDir, "policy.yaml"), worldNotRemoteNode)
	writeFile(t, filepath.Join(configDir, "node.yaml"), localNode)
	// Static node addresses: the veth's is not the host's.
	a := startAgent(t, agentOptions{configDir: configDir,
		flags: []string{"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=192.0.2.250"}})
	a.waitEndpointPolicy(t, map[string]string{"rnode/client": "off default-deny"})

	wantConnectFrom(t, cg, addr, "ok")

	other := filepath.Join(configDir, "node-2.yaml")
	writeFile(t, other, otherNode)
	a.waitRemoteNode(t, remoteAddr+"/32", true)
	wantConnectFrom(t, cg, addr, "EPERM")
	out, err := a.db("show", "nodes")
	if err != nil {
		t.Fatalf("apiary db show nodes: %v\n%s", err, out)
	}
	t.Logf("apiary db show nodes:\n%s", out)

	if err := os.Remove(other); err != nil {
		t.Fatal(err)
	}
	a.waitRemoteNode(t, remoteAddr+"/32", false)
	wantConnectFrom(t, cg, addr, "ok")

	// A Node claiming this node's own address: that address stays the
	// host's alone (not remote-node too), the claim is in the nodes
	// table's Conflicts; the Node's other address is remote-node.
	imposter := filepath.Join(configDir, "imposter.yaml")
	writeFile(t, imposter, imposterNode)
	a.waitRemoteNode(t, remoteAddr+"/32", true)
	wantConnectFrom(t, cg, addr, "EPERM")
	var nodes []struct {
		Name      string   `json:"name"`
		Addresses []string `json:"addresses"`
		Conflicts []string `json:"conflicts"`
	}
	if err := a.dump("nodes", &nodes); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, n := range nodes {
		if n.Name == "e2e-imposter" {
			found = true
			if !slices.Equal(n.Addresses, []string{remoteAddr}) || !slices.Equal(n.Conflicts, []string{"192.0.2.250 is this node's address"}) {
				t.Errorf("e2e-imposter in the nodes table: %+v", n)
			}
		}
	}
	if !found {
		t.Errorf("e2e-imposter not in the nodes table: %+v", nodes)
	}
	var rows []ipcacheRow
	if err := a.dump("ipcache", &rows); err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.Prefix == "192.0.2.250/32" && (r.Identity != 1 || !slices.Equal(r.Labels, []string{"reserved:host"})) {
			t.Errorf("the node's own address claimed by e2e-imposter: %+v", r)
		}
	}
	out, err = a.db("show", "nodes")
	if err != nil {
		t.Fatalf("apiary db show nodes: %v\n%s", err, out)
	}
	t.Logf("apiary db show nodes:\n%s", out)
}

// wantConnectFrom waits until a connection from the cgroup dir to addr
// comes out as want ("ok", "EPERM"; a prefix of connectFrom's outcome).
func wantConnectFrom(t *testing.T, dir, addr, want string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, fmt.Sprintf("connect to %s: %s", addr, want), func() (bool, string) {
		got := connectFrom(t, dir, addr, "")
		return len(got) >= len(want) && got[:len(want)] == want, got
	})
}

// waitRemoteNode waits until prefix is reserved:remote-node (identity 6)
// in the ipcache table and map (want), or gone from both.
func (a *agent) waitRemoteNode(t *testing.T, prefix string, want bool) {
	t.Helper()
	what := prefix + " reserved:remote-node in the ipcache table and map"
	if !want {
		what = prefix + " gone from the ipcache table and map"
	}
	testenv.Eventually(t, waitTimeout, what, func() (bool, string) {
		var rows []ipcacheRow
		if err := a.dump("ipcache", &rows); err != nil {
			return false, err.Error()
		}
		inTable := false
		for _, r := range rows {
			if r.Prefix == prefix {
				if !want {
					return false, fmt.Sprintf("still in the table: %+v", r)
				}
				inTable = slices.Equal(r.Labels, []string{"reserved:remote-node"}) && r.Status.Kind == "Done"
			}
		}
		m, err := a.ipcacheMap()
		if err != nil {
			return false, err.Error()
		}
		id, inMap := m[prefix]
		if !want {
			return !inMap, fmt.Sprintf("still in the map with identity %d", id)
		}
		return inTable && id == 6, fmt.Sprintf("table row remote-node: %v; map identity %d (in map %v)", inTable, id, inMap)
	})
}
