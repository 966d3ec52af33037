package ct_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/spf13/pflag"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/ct"
	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

func TestMain(m *testing.M) {
	// Every hive is stopped and every GC job has returned by the end.
	goleak.VerifyTestMain(m)
}

// agent is a running hive with the ct cell and what a test needs of it.
type agent struct {
	h      *hive.Hive
	log    *slog.Logger
	db     *statedb.DB
	table  statedb.Table[*tables.CTMap]
	health statedb.Table[*tables.HealthStatus]
	maps   ct.Maps
	reg    *prometheus.Registry
}

// newHive builds a hive with the ct cell and the infrastructure it needs,
// pinning in pinDir, with the given flags.
func newHive(t *testing.T, pinDir string, flags ...string) (*agent, error) {
	t.Helper()
	a := &agent{log: hivetest.Logger(t, hivetest.LogLevel(slog.LevelInfo))}
	a.h = hive.NewWithOptions(core.HiveOptions(),
		statedb.Cell, health.Cell, job.Cell, metrics.Cell, bpffs.Cell, node.Cell,
		ct.Cell,
		cell.Invoke(func(db *statedb.DB, tbl statedb.Table[*tables.CTMap], h statedb.Table[*tables.HealthStatus],
			m ct.Maps, reg *prometheus.Registry) {
			a.db, a.table, a.health, a.maps, a.reg = db, tbl, h, m, reg
		}),
	)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	a.h.RegisterFlags(fs)
	defaults := []string{"--bpf-pin-dir=" + pinDir, "--state-dir=" + t.TempDir(), "--node-name=test-node", "--node-ips=192.0.2.1"}
	if err := fs.Parse(append(defaults, flags...)); err != nil {
		return nil, err
	}
	return a, a.h.Populate(a.log)
}

// startAgent starts a hive and waits until every map is reconciled.
func startAgent(t *testing.T, pinDir string, flags ...string) *agent {
	t.Helper()
	a, err := newHive(t, pinDir, flags...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.h.Start(a.log, ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.stop(t) })
	a.waitRows(t, "reconciled", func(rows []*tables.CTMap) bool {
		for _, r := range rows {
			if r.Status.Kind != reconciler.StatusKindDone {
				return false
			}
		}
		return len(rows) > 0
	})
	return a
}

func (a *agent) stop(t *testing.T) {
	if a.h == nil {
		return
	}
	if err := a.h.Stop(a.log, context.Background()); err != nil {
		t.Errorf("stop: %v", err)
	}
	a.h = nil
}

// waitRows waits until the ct-maps rows satisfy ok.
func (a *agent) waitRows(t *testing.T, what string, ok func([]*tables.CTMap) bool) map[string]*tables.CTMap {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		rows, watch := a.table.AllWatch(a.db.ReadTxn())
		all := statedb.Collect(rows)
		if ok(all) {
			byName := map[string]*tables.CTMap{}
			for _, r := range all {
				byName[r.Name] = r
			}
			return byName
		}
		select {
		case <-watch:
		case <-timeout:
			t.Fatalf("ct-maps not %s in time:\n%s", what, showRows(all))
		}
	}
}

func showRows(rows []*tables.CTMap) string {
	var b strings.Builder
	for _, r := range rows {
		fmt.Fprintf(&b, "%+v\n", *r)
	}
	return b.String()
}

// waitStartGC waits for the GC that runs at start, so that expired entries
// a test writes afterwards are not taken by it halfway.
func (a *agent) waitStartGC(t *testing.T) {
	t.Helper()
	a.waitRows(t, "collected at start", func(rows []*tables.CTMap) bool {
		for _, r := range rows {
			if r.LastGC.IsZero() {
				return false
			}
		}
		return true
	})
}

func (a *agent) rows(t *testing.T) map[string]*tables.CTMap {
	return a.waitRows(t, "readable", func([]*tables.CTMap) bool { return true })
}

// write puts entries into the named map as the datapath would.
func (a *agent) write(t *testing.T, name string, first, n int, lifetime int) {
	t.Helper()
	now, err := bpf.CTClockNow()
	if err != nil {
		t.Fatal(err)
	}
	err = a.maps.Use(name, func(m bpf.Map) error {
		for i := first; i < first+n; i++ {
			if err := m.Put(tuple(i), bpf.CTEntry{Lifetime: uint32(int(now) + lifetime), TxPackets: uint64(i)}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// keys returns the tuple numbers present in the named map.
func (a *agent) keys(t *testing.T, name string) map[int]bool {
	t.Helper()
	got := map[int]bool{}
	err := a.maps.Use(name, func(m bpf.Map) error {
		return bpf.WalkCT(m, 1024, func(keys []bpf.CTKey4, values []bpf.CTEntry) error {
			for i := range keys {
				got[int(values[i].TxPackets)] = true
			}
			return nil
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func tuple(i int) bpf.CTKey4 {
	return bpf.CTKey4{
		SAddr: [4]byte{10, 0, byte(i >> 8), byte(i)}, SPort: bpf.NewBe16(80),
		DAddr: [4]byte{10, 1, 0, 1}, DPort: bpf.NewBe16(uint16(20000 + i)),
		NextHdr: unix.IPPROTO_TCP,
	}
}

func (a *agent) gauge(t *testing.T, name, mapName string) float64 {
	t.Helper()
	families, err := a.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if mapName == "" || labelIs(m, "map", mapName) {
				switch {
				case m.Gauge != nil:
					return m.Gauge.GetValue()
				case m.Counter != nil:
					return m.Counter.GetValue()
				case m.Histogram != nil:
					return float64(m.Histogram.GetSampleCount())
				}
			}
		}
	}
	t.Fatalf("metric %s{map=%q} not found", name, mapName)
	return 0
}

func labelIs(m *dto.Metric, name, value string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == name && l.GetValue() == value {
			return true
		}
	}
	return false
}

// TestCellResizeKeepsConnections is the acceptance test: entries in
// ct4_global survive a restart that changes --bpf-ct-global-tcp-max, the
// new size is in place, and the next GC deletes the expired entries while
// the live ones stay.
func TestCellResizeKeepsConnections(t *testing.T) {
	dir := testenv.BPFPinDir(t)

	a := startAgent(t, dir, "--bpf-ct-global-tcp-max=4096", "--bpf-ct-global-any-max=2048")
	rows := a.rows(t)
	for name, want := range map[string]tables.CTMap{
		bpf.CT4GlobalMap:    {MaxEntries: 4096, ActualMaxEntries: 4096, SizedBy: "--bpf-ct-global-tcp-max", Pin: "created"},
		bpf.CTAny4GlobalMap: {MaxEntries: 2048, ActualMaxEntries: 2048, SizedBy: "--bpf-ct-global-any-max", Pin: "created"},
	} {
		r := rows[name]
		if r == nil || r.MaxEntries != want.MaxEntries || r.ActualMaxEntries != want.ActualMaxEntries ||
			r.SizedBy != want.SizedBy || r.Pin != want.Pin {
			t.Errorf("%s: %+v, want %+v", name, r, want)
		}
	}
	if len(rows) != 2 {
		t.Errorf("%d rows without --enable-ipv6, want 2", len(rows))
	}
	// 500 live connections and 200 that expired.
	a.waitStartGC(t)
	a.write(t, bpf.CT4GlobalMap, 0, 500, 3600)
	a.write(t, bpf.CT4GlobalMap, 500, 200, -30)
	a.stop(t)

	// Restart with a bigger TCP map and a GC every second.
	a = startAgent(t, dir, "--bpf-ct-global-tcp-max=8192", "--bpf-ct-global-any-max=2048", "--conntrack-gc-interval=1s")
	rows = a.rows(t)
	r := rows[bpf.CT4GlobalMap]
	if r.Pin != "replaced" || r.ActualMaxEntries != 8192 || r.Change != "max entries 4096 → 8192" ||
		r.Copied != 500 || r.Dropped != 0 || r.Expired != 200 {
		t.Errorf("ct4_global after resize: %+v", r)
	}
	if r := rows[bpf.CTAny4GlobalMap]; r.Pin != "reused" || r.ActualMaxEntries != 2048 {
		t.Errorf("ct_any4_global after restart: %+v", r)
	}
	if got := pinnedMaxEntries(t, dir, bpf.CT4GlobalMap); got != 8192 {
		t.Errorf("pinned ct4_global has %d max entries, want 8192", got)
	}
	keys := a.keys(t, bpf.CT4GlobalMap)
	for i := range 700 {
		if keys[i] != (i < 500) {
			t.Fatalf("entry %d present = %v after the resize", i, keys[i])
		}
	}

	// Connections that expire now are gone after the next GC; the live
	// ones stay.
	a.waitStartGC(t)
	a.write(t, bpf.CT4GlobalMap, 1000, 50, -5)
	before := time.Now()
	rows = a.waitRows(t, "collected", func(rows []*tables.CTMap) bool {
		for _, r := range rows {
			if r.LastGC.Before(before) {
				return false
			}
		}
		return true
	})
	if r := rows[bpf.CT4GlobalMap]; r.Entries != 500 || r.GCDeleted != 50 {
		t.Errorf("ct4_global after GC: entries %d, GC deleted %d; want 500, 50", r.Entries, r.GCDeleted)
	}
	keys = a.keys(t, bpf.CT4GlobalMap)
	if len(keys) != 500 {
		t.Errorf("%d entries after GC, want the 500 live ones", len(keys))
	}

	for _, c := range []struct {
		metric string
		want   float64
	}{
		{"apiary_ct_entries", 500},
		{"apiary_ct_max_entries", 8192},
		{"apiary_ct_map_pressure", 500.0 / 8192},
		{"apiary_ct_gc_last_deleted_entries", 50},
	} {
		if got := a.gauge(t, c.metric, bpf.CT4GlobalMap); got != c.want {
			t.Errorf("%s = %g, want %g", c.metric, got, c.want)
		}
	}
	if got := a.gauge(t, "apiary_ct_gc_deleted_entries_total", bpf.CT4GlobalMap); got < 50 {
		t.Errorf("apiary_ct_gc_deleted_entries_total = %g, want at least 50", got)
	}
	if got := a.gauge(t, "apiary_ct_gc_duration_seconds", bpf.CT4GlobalMap); got < 1 {
		t.Errorf("apiary_ct_gc_duration_seconds has %g samples", got)
	}
	if got := a.gauge(t, "apiary_ct_gc_interval_seconds", ""); got != 1 {
		t.Errorf("apiary_ct_gc_interval_seconds = %g, want 1", got)
	}
	if h, _, ok := a.health.Get(a.db.ReadTxn(), tables.HealthScopeIndex.Query("ct.job-gc")); !ok ||
		h.Level != cell.StatusOK || !strings.HasPrefix(h.Message, "Deleted ") {
		t.Errorf("GC health: %+v", h)
	}
}

// TestCellRestartReuses restarts with unchanged flags: the pins keep the
// very same maps.
func TestCellRestartReuses(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	flags := []string{"--bpf-ct-global-tcp-max=4096", "--bpf-ct-global-any-max=2048"}
	a := startAgent(t, dir, flags...)
	ids := map[string]ebpf.MapID{}
	for _, name := range bpf.CTMapNames(false) {
		ids[name] = pinnedID(t, dir, name)
	}
	a.write(t, bpf.CT4GlobalMap, 0, 10, 3600)
	a.stop(t)

	a = startAgent(t, dir, flags...)
	for name, r := range a.rows(t) {
		if r.Pin != "reused" || r.Change != "" || r.Copied != 0 {
			t.Errorf("%s after restart: %+v", name, r)
		}
		if id := pinnedID(t, dir, name); id != ids[name] {
			t.Errorf("%s: map ID %d after restart, want %d", name, id, ids[name])
		}
	}
	if got := len(a.keys(t, bpf.CT4GlobalMap)); got != 10 {
		t.Errorf("%d entries after restart, want 10", got)
	}
}

// TestCellIPv6AndRatio sizes the maps from memory with IPv6 on, then turns
// IPv6 off: its maps are unpinned.
func TestCellIPv6AndRatio(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	// A tiny ratio: every map gets its minimum.
	a := startAgent(t, dir, "--enable-ipv6", "--bpf-map-dynamic-size-ratio=0.00001")
	rows := a.rows(t)
	want := map[string]uint32{
		bpf.CT4GlobalMap: ct.MinDynamicTCPEntries, bpf.CT6GlobalMap: ct.MinDynamicTCPEntries,
		bpf.CTAny4GlobalMap: ct.MinDynamicAnyEntries, bpf.CTAny6GlobalMap: ct.MinDynamicAnyEntries,
	}
	if len(rows) != len(want) {
		t.Errorf("%d rows with --enable-ipv6, want 4", len(rows))
	}
	for name, size := range want {
		r := rows[name]
		if r == nil || r.MaxEntries != size || r.ActualMaxEntries != size || r.SizedBy != "--bpf-map-dynamic-size-ratio" {
			t.Errorf("%s: %+v, want %d entries sized by the ratio", name, r, size)
		}
		if got := pinnedMaxEntries(t, dir, name); got != size {
			t.Errorf("pinned %s has %d max entries, want %d", name, got, size)
		}
	}
	a.stop(t)

	a = startAgent(t, dir, "--bpf-map-dynamic-size-ratio=0.00001")
	if rows := a.rows(t); len(rows) != 2 {
		t.Errorf("%d rows without --enable-ipv6, want 2", len(rows))
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, name := range []string{bpf.CT6GlobalMap, bpf.CTAny6GlobalMap} {
		for {
			_, err := os.Stat(filepath.Join(dir, name))
			if errors.Is(err, fs.ErrNotExist) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s still pinned after IPv6 was disabled (stat: %v)", name, err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	for _, name := range bpf.CTMapNames(false) {
		if got := pinnedMaxEntries(t, dir, name); got != want[name] {
			t.Errorf("%s: %d max entries, want %d", name, got, want[name])
		}
	}
}

// TestCellBadFlags checks that an out-of-range flag stops the agent before
// it starts, naming the flag.
func TestCellBadFlags(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	cases := []struct {
		flags []string
		err   string
	}{
		{[]string{"--bpf-ct-global-tcp-max=100"}, "--bpf-ct-global-tcp-max=100 is out of range"},
		{[]string{"--bpf-ct-global-any-max=16777217"}, "--bpf-ct-global-any-max=16777217 is out of range"},
		{[]string{"--bpf-map-dynamic-size-ratio=2"}, "--bpf-map-dynamic-size-ratio=2 is out of range"},
		{[]string{"--conntrack-gc-interval=-1m"}, "--conntrack-gc-interval=-1m0s is out of range"},
	}
	for _, c := range cases {
		t.Run(c.flags[0], func(t *testing.T) {
			_, err := newHive(t, dir, c.flags...)
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("got %v, want an error containing %q", err, c.err)
			}
		})
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("a rejected configuration pinned %d maps", len(entries))
	}
}

func pinnedID(t *testing.T, dir, name string) ebpf.MapID {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return id
}

func pinnedMaxEntries(t *testing.T, dir, name string) uint32 {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	return m.MaxEntries()
}
