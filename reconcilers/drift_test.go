package reconcilers_test

import (
	"context"
	"log/slog"
	"maps"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// TestPolicyDriftRepaired corrupts the policy and policy_endpoints maps
// through a handle of their own, as bpftool or a stray older agent would,
// three ways each (an entry deleted, one rewritten, a stray added): the
// resync (Prune) repairs each, counts it by map and kind, and a map that
// drifts in three resyncs in a row makes Prune fail (health Degraded).
func TestPolicyDriftRepaired(t *testing.T) {
	f := newPolicyFixture(t, 1024)
	reg := prometheus.NewPedanticRegistry()
	drift, err := reconcilers.NewDrift(nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	f.ops.ResyncWith(drift)
	web := polEndpoint(1, 1001, tables.EnforceDefaultDeny, tables.EnforceDefaultDeny)
	db := polEndpoint(2, 1002, tables.EnforceDefaultDeny, tables.EnforceOff)
	entries := []*tables.PolicyEntry{polEntry(1, 256, tables.DirEgress, 5432), polEntry(1, 257, tables.DirIngress, 80), polEntry(2, 256, tables.DirIngress, 5432)}
	f.insert(t, web, db, entries[0], entries[1], entries[2])
	for _, name := range []string{web.Name, db.Name} {
		if err := f.updateEndpoint(t, name); err != nil {
			t.Fatal(err)
		}
	}
	wantPolicy, wantCgroups := f.policyMap(t), f.endpointsMap(t)
	u0, d0 := f.ops.Writes()
	f.prune(t)
	if u, d := f.ops.Writes(); u != u0 || d != d0 {
		t.Fatalf("a resync without drift wrote %d and deleted %d", u-u0, d-d0)
	}

	pol, eps := f.raw(t, bpf.PolicyMap), f.raw(t, bpf.PolicyEndpointsMap)
	k0, _ := reconcilers.PolicyKeyOf(entries[0])
	k1, v1 := reconcilers.PolicyKeyOf(entries[1])
	corrupt := func(round int) {
		t.Helper()
		bad := v1
		bad.Cookie = 0xdead + uint32(round)
		stray := bpf.NewPolicyKey(1, 999, bpf.PolicyEgress, 6, 22, 16)
		for _, err := range []error{
			pol.Delete(k0), pol.Put(k1, bad), pol.Put(stray, bpf.PolicyValue{PortPrefixLen: 24}),
			eps.Delete(uint64(1001)), eps.Put(uint64(1002), bpf.PolicyEndpointValue{EndpointID: 2}),
			eps.Put(uint64(4242), bpf.PolicyEndpointValue{EndpointID: 7, Flags: bpf.PolicyEnforceIngress}),
		} {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	for round := 1; round <= 3; round++ {
		corrupt(round)
		txn := f.db.ReadTxn()
		err := f.ops.Ops(f.entries).Prune(context.Background(), txn, f.endpoints.All(txn))
		if round < 3 && err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if round == 3 && (err == nil || !strings.Contains(err.Error(), "drifted in 3 resyncs in a row")) {
			t.Fatalf("round 3: %v; want the maps reported as drifting", err)
		}
		if got := f.policyMap(t); !maps.Equal(got, wantPolicy) {
			t.Fatalf("round %d: policy map %v, want %v", round, got, wantPolicy)
		}
		if got := f.endpointsMap(t); !maps.Equal(got, wantCgroups) {
			t.Fatalf("round %d: policy_endpoints %v, want %v", round, got, wantCgroups)
		}
		for _, m := range []string{bpf.PolicyMap, bpf.PolicyEndpointsMap} {
			for _, kind := range []string{reconcilers.DriftMissing, reconcilers.DriftChanged, reconcilers.DriftStray} {
				var metric dto.Metric
				if err := drift.Counter().WithLabelValues(m, kind).Write(&metric); err != nil {
					t.Fatal(err)
				}
				if n := metric.GetCounter().GetValue(); n != float64(round) {
					t.Errorf("round %d: drift %s %s counted %v, want %d", round, m, kind, n, round)
				}
			}
		}
	}
	// A resync that finds nothing ends the streak.
	txn := f.db.ReadTxn()
	if err := f.ops.Ops(f.entries).Prune(context.Background(), txn, f.endpoints.All(txn)); err != nil {
		t.Fatalf("a resync without drift: %v", err)
	}
}

// driftCount reads apiary_bpf_map_drift_repaired_total{map,kind}.
func driftCount(t *testing.T, d *reconcilers.Drift, mapName, kind string) float64 {
	t.Helper()
	var metric dto.Metric
	if err := d.Counter().WithLabelValues(mapName, kind).Write(&metric); err != nil {
		t.Fatal(err)
	}
	return metric.GetCounter().GetValue()
}

// TestIPCacheDriftRepaired corrupts the ipcache map, and the policy
// prefixes map its operations also keep, through a handle of its own three
// ways (a prefix deleted, one given another identity, a stray prefix
// added): the resync (Prune) repairs each, counts it under the map's name,
// writes nothing when nothing drifted, and three drifting resyncs in a row
// make Prune fail (health Degraded).
func TestIPCacheDriftRepaired(t *testing.T) {
	for _, tc := range []struct {
		name string
		ops  func(*slog.Logger) *reconcilers.IPCache
	}{
		{bpf.IPCacheMap, reconcilers.NewIPCache},
		{bpf.PolicyPrefixesMap, reconcilers.NewPolicyPrefixes},
	} {
		t.Run(tc.name, func(t *testing.T) { testPrefixMapDrift(t, tc.name, tc.ops(nil)) })
	}
}

func testPrefixMapDrift(t *testing.T, name string, c *reconcilers.IPCache) {
	dir := testenv.BPFPinDir(t)
	ctx := context.Background()
	if _, err := c.Open(dir, 1024); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	drift, err := reconcilers.NewDrift(nil, prometheus.NewPedanticRegistry())
	if err != nil {
		t.Fatal(err)
	}
	c.ResyncWith(drift)
	rows := []*tables.IPCacheEntry{ipcEntry("10.0.0.0/8", 100), ipcEntry("10.1.2.3/32", 101), ipcEntry("fd00::/64", 102)}
	for _, e := range rows {
		if err := c.Update(ctx, nil, 0, e); err != nil {
			t.Fatal(err)
		}
	}
	all := func(yield func(*tables.IPCacheEntry, statedb.Revision) bool) {
		for _, e := range rows {
			if !yield(e, 1) {
				return
			}
		}
	}
	want := mapEntries(t, c)
	u0, d0 := c.Writes()
	if err := c.Prune(ctx, nil, all); err != nil {
		t.Fatal(err)
	}
	if u, d := c.Writes(); u != u0 || d != d0 {
		t.Fatalf("a resync without drift wrote %d and deleted %d", u-u0, d-d0)
	}

	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	for round := 1; round <= 3; round++ {
		for _, err := range []error{
			m.Delete(bpf.NewIPCacheKey(netip.MustParsePrefix("10.0.0.0/8"))),
			m.Put(bpf.NewIPCacheKey(netip.MustParsePrefix("fd00::/64")), bpf.IPCacheValue{Identity: 2}),
			m.Put(bpf.NewIPCacheKey(netip.MustParsePrefix("0.0.0.0/0")), bpf.IPCacheValue{Identity: 1}),
		} {
			if err != nil {
				t.Fatal(err)
			}
		}
		err := c.Prune(ctx, nil, all)
		if round < 3 && err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if round == 3 && (err == nil || !strings.Contains(err.Error(), "map "+name+" drifted in 3 resyncs in a row")) {
			t.Fatalf("round 3: %v; want the map reported as drifting", err)
		}
		if got := mapEntries(t, c); !maps.Equal(got, want) {
			t.Fatalf("round %d: map %v, want %v", round, got, want)
		}
		for _, kind := range []string{reconcilers.DriftMissing, reconcilers.DriftChanged, reconcilers.DriftStray} {
			if n := driftCount(t, drift, name, kind); n != float64(round) {
				t.Errorf("round %d: drift %s counted %v, want %d", round, kind, n, round)
			}
		}
	}
	if err := c.Prune(ctx, nil, all); err != nil {
		t.Fatalf("a resync without drift: %v", err)
	}
}
