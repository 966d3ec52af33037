package reconcilers

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// lbHarness drives an LB on real pinned maps, frontend by frontend.
type lbHarness struct {
	t        *testing.T
	pinDir   string
	db       *statedb.DB
	backends statedb.Table[*tables.Backend]
	lb       *LB
}

func newLBHarness(t *testing.T) *lbHarness {
	testenv.RequireRoot(t)
	h := &lbHarness{t: t, pinDir: testenv.BPFPinDir(t), db: statedb.New()}
	backends, err := tables.NewBackendsTable(h.db)
	if err != nil {
		t.Fatal(err)
	}
	h.backends = backends
	h.reopen()
	return h
}

// reopen starts over with a new LB on the same pins, as a restarted agent.
func (h *lbHarness) reopen() {
	if h.lb != nil {
		h.lb.Close()
	}
	h.lb = NewLB(slog.New(slog.DiscardHandler), LBConfig{PinDir: h.pinDir, MaxEntries: 1024, MaxEntriesFlag: "bpf-lb-map-max"}, h.backends)
	h.t.Cleanup(func() { h.lb.Close() })
}

func (h *lbHarness) update(fs ...*tables.Frontend) {
	h.t.Helper()
	batch := make([]reconciler.BatchEntry[*tables.Frontend], len(fs))
	for i, f := range fs {
		batch[i].Object = f
	}
	h.lb.UpdateBatch(context.Background(), h.db.ReadTxn(), batch)
	for _, b := range batch {
		if b.Result != nil {
			h.t.Fatalf("update %s: %v", b.Object.Address, b.Result)
		}
	}
}

func (h *lbHarness) prune(fs ...*tables.Frontend) {
	h.t.Helper()
	desired := func(yield func(*tables.Frontend, statedb.Revision) bool) {
		for _, f := range fs {
			if !yield(f, 0) {
				return
			}
		}
	}
	if err := h.lb.Prune(context.Background(), h.db.ReadTxn(), desired); err != nil {
		h.t.Fatal(err)
	}
}

func (h *lbHarness) dump() string {
	h.t.Helper()
	var out strings.Builder
	if err := h.lb.Maps(func(m LBMaps) error { return WriteLBMaps(&out, m) }); err != nil {
		h.t.Fatal(err)
	}
	return out.String()
}

func (h *lbHarness) wantDump(want ...string) {
	h.t.Helper()
	if got := h.dump(); got != strings.Join(want, "\n")+"\n" {
		h.t.Fatalf("maps:\n%s\nwant:\n%s", got, strings.Join(want, "\n"))
	}
}

func l4(s string) tables.L4Addr {
	a, err := tables.ParseL4Addr(s)
	if err != nil {
		panic(err)
	}
	return a
}

func frontend(addr string, typ tables.FrontendType, affinity uint32, backends ...string) *tables.Frontend {
	f := &tables.Frontend{Address: l4(addr), Type: typ, SessionAffinity: affinity}
	for _, b := range backends {
		f.Backends = append(f.Backends, tables.FrontendBackend{Address: l4(b)})
	}
	return f
}

// TestLBFamilies puts IPv4 and IPv6 frontends and session affinity through
// the maps: one ID space for both families, a wildcard entry per cluster
// IP, O(1) backend removal in IPv6 too, affinity matches only for the
// active backends of affinity frontends, and a restart that writes
// nothing.
func TestLBFamilies(t *testing.T) {
	h := newLBHarness(t)
	web4 := frontend("10.96.0.10:80/TCP", tables.FrontendClusterIP, 30, "10.1.0.1:8080/TCP", "10.1.0.2:8080/TCP")
	web6 := frontend("[fd00::10]:80/TCP", tables.FrontendClusterIP, 0, "[fd01::1]:8080/TCP", "[fd01::2]:8080/TCP", "[fd01::3]:8080/TCP")
	h.update(web4, web6)
	h.wantDump(
		"SVC 10.96.0.10:0/ANY SLOT=0 ID=0 COUNT=0 QCOUNT=0 FLAGS=ClusterIP",
		"SVC 10.96.0.10:80/TCP SLOT=0 ID=1 COUNT=2 QCOUNT=0 AFFINITY=30 FLAGS=ClusterIP+sessionAffinity",
		"SVC 10.96.0.10:80/TCP SLOT=1 ID=1 BEID=1",
		"SVC 10.96.0.10:80/TCP SLOT=2 ID=1 BEID=2",
		"SVC [fd00::10]:0/ANY SLOT=0 ID=0 COUNT=0 QCOUNT=0 FLAGS=ClusterIP",
		"SVC [fd00::10]:80/TCP SLOT=0 ID=2 COUNT=3 QCOUNT=0 FLAGS=ClusterIP",
		"SVC [fd00::10]:80/TCP SLOT=1 ID=2 BEID=3",
		"SVC [fd00::10]:80/TCP SLOT=2 ID=2 BEID=4",
		"SVC [fd00::10]:80/TCP SLOT=3 ID=2 BEID=5",
		"BE ID=1 ADDR=10.1.0.1:8080/TCP STATE=active",
		"BE ID=2 ADDR=10.1.0.2:8080/TCP STATE=active",
		"BE ID=3 ADDR=[fd01::1]:8080/TCP STATE=active",
		"BE ID=4 ADDR=[fd01::2]:8080/TCP STATE=active",
		"BE ID=5 ADDR=[fd01::3]:8080/TCP STATE=active",
		"REV ID=1 ADDR=10.96.0.10:80",
		"REV ID=2 ADDR=[fd00::10]:80",
		"MATCH ID=1 BEID=1",
		"MATCH ID=1 BEID=2",
	)
	if web4.ID != 1 || web6.ID != 2 {
		t.Errorf("IDs %d, %d: want 1, 2", web4.ID, web6.ID)
	}

	// Removing the first IPv6 backend moves the last one into its slot:
	// four operations, as for IPv4.
	before := opCounts(h.lb)
	smaller6 := web6.Clone()
	smaller6.Backends = web6.Backends[1:]
	h.update(smaller6)
	if n := opCounts(h.lb) - before; n != 4 {
		t.Errorf("removing one IPv6 backend of 3 took %d map operations, want 4", n)
	}

	// Removing an affinity backend also deletes its match, and a backend
	// that turns terminating loses it too (affinity keeps to active ones).
	smaller4 := web4.Clone()
	smaller4.Backends = []tables.FrontendBackend{
		web4.Backends[0],
		{Address: l4("10.1.0.3:8080/TCP"), State: tables.BackendTerminating},
	}
	h.update(smaller4)
	h.wantDump(
		"SVC 10.96.0.10:0/ANY SLOT=0 ID=0 COUNT=0 QCOUNT=0 FLAGS=ClusterIP",
		"SVC 10.96.0.10:80/TCP SLOT=0 ID=1 COUNT=1 QCOUNT=1 AFFINITY=30 FLAGS=ClusterIP+sessionAffinity",
		"SVC 10.96.0.10:80/TCP SLOT=1 ID=1 BEID=1",
		"SVC 10.96.0.10:80/TCP SLOT=2 ID=1 BEID=6",
		"SVC [fd00::10]:0/ANY SLOT=0 ID=0 COUNT=0 QCOUNT=0 FLAGS=ClusterIP",
		"SVC [fd00::10]:80/TCP SLOT=0 ID=2 COUNT=2 QCOUNT=0 FLAGS=ClusterIP",
		"SVC [fd00::10]:80/TCP SLOT=1 ID=2 BEID=5",
		"SVC [fd00::10]:80/TCP SLOT=2 ID=2 BEID=4",
		"BE ID=1 ADDR=10.1.0.1:8080/TCP STATE=active",
		"BE ID=4 ADDR=[fd01::2]:8080/TCP STATE=active",
		"BE ID=5 ADDR=[fd01::3]:8080/TCP STATE=active",
		"BE ID=6 ADDR=10.1.0.3:8080/TCP STATE=terminating",
		"REV ID=1 ADDR=10.96.0.10:80",
		"REV ID=2 ADDR=[fd00::10]:80",
		"MATCH ID=1 BEID=1",
	)
	settled := h.dump()

	// A restarted agent restores both families, the IDs and the matches,
	// and writes nothing for the same frontends.
	h.reopen()
	h.update(smaller4, smaller6)
	h.prune(smaller4, smaller6)
	if n := opCounts(h.lb); n != 0 {
		t.Errorf("%d map operations after a restart with the same frontends, want 0", n)
	}
	if got := h.dump(); got != settled {
		t.Errorf("restart changed the maps:\n%s\nwant:\n%s", got, settled)
	}

	// Turning affinity off drops the matches; the IPv6 frontend's prune
	// removes all it had.
	noAffinity := smaller4.Clone()
	noAffinity.SessionAffinity = 0
	h.update(noAffinity)
	h.prune(noAffinity)
	h.wantDump(
		"SVC 10.96.0.10:0/ANY SLOT=0 ID=0 COUNT=0 QCOUNT=0 FLAGS=ClusterIP",
		"SVC 10.96.0.10:80/TCP SLOT=0 ID=1 COUNT=1 QCOUNT=1 FLAGS=ClusterIP",
		"SVC 10.96.0.10:80/TCP SLOT=1 ID=1 BEID=1",
		"SVC 10.96.0.10:80/TCP SLOT=2 ID=1 BEID=6",
		"BE ID=1 ADDR=10.1.0.1:8080/TCP STATE=active",
		"BE ID=6 ADDR=10.1.0.3:8080/TCP STATE=terminating",
		"REV ID=1 ADDR=10.96.0.10:80",
	)
}

// TestLBStrayAcrossFamilies leaves entries a crash or another agent could
// leave: an IPv6 backend under an ID an IPv4 backend has, a reverse NAT
// entry of the wrong family, a match of a gone service. The restart's
// prune deletes them and keeps the rest.
func TestLBStrayAcrossFamilies(t *testing.T) {
	h := newLBHarness(t)
	web4 := frontend("10.96.0.10:80/TCP", tables.FrontendClusterIP, 10, "10.1.0.1:8080/TCP")
	h.update(web4)
	want := h.dump()
	err := h.lb.Maps(func(m LBMaps) error {
		return errors.Join(
			m.Backends6.Put(uint32(1), bpf.LB6BackendValue{Address: netip.MustParseAddr("fd01::9").As16(), Port: bpf.NewBe16(1), Proto: 6}),
			m.RevNat6.Put(bpf.NewBe16(1), bpf.LB6RevNatValue{Address: netip.MustParseAddr("fd00::9").As16(), Port: bpf.NewBe16(1)}),
			m.AffinityMatch.Put(bpf.LBAffinityMatchKey{BackendID: 1, RevNat: bpf.NewBe16(7)}, uint8(0)),
		)
	})
	if err != nil {
		t.Fatal(err)
	}
	h.reopen()
	h.update(web4)
	h.prune(web4)
	if got := h.dump(); got != want {
		t.Fatalf("after prune:\n%s\nwant:\n%s", got, want)
	}
	if got := []uint64{h.lb.Ops.Get(bpf.LB6BackendsMap, true), h.lb.Ops.Get(bpf.LB6RevNatMap, true), h.lb.Ops.Get(bpf.LBAffinityMatchMap, true)}; !slices.Equal(got, []uint64{1, 1, 1}) {
		t.Errorf("stray deletes (lb6_backends, lb6_reverse_nat, lb_affinity_match) = %v, want one each", got)
	}
}

// TestLBWildcard: a cluster IP has one wildcard entry however many ports
// it serves, kept while any of them is there and deleted with the last; other frontend
// types get none; a restart's prune keeps the wildcard of a desired
// frontend not updated yet.
func TestLBWildcard(t *testing.T) {
	h := newLBHarness(t)
	http := frontend("10.96.0.20:80/TCP", tables.FrontendClusterIP, 0, "10.1.0.1:80/TCP")
	https := frontend("10.96.0.20:443/TCP", tables.FrontendClusterIP, 0, "10.1.0.1:443/TCP")
	external := frontend("192.0.2.20:80/TCP", tables.FrontendExternalIP, 0, "10.1.0.1:80/TCP")
	h.update(http, https, external)
	wildcards := func() (n int) {
		for _, line := range strings.Split(h.dump(), "\n") {
			if strings.Contains(line, ":0/ANY ") {
				n++
			}
		}
		return n
	}
	if n := wildcards(); n != 1 {
		t.Fatalf("%d wildcard entries, want 1 (the cluster IP's):\n%s", n, h.dump())
	}
	if !strings.Contains(h.dump(), "SVC 10.96.0.20:0/ANY SLOT=0 ID=0 COUNT=0 QCOUNT=0 FLAGS=ClusterIP\n") {
		t.Fatalf("no wildcard of the cluster IP:\n%s", h.dump())
	}

	// One port goes and another comes: the wildcard stays.
	alt := frontend("10.96.0.20:8080/TCP", tables.FrontendClusterIP, 0, "10.1.0.1:80/TCP")
	batch := []reconciler.BatchEntry[*tables.Frontend]{{Object: http}}
	h.lb.DeleteBatch(context.Background(), h.db.ReadTxn(), batch)
	h.update(alt)
	if n := wildcards(); n != 1 {
		t.Fatalf("%d wildcard entries after swapping a port, want 1", n)
	}

	// A restarted agent whose prune comes before the updates keeps it.
	h.reopen()
	h.prune(https, alt, external)
	h.update(https, alt, external)
	if n := opCounts(h.lb); n != 0 {
		t.Errorf("%d map operations after a restart, want 0", n)
	}

	// The last port of the address takes the wildcard with it.
	h.prune(external)
	if n := wildcards(); n != 0 {
		t.Fatalf("%d wildcard entries after the cluster IP's frontends went, want 0:\n%s", n, h.dump())
	}
}

// TestLBListWithoutIPv6Pins: `apiary bpf lb list` on the pin directory of
// an agent that made no lb6 maps (an older version) lists the IPv4 maps.
func TestLBListWithoutIPv6Pins(t *testing.T) {
	h := newLBHarness(t)
	h.update(frontend("10.96.0.30:80/TCP", tables.FrontendExternalIP, 0, "10.1.0.1:80/TCP"))
	h.lb.Close()
	for _, name := range []string{bpf.LB6ServicesMap, bpf.LB6BackendsMap, bpf.LB6RevNatMap, bpf.LBAffinityMatchMap} {
		if err := os.Remove(filepath.Join(h.pinDir, name)); err != nil {
			t.Fatal(err)
		}
	}
	var out strings.Builder
	if err := WritePinnedLB(&out, h.pinDir); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "SVC 10.96.0.30:80/TCP SLOT=1 ID=1 BEID=1\n") {
		t.Errorf("apiary bpf lb list without the lb6 pins:\n%s", out.String())
	}
}

// TestLBRefusedRows: rows the datapath could not serve fail with a reason
// and write nothing: a port-0 row (the wildcard is the reconciler's own)
// and a backend of the other family.
func TestLBRefusedRows(t *testing.T) {
	h := newLBHarness(t)
	for _, tc := range []struct {
		f    *tables.Frontend
		want string
	}{
		{frontend("10.96.0.40:0/ANY", tables.FrontendClusterIP, 0), "port 0 is the address's wildcard entry"},
		{frontend("10.96.0.41:80/TCP", tables.FrontendClusterIP, 0, "[fd01::1]:80/TCP"), "backend [fd01::1]:80/TCP is of the other address family"},
	} {
		err := h.lb.Update(context.Background(), h.db.ReadTxn(), 0, tc.f)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("update %s: %v, want an error saying %q", tc.f.Address, err, tc.want)
		}
	}
	if dump := h.dump(); dump != "" {
		t.Errorf("refused rows wrote entries:\n%s", dump)
	}
}
