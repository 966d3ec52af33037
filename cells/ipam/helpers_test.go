package ipam_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/cells/core"
	healthcell "github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/ipam"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// agentCells are the cells of a hive running the ipam cell: the
// infrastructure it needs and nothing else.
func agentCells(extra ...cell.Cell) []cell.Cell {
	return append([]cell.Cell{statedb.Cell, healthcell.Cell, job.Cell, node.Cell, ipam.Cell}, extra...)
}

// newHive builds (without starting) a hive with the ipam cell and the
// given flags.
func newHive(log *slog.Logger, flags []string, extra ...cell.Cell) (*hive.Hive, error) {
	h := hive.NewWithOptions(core.HiveOptions(), agentCells(extra...)...)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	if err := fs.Parse(flags); err != nil {
		return nil, err
	}
	return h, nil
}

// env is one test's CNI setup: a bin dir with host-local (and the testdata
// plugins), a conflist path, host-local's data dir, and the agent's state dir.
type env struct {
	binDir   string
	confFile string
	dataDir  string
	stateDir string
}

const testNetwork = "apiary-test"

// newEnv prepares the directories; it skips (or fails under
// APIARY_STRICT=1) without host-local.
func newEnv(t testing.TB) *env {
	t.Helper()
	hostLocal := testenv.RequireProgram(t, "host-local", "/usr/lib/cni", "/opt/cni/bin")
	e := &env{
		binDir:   filepath.Join(t.TempDir(), "bin"),
		confFile: filepath.Join(t.TempDir(), "10-apiary.conflist"),
		dataDir:  filepath.Join(t.TempDir(), "cni-data"),
		stateDir: t.TempDir(),
	}
	if err := os.Mkdir(e.binDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(hostLocal, filepath.Join(e.binDir, "host-local")); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"fake-ipam", "logged-host-local"} {
		data, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(e.binDir, name), data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

// flags returns the agent's flags for this environment with the given kinds
// enabled, plus extra flags.
func (e *env) flags(health, ingress bool, extra ...string) []string {
	return append([]string{
		"--node-name=test-node",
		"--state-dir=" + e.stateDir,
		"--ipam=delegated-plugin",
		"--cni-conf-file=" + e.confFile,
		"--cni-bin-dir=" + e.binDir,
		fmt.Sprintf("--enable-health-ip=%t", health),
		fmt.Sprintf("--enable-ingress-ip=%t", ingress),
	}, extra...)
}

// writeConflist writes a conflist whose second plugin delegates to ipam
// (the first has no ipam section, which the agent must skip).
func (e *env) writeConflist(t testing.TB, cniVersion string, ipamConf map[string]any) {
	t.Helper()
	conf := map[string]any{
		"cniVersion": cniVersion,
		"name":       testNetwork,
		"plugins": []any{
			map[string]any{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}},
			map[string]any{"type": "ptp", "ipam": ipamConf},
			map[string]any{"type": "bandwidth", "ipam": map[string]any{"type": "not-this-one"}},
		},
	}
	data, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	// Written whole and renamed, as a CNI installer would.
	tmp := e.confFile + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, e.confFile); err != nil {
		t.Fatal(err)
	}
}

// hostLocalIPAM returns host-local's ipam section with the given ranges
// (subnet or subnet@start-end).
func (e *env) hostLocalIPAM(pluginType string, subnets ...string) map[string]any {
	var ranges []any
	for _, s := range subnets {
		r := map[string]string{"subnet": s}
		if subnet, span, ok := strings.Cut(s, "@"); ok {
			start, end, _ := strings.Cut(span, "-")
			r = map[string]string{"subnet": subnet, "rangeStart": start, "rangeEnd": end}
		}
		ranges = append(ranges, []any{r})
	}
	return map[string]any{"type": pluginType, "dataDir": e.dataDir, "ranges": ranges}
}

// leases returns host-local's leases of the test network: IP → container ID.
func (e *env) leases(t testing.TB) map[netip.Addr]string {
	t.Helper()
	dir := filepath.Join(e.dataDir, testNetwork)
	entries, err := os.ReadDir(dir)
	if os.IsNotExist(err) {
		return map[netip.Addr]string{}
	}
	if err != nil {
		t.Fatal(err)
	}
	leases := map[netip.Addr]string{}
	for _, ent := range entries {
		ip, err := netip.ParseAddr(ent.Name())
		if err != nil {
			continue // lock, last_reserved_ip.0
		}
		data, err := os.ReadFile(filepath.Join(dir, ent.Name()))
		if os.IsNotExist(err) {
			// A plugin call that outlived its killed agent released
			// this lease between the listing and the read.
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		id, _, _ := strings.Cut(string(data), "\r\n")
		leases[ip] = strings.TrimSpace(id)
	}
	return leases
}

// calls returns the plugin calls logged by logged-host-local and forgets
// them.
func (e *env) calls(t testing.TB) []string {
	t.Helper()
	path := filepath.Join(e.binDir, "calls.log")
	data, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(path)
	return strings.Split(strings.TrimSpace(string(data)), "\n")
}

// record returns the IP in the kind's record, invalid if there is none.
func (e *env) record(t testing.TB, kind string) netip.Addr {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(e.stateDir, "ipam", kind+".json"))
	if os.IsNotExist(err) {
		return netip.Addr{}
	}
	if err != nil {
		t.Fatal(err)
	}
	var rec struct {
		IP netip.Addr `json:"ip"`
	}
	if err := json.Unmarshal(data, &rec); err != nil {
		t.Fatalf("record %s: %s", kind, err)
	}
	return rec.IP
}

// agent is a running hive with the ipam cell.
type agent struct {
	t      testing.TB
	h      *hive.Hive
	log    *slog.Logger
	db     *statedb.DB
	table  statedb.Table[*tables.AgentIP]
	health statedb.Table[*tables.HealthStatus]
	stop   func()
}

// startAgent starts a hive with the given flags; it is stopped at the end
// of the test or by a.stop().
func startAgent(t testing.TB, flags []string) *agent {
	t.Helper()
	a := &agent{t: t, log: hivetest.Logger(t, hivetest.LogLevel(slog.LevelInfo))}
	h, err := newHive(a.log, flags, cell.Invoke(func(db *statedb.DB, tbl statedb.Table[*tables.AgentIP], hs statedb.Table[*tables.HealthStatus]) {
		a.db, a.table, a.health = db, tbl, hs
	}))
	if err != nil {
		t.Fatal(err)
	}
	a.h = h
	if err := h.Start(a.log, context.Background()); err != nil {
		t.Fatalf("start: %s", err)
	}
	stopped := false
	a.stop = func() {
		if !stopped {
			stopped = true
			if err := h.Stop(a.log, context.Background()); err != nil {
				t.Errorf("stop: %s", err)
			}
		}
	}
	t.Cleanup(a.stop)
	return a
}

// rows returns the agent-ips rows by kind.
func (a *agent) rows() map[string]*tables.AgentIP {
	rows := map[string]*tables.AgentIP{}
	for row := range a.table.All(a.db.ReadTxn()) {
		rows[row.Kind] = row
	}
	return rows
}

// waitRows waits until cond holds for the rows, and returns them.
func (a *agent) waitRows(what string, cond func(map[string]*tables.AgentIP) bool) map[string]*tables.AgentIP {
	a.t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		_, watch := a.table.AllWatch(a.db.ReadTxn())
		rows := a.rows()
		if cond(rows) {
			return rows
		}
		select {
		case <-watch:
		case <-deadline:
			a.t.Fatalf("timed out waiting for %s; rows:\n%s", what, formatRows(rows))
		}
	}
}

// waitReady waits until exactly the given kinds have rows, all ready.
func (a *agent) waitReady(kinds ...string) map[string]*tables.AgentIP {
	a.t.Helper()
	return a.waitRows("ready rows for "+strings.Join(kinds, ", "), func(rows map[string]*tables.AgentIP) bool {
		if len(rows) != len(kinds) {
			return false
		}
		for _, k := range kinds {
			if r, ok := rows[k]; !ok || !r.Ready() {
				return false
			}
		}
		return true
	})
}

// ipamHealth returns the ipam module's health.
func (a *agent) ipamHealth() *tables.HealthStatus {
	s, _, found := a.health.Get(a.db.ReadTxn(), tables.HealthScopeIndex.Query("ipam"))
	if !found {
		return nil
	}
	return s
}

// waitHealth waits until the ipam module's health satisfies cond.
func (a *agent) waitHealth(what string, cond func(*tables.HealthStatus) bool) *tables.HealthStatus {
	a.t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		_, watch := a.health.AllWatch(a.db.ReadTxn())
		if s := a.ipamHealth(); s != nil && cond(s) {
			return s
		}
		select {
		case <-watch:
		case <-deadline:
			a.t.Fatalf("timed out waiting for ipam health %s; have %+v", what, a.ipamHealth())
		}
	}
}

func formatRows(rows map[string]*tables.AgentIP) string {
	var out []string
	for _, r := range rows {
		out = append(out, strings.Join(r.TableRow(), " | "))
	}
	slices.Sort(out)
	return strings.Join(out, "\n")
}

// wantLeases checks that host-local holds exactly the ready rows' IPs, each
// under its kind's container ID, and that the records name the same IPs.
func wantLeases(t testing.TB, e *env, rows map[string]*tables.AgentIP) {
	t.Helper()
	want := map[netip.Addr]string{}
	for _, r := range rows {
		want[r.IP] = r.ContainerID
		if rec := e.record(t, r.Kind); rec != r.IP {
			t.Errorf("record of %s names %s, the row %s", r.Kind, rec, r.IP)
		}
	}
	got := e.leases(t)
	if len(got) != len(want) {
		t.Fatalf("host-local holds %d leases %v, want %d %v", len(got), got, len(want), want)
	}
	for ip, id := range want {
		if got[ip] != id {
			t.Errorf("lease of %s: %q, want %q (all: %v)", ip, got[ip], id, got)
		}
	}
}
