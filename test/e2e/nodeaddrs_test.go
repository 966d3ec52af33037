package e2e

// The node's addresses followed live (issue 35 item 6): an address the
// node gains after the agent started is reserved:host, not world, so an
// egressDeny of the host denies it although the world is allowed; one it
// loses is no longer the host.

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/internal/testenv"
)

const (
	uidAddrs   = "6d6d6d6d-0000-4000-8000-00000000006d"
	ipAddrsPod = "127.0.6.2"
	// The addresses the node gains on an interface made after the
	// agent started (TEST-NET-2 style ranges no other test uses).
	lateAddr4 = "198.18.77.1"
	lateAddr6 = "2001:db8:77::1"
	lateLink  = "apiary-late"
)

const addrsPod = `apiVersion: v1
kind: Pod
metadata: {name: client, namespace: addrs, uid: ` + uidAddrs + `, labels: {app: client}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipAddrsPod + `, podIPs: [{ip: ` + ipAddrsPod + `}]}
`

// The world is allowed, the host is not.
const worldNotHost = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: world-not-host, namespace: addrs}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress: [{toEntities: [world]}]
  egressDeny: [{toEntities: [host]}]
`

// TestNodeAddressesFollowed: with --node-ips empty, an address added to a
// new interface after the agent started becomes reserved:host in the
// ipcache table and map, both families, and a pod whose egress allows the
// world but denies the host cannot connect to it; removed, it leaves the
// ipcache.
func TestNodeAddressesFollowed(t *testing.T) {
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	cg := filepath.Join(root, "kubepods", "pod"+uidAddrs, "ctr")
	if err := os.MkdirAll(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for p := cg; p != root; p = filepath.Dir(p) {
			removeCgroup(p)
		}
	})
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), addrsPod)
	writeFile(t, filepath.Join(configDir, "policy.yaml"), worldNotHost)
	a := startAgent(t, agentOptions{configDir: configDir,
		flags: []string{"--node-name=e2e-node", "--cgroup-root=" + root, "--enable-ipv6"}})
	a.waitEndpointPolicy(t, map[string]string{"addrs/client": "off default-deny"})

	link := addLink(t, lateLink)
	addrs := []*netlink.Addr{
		{IPNet: &net.IPNet{IP: net.ParseIP(lateAddr4), Mask: net.CIDRMask(32, 32)}},
		{IPNet: &net.IPNet{IP: net.ParseIP(lateAddr6), Mask: net.CIDRMask(128, 128)}, Flags: unix.IFA_F_NODAD},
	}
	for _, ad := range addrs {
		if err := netlink.AddrAdd(link, ad); err != nil {
			t.Fatalf("add %s to %s: %v", ad.IPNet, lateLink, err)
		}
	}
	listen(t, lateAddr4+":7077", "["+lateAddr6+"]:7077")

	for _, prefix := range []string{lateAddr4 + "/32", lateAddr6 + "/128"} {
		a.waitHostPrefix(t, prefix, true)
	}
	for _, addr := range []string{lateAddr4 + ":7077", "[" + lateAddr6 + "]:7077"} {
		if got := connectFrom(t, cg, addr, ""); got != "EPERM" {
			t.Errorf("connect to the node's new address %s from a pod denied the host: %s, want EPERM", addr, got)
		}
	}

	// Removed, the addresses are no longer the host's.
	for _, ad := range addrs {
		if err := netlink.AddrDel(link, ad); err != nil {
			t.Fatalf("delete %s from %s: %v", ad.IPNet, lateLink, err)
		}
	}
	for _, prefix := range []string{lateAddr4 + "/32", lateAddr6 + "/128"} {
		a.waitHostPrefix(t, prefix, false)
	}
}

// addLink makes a veth pair (the machine may have no dummy driver), both
// ends up in the host's namespace, removed when the test ends, and
// returns the end named name.
func addLink(t *testing.T, name string) netlink.Link {
	t.Helper()
	if old, err := netlink.LinkByName(name); err == nil {
		netlink.LinkDel(old) // left by an earlier run that was killed
	}
	link := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}
	if err := netlink.LinkAdd(link); err != nil {
		t.Fatalf("add veth %s: %v", name, err)
	}
	t.Cleanup(func() { netlink.LinkDel(link) })
	for _, n := range []string{name, name + "p"} {
		l, err := netlink.LinkByName(n)
		if err == nil {
			err = netlink.LinkSetUp(l)
		}
		if err != nil {
			t.Fatalf("set %s up: %v", n, err)
		}
	}
	return link
}

// waitHostPrefix waits until prefix is reserved:host in the ipcache table
// and in the ipcache map (identity 1), or, with want false, in neither.
func (a *agent) waitHostPrefix(t *testing.T, prefix string, want bool) {
	t.Helper()
	what := prefix + " reserved:host in the ipcache table and map"
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
				inTable = slices.Contains(r.Labels, "reserved:host") && r.Status.Kind == "Done"
				if !want {
					return false, fmt.Sprintf("still in the table: %+v", r)
				}
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
		return inTable && id == 1, fmt.Sprintf("table row found and host: %v; map identity %d (in map %v)", inTable, id, inMap)
	})
}
