package e2e

import (
	"encoding/json"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// examplesDir is docs/examples, the config dir `make run` uses.
func examplesDir(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join(repoRoot, "docs", "examples"))
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

type healthRow struct {
	Scope   string `json:"scope"`
	Level   string `json:"level"`
	Message string `json:"message"`
}

// TestCLI: the apiary CLI against a running agent configured only through
// APIARY_ environment variables, with docs/examples as its config dir:
// `db tables`, `db show health -o json` and `bpf lb list`, given --server
// and --bpf-pin-dir, and given nothing but the agent's own variables.
func TestCLI(t *testing.T) {
	t.Parallel()
	a := startAgent(t, agentOptions{configDir: examplesDir(t), viaEnv: true})

	// `apiary db tables`: every table of the agent, with object counts.
	testenv.Eventually(t, waitTimeout, "apiary db tables", func() (bool, string) {
		out, err := a.db("tables")
		if err != nil {
			return false, err.Error()
		}
		counts := map[string]int{}
		for i, line := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(line)
			if i == 0 {
				if len(f) < 2 || f[0] != "Name" || f[1] != "Objects" {
					t.Fatalf("apiary db tables: header %q, want Name Objects ...", line)
				}
				continue
			}
			if len(f) < 2 {
				t.Fatalf("apiary db tables: line %q", line)
			}
			n, err := strconv.Atoi(f[1])
			if err != nil {
				t.Fatalf("apiary db tables: line %q: %v", line, err)
			}
			counts[f[0]] = n
		}
		for _, table := range []string{"agent-ips", "backends", "ct-maps", "endpoints", "fqdn-names", "frontends",
			"health", "identities", "ipcache", "policies", "prefixes", "selectors", "services",
			"policy-entries", "endpoint-policy", "policy-status"} {
			if _, ok := counts[table]; !ok {
				t.Fatalf("apiary db tables lacks %s:\n%s", table, out)
			}
		}
		// docs/examples: one Service with one frontend and two backends,
		// two policies (with their status rows), two conntrack maps.
		return counts["services"] == 1 && counts["frontends"] == 1 && counts["backends"] == 2 &&
			counts["policies"] == 2 && counts["policy-status"] == 2 && counts["ct-maps"] == 2, out
	})

	// `apiary db show health -o json`: the modules' scopes, none degraded.
	health := func(env []string, args ...string) []healthRow {
		t.Helper()
		out, err := runApiary(env, append([]string{"db", "show", "health", "-o", "json"}, args...)...)
		if err != nil {
			t.Fatal(err)
		}
		var rows []healthRow
		if err := json.Unmarshal([]byte(out), &rows); err != nil {
			t.Fatalf("apiary db show health -o json: %v:\n%s", err, out)
		}
		return rows
	}
	rows := health(nil, "--server", "http://"+a.addr)
	scopes := map[string]healthRow{}
	for _, r := range rows {
		scopes[r.Scope] = r
		if r.Level != "OK" && r.Level != "Unknown" {
			t.Errorf("health scope %s is %s: %s", r.Scope, r.Level, r.Message)
		}
	}
	if got, want := scopes["api"].Message, "Listening on "+a.addr; got != want {
		t.Errorf("health scope api says %q, want %q", got, want)
	}
	for _, scope := range []string{"ct", "lb", "ipcache", "selectors", "fqdn", "k8s-sources"} {
		if _, ok := scopes[scope]; !ok {
			t.Errorf("apiary db show health has no scope %s: %v", scope, slices.Sorted(maps.Keys(scopes)))
		}
	}

	// `apiary bpf lb list`: the example Service in the maps.
	wantLB := []string{
		"BE 127.0.0.11:8080/TCP active",
		"BE 127.0.0.12:8080/TCP active",
		"FE 10.96.0.10:80/TCP count=2 qcount=0 flags=ClusterIP backends=127.0.0.11:8080/TCP,127.0.0.12:8080/TCP",
		"REV 10.96.0.10:80",
		"WILDCARD 10.96.0.10",
	}
	a.waitLB(t, "docs/examples", []string{
		"10.96.0.10:80/TCP default/web 127.0.0.11:8080/TCP/active,127.0.0.12:8080/TCP/active Done",
	}, wantLB)

	// The agent's own variables tell the CLI where it is: APIARY_API_ADDR
	// (db) and APIARY_BPF_PIN_DIR (bpf), with no --server or --bpf-pin-dir.
	env := []string{"APIARY_API_ADDR=" + a.addr, "APIARY_BPF_PIN_DIR=" + a.pinDir}
	// (The api scope names the address: this is our agent, not one that
	// happens to listen on the default address.)
	found := false
	for _, r := range health(env) {
		if r.Scope == "api" {
			found = true
			if r.Message != scopes["api"].Message {
				t.Errorf("with APIARY_API_ADDR=%s and no --server, the CLI read an agent whose api scope says %q", a.addr, r.Message)
			}
		}
	}
	if !found {
		t.Errorf("with APIARY_API_ADDR=%s and no --server, apiary db show health has no api scope", a.addr)
	}
	out, err := runApiary(env, "db", "tables")
	if err != nil {
		t.Errorf("with APIARY_API_ADDR=%s and no --server: %v", a.addr, err)
	} else if !strings.Contains(out, "frontends") {
		t.Errorf("with APIARY_API_ADDR=%s, apiary db tables:\n%s", a.addr, out)
	}
	out, err = runApiary(env, "bpf", "lb", "list")
	if err != nil {
		t.Fatalf("with APIARY_BPF_PIN_DIR=%s and no --bpf-pin-dir: %v", a.pinDir, err)
	}
	if got := strings.Count(out, "\n"); got != 7 {
		t.Errorf("with APIARY_BPF_PIN_DIR, apiary bpf lb list has %d lines, want 7 (4 SVC with the wildcard, 2 BE, 1 REV):\n%s", got, out)
	}
	// --server wins over the variable.
	if _, err := runApiary([]string{"APIARY_API_ADDR=127.0.0.1:1"}, "db", "tables", "--server", "http://"+a.addr); err != nil {
		t.Errorf("--server with a wrong APIARY_API_ADDR: %v", err)
	}
}
