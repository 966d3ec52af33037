package ipcache

import (
	"log/slog"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/tables"
)

// TestNodeAddrsApply: the node's addresses as interfaces gain and lose
// them (issue 35 item 6): a global unicast address is labelled
// reserved:host when an interface gains it and unlabelled only when the
// last interface holding it loses it; loopback and link-local addresses
// are not the node's, nor IPv6 ones without --enable-ipv6; the addresses
// found at start are unlabelled when they go.
func TestNodeAddrsApply(t *testing.T) {
	db := statedb.New()
	table, err := tables.NewPrefixesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	ipc, err := tables.NewIPCacheTable(db)
	if err != nil {
		t.Fatal(err)
	}
	p := newPrefixes(db, table, ipc)
	start := netip.MustParseAddr("192.0.2.1")
	a := newNodeAddrs(slog.New(slog.DiscardHandler), p, node.Config{NodeIPs: []netip.Addr{start}})
	if _, err := p.Update(Upsert(tables.HostPrefix(start), OwnerNode, tables.LabelHost)); err != nil {
		t.Fatal(err)
	}
	hosts := func() []string {
		var out []string
		for row := range table.All(db.ReadTxn()) {
			if row.Owner == OwnerNode && slices.Contains(row.Labels, tables.LabelHost) {
				out = append(out, row.Prefix.String())
			}
		}
		slices.Sort(out)
		return out
	}
	step := func(what, addr string, ifindex int, added bool, want ...string) {
		t.Helper()
		if err := a.apply(netip.MustParseAddr(addr), ifindex, added); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got := hosts(); !slices.Equal(got, want) {
			t.Errorf("%s: reserved:host prefixes %v, want %v", what, got, want)
		}
	}
	step("the start address held", "192.0.2.1", 2, true, "192.0.2.1/32")
	step("a bridge gateway added", "10.244.0.1", 5, true, "10.244.0.1/32", "192.0.2.1/32")
	step("the same address on a second interface", "10.244.0.1", 6, true, "10.244.0.1/32", "192.0.2.1/32")
	step("gone from one of the two", "10.244.0.1", 5, false, "10.244.0.1/32", "192.0.2.1/32")
	step("gone from the last", "10.244.0.1", 6, false, "192.0.2.1/32")
	step("loopback", "127.0.0.53", 1, true, "192.0.2.1/32")
	step("link-local", "169.254.1.1", 5, true, "192.0.2.1/32")
	step("IPv6 without --enable-ipv6", "2001:db8::1", 5, true, "192.0.2.1/32")
	step("the start address removed", "192.0.2.1", 2, false)

	a.ipv6 = true
	step("IPv6 with --enable-ipv6", "2001:db8::1", 5, true, "2001:db8::1/128")
	step("IPv6 link-local", "fe80::1", 5, true, "2001:db8::1/128")
	step("IPv6 removed", "2001:db8::1", 5, false)
}
