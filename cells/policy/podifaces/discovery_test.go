package podifaces

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/internal/podnet"
	"github.com/apiary-net/apiary/tables"
)

// fakeFinder answers Find by the base name of the cgroup dir.
type fakeFinder map[string]fakeFound

type fakeFound struct {
	veths []podnet.HostVeth
	err   error
}

func (f fakeFinder) Find(dir string, _ []netip.Addr) ([]podnet.HostVeth, error) {
	r, ok := f[filepath.Base(dir)]
	if !ok {
		return nil, podnet.ErrNoProcess
	}
	return r.veths, r.err
}

// TestIfaceScanOwnership: an interface given to a pod stays its own when
// later scans find nothing, fail or find another candidate; it goes with
// the endpoint or the interface (gone from the host). An interface held by
// one pod is not given to another, which fails closed, as does a pod whose
// interface is not found; both are in the scan's fail-closed set.
func TestIfaceScanOwnership(t *testing.T) {
	db := statedb.New()
	endpoints, err := tables.NewEndpointsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	ifaces, err := tables.NewPodInterfacesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	root, err := cgroups.NewRoot(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	// lo exists on every host; gone0 on none.
	lo := podnet.HostVeth{Name: "lo", Ifindex: 1}
	gone := podnet.HostVeth{Name: "gone0", Ifindex: 1 << 30}
	finder := fakeFinder{}
	d := &Discovery{log: slog.New(slog.DiscardHandler), db: db, root: root,
		endpoints: endpoints, interfaces: ifaces, finder: finder}
	put := func(name string, cg uint64) {
		wtxn := db.WriteTxn(endpoints)
		endpoints.Insert(wtxn, &tables.Endpoint{Name: name, CgroupID: cg, Cgroup: name})
		wtxn.Commit()
	}
	rows := func() string {
		var out []string
		for r := range ifaces.All(db.ReadTxn()) {
			s := fmt.Sprintf("%s=%s/%d", r.Name, r.Interface, r.Ifindex)
			if r.FailClosed {
				s += " fail-closed"
			}
			out = append(out, s)
		}
		return strings.Join(out, ", ")
	}
	check := func(step, want string, failClosed int) {
		t.Helper()
		res := d.scan(true)
		if got := rows(); got != want || len(res.failClosed) != failClosed {
			t.Errorf("%s: rows %s (%d failing closed %v), want %s (%d)", step, got, len(res.failClosed), res.failClosed, want, failClosed)
		}
	}

	put("a", 100)
	put("b", 200)
	put("c", 300)
	finder["a"] = fakeFound{veths: []podnet.HostVeth{lo}}
	finder["b"] = fakeFound{veths: []podnet.HostVeth{lo}}
	finder["c"] = fakeFound{err: podnet.ErrNoVeth}
	check("first", "a=lo/1, b=/0 fail-closed, c=/0 fail-closed", 2)

	for _, f := range []fakeFound{
		{err: podnet.ErrNoVeth},
		{err: errors.New("netlink: boom")},
		{err: podnet.ErrHostNetwork},
		{veths: []podnet.HostVeth{{Name: "other", Ifindex: 2, CarriesAddr: true}}},
	} {
		finder["a"] = f
		check(fmt.Sprintf("a's namespaces say %+v", f), "a=lo/1, b=/0 fail-closed, c=/0 fail-closed", 2)
	}

	// a goes: b gets the interface it found.
	wtxn := db.WriteTxn(endpoints)
	endpoints.Delete(wtxn, &tables.Endpoint{Name: "a"})
	wtxn.Commit()
	check("a gone", "b=lo/1, c=/0 fail-closed", 1)

	// c's interface is given, then goes from the host.
	finder["c"] = fakeFound{veths: []podnet.HostVeth{gone}}
	check("c found", fmt.Sprintf("b=lo/1, c=gone0/%d", gone.Ifindex), 0)
	finder["c"] = fakeFound{err: podnet.ErrNoVeth}
	check("c's interface gone", "b=lo/1, c=/0 fail-closed", 1)
}
