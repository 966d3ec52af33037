package ipam_test

import (
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"go.uber.org/goleak"

	"github.com/apiary-net/apiary/tables"
)

func TestMain(m *testing.M) {
	if runAsAgent() {
		return
	}
	// Every hive is stopped and every job has returned by the end.
	goleak.VerifyTestMain(m)
}

const (
	health  = tables.AgentIPKindHealth
	ingress = tables.AgentIPKindIngress
)

// TestAllocateRestartRelease walks through the life of the agent's IPs with
// the real host-local plugin: the first start allocates both, a restart
// keeps them (CHECK), disabling a kind hands its lease back, and turning
// IPAM off hands back the rest.
func TestAllocateRestartRelease(t *testing.T) {
	e := newEnv(t)
	e.writeConflist(t, "1.0.0", e.hostLocalIPAM("logged-host-local", "10.20.0.0/24"))

	// First start: DEL (nothing to release) then ADD for each kind.
	a := startAgent(t, e.flags(true, true))
	rows := a.waitReady(health, ingress)
	first := map[string]string{}
	for kind, r := range rows {
		first[kind] = r.IP.String()
		if r.Action != "allocated" || r.Owner != "ipam/"+kind || r.ContainerID != "apiary-"+kind ||
			r.Network != testNetwork || r.Plugin != "logged-host-local" || !slices.Equal(r.Labels, []string{"reserved:" + kind}) {
			t.Errorf("row %s: %+v", kind, r)
		}
	}
	if first[health] == first[ingress] {
		t.Fatalf("both kinds got %s", first[health])
	}
	wantLeases(t, e, rows)
	if got, want := e.calls(t), []string{"DEL apiary-health", "ADD apiary-health", "DEL apiary-ingress", "ADD apiary-ingress"}; !slices.Equal(got, want) {
		t.Errorf("plugin calls %q, want %q", got, want)
	}
	a.waitHealth("OK", func(s *tables.HealthStatus) bool {
		return s.Level == cell.StatusOK && strings.Contains(s.Message, "health "+first[health]) && strings.Contains(s.Message, "ingress "+first[ingress])
	})
	a.stop()

	// Restart: CHECK confirms both recorded IPs; nothing is allocated.
	a = startAgent(t, e.flags(true, true))
	rows = a.waitReady(health, ingress)
	for kind, r := range rows {
		if r.IP.String() != first[kind] || r.Action != "checked" {
			t.Errorf("after restart %s: %s (%s), want %s (checked)", kind, r.IP, r.Action, first[kind])
		}
	}
	wantLeases(t, e, rows)
	if got, want := e.calls(t), []string{"CHECK apiary-health", "CHECK apiary-ingress"}; !slices.Equal(got, want) {
		t.Errorf("plugin calls %q, want %q", got, want)
	}
	a.stop()

	// A lease the plugin lost (here: its file removed) fails CHECK and is
	// replaced; the agent does not keep an IP the plugin no longer holds.
	if err := os.Remove(filepath.Join(e.dataDir, testNetwork, first[ingress])); err != nil {
		t.Fatal(err)
	}
	a = startAgent(t, e.flags(true, true))
	rows = a.waitReady(health, ingress)
	if rows[ingress].Action != "allocated" || rows[health].Action != "checked" || rows[health].IP.String() != first[health] {
		t.Errorf("after a lost lease: %s", formatRows(rows))
	}
	wantLeases(t, e, rows)
	if got, want := e.calls(t), []string{"CHECK apiary-health", "CHECK apiary-ingress", "DEL apiary-ingress", "ADD apiary-ingress"}; !slices.Equal(got, want) {
		t.Errorf("plugin calls %q, want %q", got, want)
	}
	a.stop()

	// Ingress disabled: its lease is handed back, its row and record go.
	a = startAgent(t, e.flags(true, false))
	rows = a.waitRows("ingress released", func(rows map[string]*tables.AgentIP) bool {
		return len(rows) == 1 && rows[health] != nil && rows[health].Ready()
	})
	wantLeases(t, e, rows)
	if e.record(t, ingress).IsValid() {
		t.Error("the ingress record survived its release")
	}
	a.waitHealth("OK", func(s *tables.HealthStatus) bool { return s.Level == cell.StatusOK })
	a.stop()

	// IPAM off: the health lease goes too, although the conflist is gone.
	if err := os.Remove(e.confFile); err != nil {
		t.Fatal(err)
	}
	a = startAgent(t, []string{"--node-name=n", "--state-dir=" + e.stateDir, "--cni-bin-dir=" + e.binDir})
	a.waitHealth("OK", func(s *tables.HealthStatus) bool { return s.Level == cell.StatusOK })
	if rows := a.rows(); len(rows) != 0 {
		t.Errorf("rows left with IPAM off:\n%s", formatRows(rows))
	}
	if leases := e.leases(t); len(leases) != 0 {
		t.Errorf("leases left with IPAM off: %v", leases)
	}
}

// TestOldCNIVersionSkipsCheck: a network older than 0.4.0 has no CHECK, so
// a restart releases and allocates again, still holding one lease per kind.
func TestOldCNIVersionSkipsCheck(t *testing.T) {
	e := newEnv(t)
	e.writeConflist(t, "0.3.1", e.hostLocalIPAM("logged-host-local", "10.21.0.0/24"))
	for i := range 2 {
		a := startAgent(t, e.flags(true, true))
		rows := a.waitReady(health, ingress)
		wantLeases(t, e, rows)
		a.stop()
		if got, want := e.calls(t), []string{"DEL apiary-health", "ADD apiary-health", "DEL apiary-ingress", "ADD apiary-ingress"}; !slices.Equal(got, want) {
			t.Errorf("start %d: plugin calls %q, want %q", i, got, want)
		}
	}
}

// TestNetworkChange: a record of another network (the conflist changed) is
// released through that network before the new one allocates.
func TestNetworkChange(t *testing.T) {
	e := newEnv(t)
	e.writeConflist(t, "1.0.0", e.hostLocalIPAM("logged-host-local", "10.22.0.0/24"))
	a := startAgent(t, e.flags(true, false))
	a.waitReady(health)
	a.stop()
	e.calls(t)

	e.writeConflist(t, "1.0.0", e.hostLocalIPAM("logged-host-local", "10.23.0.0/24"))
	a = startAgent(t, e.flags(true, false))
	rows := a.waitReady(health)
	if !strings.HasPrefix(rows[health].IP.String(), "10.23.0.") {
		t.Errorf("health IP %s, want one of the new range", rows[health].IP)
	}
	wantLeases(t, e, rows)
	// DEL through the old configuration, then DEL and ADD through the new.
	if got, want := e.calls(t), []string{"DEL apiary-health", "DEL apiary-health", "ADD apiary-health"}; !slices.Equal(got, want) {
		t.Errorf("plugin calls %q, want %q", got, want)
	}
}

// TestDualStack: with --enable-ipv6 each kind gets an IPv4 and an IPv6
// address from one lease; a record from before IPv6 was on is replaced.
func TestDualStack(t *testing.T) {
	e := newEnv(t)
	e.writeConflist(t, "1.0.0", e.hostLocalIPAM("host-local", "10.28.0.0/24", "fd00:28::/120"))
	a := startAgent(t, e.flags(true, false))
	v4only := a.waitReady(health)[health]
	if v4only.IPv6.IsValid() {
		t.Errorf("IPv6 %s without --enable-ipv6", v4only.IPv6)
	}
	a.stop()

	a = startAgent(t, e.flags(true, true, "--enable-ipv6"))
	rows := a.waitReady(health, ingress)
	for kind, r := range rows {
		if !r.IP.Is4() || !r.IPv6.Is6() || !strings.HasPrefix(r.IPv6.String(), "fd00:28::") || r.Action != "allocated" {
			t.Errorf("%s: %s", kind, strings.Join(r.TableRow(), " | "))
		}
	}
	// host-local keeps one lease file per address.
	if leases := e.leases(t); len(leases) != 4 {
		t.Errorf("leases %v, want 4 (two addresses for each of two kinds)", leases)
	}
	a.stop()

	a = startAgent(t, e.flags(true, true, "--enable-ipv6"))
	for kind, r := range a.waitReady(health, ingress) {
		if r.Action != "checked" || r.IPv6 != rows[kind].IPv6 || r.IP != rows[kind].IP {
			t.Errorf("after restart %s: %s", kind, strings.Join(r.TableRow(), " | "))
		}
	}
}

// TestConflistAppearsLater: without the conflist the row and health say so,
// the agent keeps running, and the IPs come as soon as it is installed.
func TestConflistAppearsLater(t *testing.T) {
	e := newEnv(t)
	a := startAgent(t, e.flags(true, true))
	rows := a.waitRows("errors", func(rows map[string]*tables.AgentIP) bool {
		return len(rows) == 2 && rows[health].Status == tables.AgentIPError && rows[ingress].Status == tables.AgentIPError
	})
	if !strings.Contains(rows[health].Error, e.confFile+" does not exist") {
		t.Errorf("health row error %q", rows[health].Error)
	}
	s := a.waitHealth("degraded", func(s *tables.HealthStatus) bool { return s.Level == cell.StatusDegraded })
	if !strings.Contains(s.Error, "does not exist") || !strings.Contains(s.Message, "health, ingress") {
		t.Errorf("health: %+v", s)
	}

	e.writeConflist(t, "1.0.0", e.hostLocalIPAM("host-local", "10.24.0.0/24"))
	rows = a.waitReady(health, ingress)
	wantLeases(t, e, rows)
	a.waitHealth("OK", func(s *tables.HealthStatus) bool { return s.Level == cell.StatusOK })
}

// TestFailures: each failure shows on the row and in health, is retried,
// leaves no lease behind, and the agent keeps running.
func TestFailures(t *testing.T) {
	for _, tc := range []struct {
		name string
		// conf writes the conflist (nil: none); kinds are enabled.
		conf  func(t *testing.T, e *env)
		kinds []string
		// wantErr must appear in the error of the failing kinds' rows.
		wantErr string
		failing []string
	}{{
		name:    "missing plugin",
		conf:    func(t *testing.T, e *env) { e.writeConflist(t, "1.0.0", map[string]any{"type": "no-such-ipam"}) },
		kinds:   []string{health},
		wantErr: `IPAM plugin "no-such-ipam" not found in --cni-bin-dir`,
		failing: []string{health},
	}, {
		name:    "plugin error result",
		conf:    func(t *testing.T, e *env) { e.writeConflist(t, "1.0.0", map[string]any{"type": "fake-ipam"}) },
		kinds:   []string{health, ingress},
		wantErr: "fake-ipam ADD: fake-ipam: upstream address pool exhausted; ask again later",
		failing: []string{health, ingress},
	}, {
		name: "plugin prints garbage",
		conf: func(t *testing.T, e *env) {
			e.writeConflist(t, "1.0.0", map[string]any{"type": "fake-ipam", "mode": "garbage"})
		},
		kinds:   []string{ingress},
		wantErr: "fake-ipam ADD:",
		failing: []string{ingress},
	}, {
		name: "plugin crashes",
		conf: func(t *testing.T, e *env) {
			e.writeConflist(t, "1.0.0", map[string]any{"type": "fake-ipam", "mode": "crash"})
		},
		kinds:   []string{health},
		wantErr: "exit status 2: fake-ipam: segmentation fault (pretend)",
		failing: []string{health},
	}, {
		name: "no IPv4 address",
		conf: func(t *testing.T, e *env) {
			e.writeConflist(t, "1.0.0", e.hostLocalIPAM("host-local", "fd00:20::/120"))
		},
		kinds:   []string{health},
		wantErr: "the plugin's result has no IPv4 address (only [fd00:20::",
		failing: []string{health},
	}, {
		name: "range exhausted",
		conf: func(t *testing.T, e *env) {
			e.writeConflist(t, "1.0.0", e.hostLocalIPAM("host-local", "10.25.0.0/24@10.25.0.10-10.25.0.10"))
		},
		kinds:   []string{health, ingress},
		wantErr: "no IP addresses available in range set: 10.25.0.10-10.25.0.10",
		failing: []string{ingress},
	}, {
		name: "conflist not JSON",
		conf: func(t *testing.T, e *env) {
			if err := os.WriteFile(e.confFile, []byte("{ \"cniVersion\": "), 0o644); err != nil {
				t.Fatal(err)
			}
		},
		kinds:   []string{health},
		wantErr: "not a JSON object",
		failing: []string{health},
	}, {
		name: "conflist unreadable",
		conf: func(t *testing.T, e *env) {
			if err := os.Mkdir(e.confFile, 0o755); err != nil { // a directory cannot be read as a file
				t.Fatal(err)
			}
		},
		kinds:   []string{health},
		wantErr: "read CNI configuration:",
		failing: []string{health},
	}, {
		name: "no ipam section",
		conf: func(t *testing.T, e *env) {
			conf := `{"cniVersion":"1.0.0","name":"apiary-test","plugins":[{"type":"bridge"},{"type":"portmap"}]}`
			if err := os.WriteFile(e.confFile, []byte(conf), 0o644); err != nil {
				t.Fatal(err)
			}
		},
		kinds:   []string{health},
		wantErr: `no plugin of network "apiary-test" has an ipam section with a type`,
		failing: []string{health},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each waits for a retry
			e := newEnv(t)
			if tc.conf != nil {
				tc.conf(t, e)
			}
			a := startAgent(t, e.flags(slices.Contains(tc.kinds, health), slices.Contains(tc.kinds, ingress)))
			rows := a.waitRows("the failure", func(rows map[string]*tables.AgentIP) bool {
				for _, k := range tc.failing {
					if r := rows[k]; r == nil || r.Status != tables.AgentIPError || r.Attempts < 2 {
						return false // wait for a retry too
					}
				}
				return true
			})
			for _, k := range tc.failing {
				if !strings.Contains(rows[k].Error, tc.wantErr) {
					t.Errorf("%s row error %q, want it to contain %q", k, rows[k].Error, tc.wantErr)
				}
				if rows[k].IP.IsValid() || e.record(t, k).IsValid() {
					t.Errorf("%s: failed kind has IP %s / record %s", k, rows[k].IP, e.record(t, k))
				}
			}
			s := a.ipamHealth()
			if s.Level != cell.StatusDegraded || !strings.Contains(s.Error, tc.wantErr) {
				t.Errorf("ipam health %+v, want degraded with %q", s, tc.wantErr)
			}
			// Only the kinds that succeeded hold leases.
			ready := map[string]*tables.AgentIP{}
			for k, r := range rows {
				if r.Ready() {
					ready[k] = r
				}
			}
			if len(ready)+len(tc.failing) != len(tc.kinds) {
				t.Errorf("rows: %s", formatRows(rows))
			}
			wantLeases(t, e, ready)
		})
	}
}

// TestUnreadableRecordOfDisabledKind: a record that cannot be read cannot
// be released; the row and health say so and the other kind is unaffected.
func TestUnreadableRecordOfDisabledKind(t *testing.T) {
	e := newEnv(t)
	e.writeConflist(t, "1.0.0", e.hostLocalIPAM("host-local", "10.29.0.0/24"))
	if err := os.MkdirAll(filepath.Join(e.stateDir, "ipam"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(e.stateDir, "ipam", "ingress.json"), []byte(`{"kind":"ingr`), 0o600); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, e.flags(true, false))
	rows := a.waitRows("health ready, ingress failing", func(rows map[string]*tables.AgentIP) bool {
		return rows[health] != nil && rows[health].Ready() && rows[ingress] != nil && rows[ingress].Error != ""
	})
	if r := rows[ingress]; r.Status != tables.AgentIPReleasing || !strings.Contains(r.Error, "release the lease of container ID apiary-ingress by hand") {
		t.Errorf("ingress row: %s", strings.Join(r.TableRow(), " | "))
	}
	a.waitHealth("degraded", func(s *tables.HealthStatus) bool {
		return s.Level == cell.StatusDegraded && strings.Contains(s.Message, "ingress")
	})
}

// TestRecoversWhenPluginInstalled: a missing plugin binary is retried, and
// the IP comes once the plugin is installed.
func TestRecoversWhenPluginInstalled(t *testing.T) {
	e := newEnv(t)
	e.writeConflist(t, "1.0.0", e.hostLocalIPAM("late-host-local", "10.26.0.0/24"))
	a := startAgent(t, e.flags(true, false))
	a.waitRows("the failure", func(rows map[string]*tables.AgentIP) bool {
		return rows[health] != nil && rows[health].Status == tables.AgentIPError
	})
	target, err := os.Readlink(filepath.Join(e.binDir, "host-local"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, filepath.Join(e.binDir, "late-host-local")); err != nil {
		t.Fatal(err)
	}
	rows := a.waitReady(health)
	wantLeases(t, e, rows)
}

// TestWaitsForLock: while another process holds the IPAM lock (another
// agent, or a plugin a killed agent started), the agent waits and says so.
func TestWaitsForLock(t *testing.T) {
	e := newEnv(t)
	e.writeConflist(t, "1.0.0", e.hostLocalIPAM("host-local", "10.27.0.0/24"))
	if err := os.MkdirAll(filepath.Join(e.stateDir, "ipam"), 0o750); err != nil {
		t.Fatal(err)
	}
	release := holdLock(t, filepath.Join(e.stateDir, "ipam", ".lock"))
	a := startAgent(t, e.flags(true, false))
	a.waitHealth("waiting", func(s *tables.HealthStatus) bool {
		return s.Level == cell.StatusDegraded && strings.Contains(s.Message, "Waiting for the IPAM lock")
	})
	if leases := e.leases(t); len(leases) != 0 {
		t.Fatalf("leases taken without the lock: %v", leases)
	}
	release()
	wantLeases(t, e, a.waitReady(health))
}

// TestBadFlags: flags that cannot work stop the agent before it starts,
// naming the flag.
func TestBadFlags(t *testing.T) {
	for _, tc := range []struct {
		flags []string
		want  string
	}{
		{[]string{"--ipam=cluster-pool"}, `--ipam="cluster-pool"`},
		{[]string{"--enable-health-ip"}, "--enable-health-ip needs --ipam=delegated-plugin"},
		{[]string{"--ipam=none", "--enable-ingress-ip"}, "--enable-ingress-ip needs --ipam=delegated-plugin"},
		{[]string{"--ipam=delegated-plugin", "--enable-health-ip"}, "--ipam=delegated-plugin needs --cni-conf-file"},
		{[]string{"--cni-bin-dir="}, "--cni-bin-dir is empty"},
	} {
		t.Run(strings.Join(tc.flags, " "), func(t *testing.T) {
			log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelError))
			h, err := newHive(log, append([]string{"--node-name=n", "--state-dir=" + t.TempDir()}, tc.flags...))
			if err != nil {
				t.Fatal(err)
			}
			err = h.Populate(log)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("populate: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
