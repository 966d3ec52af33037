package nodeport

import (
	"net"
	"runtime"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// TestFindDevicesFromRoutes: with --devices empty, the devices are those
// the main table's default routes go through, IPv4 and IPv6, each with its
// SNAT address; a device without a default route is not one. In a network
// namespace of the test's own.
func TestFindDevicesFromRoutes(t *testing.T) {
	testenv.RequireRoot(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	ns, err := netns.New() // and enters it, on this thread only
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		netns.Set(orig)
		ns.Close()
	}()

	link := func(name, cidr string) netlink.Link {
		t.Helper()
		// A veth (its peer left down): dummy devices need a module
		// the test machines may not have.
		l := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}
		if err := netlink.LinkAdd(l); err != nil {
			t.Fatal(err)
		}
		addr, err := netlink.ParseAddr(cidr)
		if err != nil {
			t.Fatal(err)
		}
		if err := netlink.AddrAdd(l, addr); err != nil {
			t.Fatal(err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
		return l
	}
	up4 := link("up4", "192.0.2.10/24")
	link("side", "198.51.100.1/24")
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: up4.Attrs().Index, Gw: net.ParseIP("192.0.2.1")}); err != nil {
		t.Fatal(err)
	}

	a := &attacher{cfg: defaultConfig}
	_, rows, err := a.findDevices()
	if err != nil {
		t.Fatal(err)
	}
	names := func(rows []*tables.NodePortDevice) []string {
		var out []string
		for _, r := range rows {
			out = append(out, r.Name+" "+r.SNATAddr.String())
		}
		slices.Sort(out)
		return out
	}
	if got, want := names(rows), []string{"up4 192.0.2.10"}; !slices.Equal(got, want) {
		t.Errorf("devices %v, want %v", got, want)
	}
	// A second default route (through another device) adds it; the
	// device-following loop compares these fingerprints.
	before := deviceFingerprint(rows)
	side, _ := netlink.LinkByName("side")
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: side.Attrs().Index, Gw: net.ParseIP("198.51.100.2"), Priority: 10}); err != nil {
		t.Fatal(err)
	}
	_, rows, err = a.findDevices()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := names(rows), []string{"side 198.51.100.1", "up4 192.0.2.10"}; !slices.Equal(got, want) {
		t.Errorf("devices %v, want %v", got, want)
	}
	if deviceFingerprint(rows) == before {
		t.Errorf("the fingerprint did not change with the devices")
	}
}
