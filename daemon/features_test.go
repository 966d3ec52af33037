package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/link"
	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/miekg/dns"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/bpf/policyprog"
	"github.com/apiary-net/apiary/bpf/socklb"
	"github.com/apiary-net/apiary/cells/api"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/internal/testenv"
)

// TestEveryFeatureRuns builds the agent's own composition (agentCells, with
// the fake Kubernetes client) with every feature switched on, populates and
// starts it as `apiary agent` does — not through ScriptCommands, which would
// build every object a script command asks for and so hide a feature the
// agent never constructs — and checks through the HTTP API, the kernel and
// the outside programs that each feature actually runs.
func TestEveryFeatureRuns(t *testing.T) {
	pinDir := testenv.BPFPinDir(t)
	cgroup := testenv.Cgroup(t)
	hostLocal := testenv.RequireProgram(t, "host-local", "/usr/lib/cni", "/opt/cni/bin")
	upstream := startUpstream(t, "192.0.2.77")

	stateDir, configDir, cniDir := t.TempDir(), t.TempDir(), t.TempDir()
	for _, name := range []string{"namespace.yaml", "policy.yaml", "web-service.yaml"} {
		copyFile(t, filepath.Join("..", "docs", "examples", name), filepath.Join(configDir, name))
	}
	writeFile(t, filepath.Join(configDir, "fqdn.yaml"), `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: to-example, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toFQDNs:
    - matchPattern: "*.example.com"
`)
	binDir := filepath.Join(cniDir, "bin")
	if err := os.Mkdir(binDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(hostLocal, filepath.Join(binDir, "host-local")); err != nil {
		t.Fatal(err)
	}
	conflist := filepath.Join(cniDir, "10-test.conflist")
	writeFile(t, conflist, fmt.Sprintf(`{"cniVersion": "1.0.0", "name": "features-test",
  "plugins": [{"type": "ptp", "ipam": {"type": "host-local", "dataDir": %q,
    "ranges": [[{"subnet": "10.99.0.0/24"}]]}}]}`, filepath.Join(cniDir, "data")))

	// What the test reads the agent through: the API server, which the
	// agent builds anyway. Nothing else is requested here.
	var server *api.Server
	cells := append(agentCells(k8sfake.Cell), cell.Invoke(func(s *api.Server) { server = s }))
	h := hive.NewWithOptions(core.HiveOptions(), cells...)
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	if err := fs.Parse([]string{
		"--api-addr=127.0.0.1:0",
		"--bpf-pin-dir=" + pinDir,
		"--state-dir=" + stateDir,
		"--config-dir=" + configDir,
		"--node-name=test-node",
		"--dns-proxy-addr=127.0.0.1:0",
		"--dns-upstream=" + upstream,
		"--enable-socket-lb",
		"--cgroup-root=" + cgroup,
		"--ipam=delegated-plugin",
		"--cni-conf-file=" + conflist,
		"--cni-bin-dir=" + binDir,
		"--enable-health-ip",
	}); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelWarn))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := h.Start(log, ctx); err != nil {
		t.Fatalf("start: %s", err)
	}
	t.Cleanup(func() {
		if err := h.Stop(log, context.Background()); err != nil {
			t.Errorf("stop: %s", err)
		}
	})
	base := "http://" + server.Addr().String()

	t.Run("DNS proxy answers and labels the name", func(t *testing.T) {
		msg := waitRow(t, base, "health", `"fqdn.proxy"`, "Listening on")
		m := regexp.MustCompile(`Listening on (\S+)`).FindStringSubmatch(msg)
		if m == nil {
			t.Fatalf("the proxy's health names no address: %s", msg)
		}
		// An answer is labelled only for the selectors the proxy knows:
		// the policy must have been read first, and its selector handed to
		// the proxy, which its job reports after the selectors table has
		// the row.
		waitRow(t, base, "selectors", `"fqdn:*.example.com"`)
		waitRow(t, base, "health", `"fqdn.job-selectors"`, "1 FQDN selectors")
		q := new(dns.Msg).SetQuestion("api.example.com.", dns.TypeA)
		for _, proto := range []string{"udp", "tcp"} {
			resp, _, err := (&dns.Client{Net: proto, Timeout: 5 * time.Second}).Exchange(q, m[1])
			if err != nil {
				t.Fatalf("query the proxy over %s: %s", proto, err)
			}
			if len(resp.Answer) != 1 || !strings.Contains(resp.Answer[0].String(), "192.0.2.77") {
				t.Fatalf("the proxy answered over %s: %v", proto, resp.Answer)
			}
		}
		waitRow(t, base, "fqdn-names", "api.example.com", "192.0.2.77")
	})
	t.Run("reconcilers wrote the maps", func(t *testing.T) {
		waitRow(t, base, "frontends", "10.96.", `"Done"`)
		waitRow(t, base, "ct-maps", "ct4_global", `"Done"`)
		waitRow(t, base, "ipcache", "192.0.2.0/24", `"Done"`)
		for _, m := range []string{"lb4_services", "lb4_backends", "lb4_reverse_nat", "ipcache", "ct4_global", "ct_any4_global"} {
			if _, err := os.Stat(filepath.Join(pinDir, m)); err != nil {
				t.Errorf("map %s is not pinned: %s", m, err)
			}
		}
	})
	t.Run("socket LB programs are attached", func(t *testing.T) {
		testenv.Eventually(t, 30*time.Second, "a program on every socket LB hook of "+cgroup, func() (bool, string) {
			f, err := os.Open(cgroup)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			for _, hook := range socklb.Hooks {
				res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: hook.Attach})
				if err != nil {
					return false, fmt.Sprintf("query %s: %s", hook.Name, err)
				}
				if len(res.Programs) == 0 {
					return false, hook.Name + " has no program"
				}
			}
			return true, ""
		})
	})
	t.Run("policy programs are attached and the policy maps pinned", func(t *testing.T) {
		waitRow(t, base, "health", `"policy.job-attach"`, "Enforcing policy on cgroup")
		f, err := os.Open(cgroup)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		for _, hook := range policyprog.Hooks {
			res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: hook.Attach})
			if err != nil || len(res.Programs) == 0 {
				t.Errorf("%s: no program attached (%v)", hook.Name, err)
			}
		}
		for _, m := range []string{"policy", "policy_endpoints", "policy_sk", "policy_stats"} {
			if _, err := os.Stat(filepath.Join(pinDir, m)); err != nil {
				t.Errorf("map %s is not pinned: %s", m, err)
			}
		}
	})
	t.Run("IPAM asked the plugin", func(t *testing.T) {
		waitRow(t, base, "agent-ips", `"health"`, "10.99.0.")
	})
}

// startUpstream serves A records with addr for every name on a loopback UDP
// and TCP port, and returns host:port.
func startUpstream(t *testing.T, addr string) string {
	t.Helper()
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
		resp := new(dns.Msg).SetReply(req)
		rr, err := dns.NewRR(req.Question[0].Name + " 60 IN A " + addr)
		if err == nil && req.Question[0].Qtype == dns.TypeA {
			resp.Answer = append(resp.Answer, rr)
		}
		w.WriteMsg(resp)
	})
	// The TCP port must be the UDP one, which something else may hold:
	// try other ports until both are free.
	var pc net.PacketConn
	var ln net.Listener
	for attempt := 0; ln == nil; attempt++ {
		var err error
		if pc, err = net.ListenPacket("udp", "127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		if ln, err = net.Listen("tcp", pc.LocalAddr().String()); err != nil {
			pc.Close()
			if attempt == 20 {
				t.Fatal(err)
			}
		}
	}
	for _, srv := range []*dns.Server{{PacketConn: pc, Handler: handler}, {Listener: ln, Handler: handler}} {
		go srv.ActivateAndServe()
		t.Cleanup(func() { srv.Shutdown() })
	}
	return pc.LocalAddr().String()
}

// waitRow waits until an object of the table, as the HTTP API dumps it,
// contains every one of parts, and returns that object's JSON.
func waitRow(t *testing.T, base, table string, parts ...string) string {
	t.Helper()
	var found string
	testenv.Eventually(t, 30*time.Second, fmt.Sprintf("a row of %s with %q", table, parts), func() (bool, string) {
		resp, err := http.Get(base + "/statedb/dump/" + table)
		if err != nil {
			return false, err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		var rows map[string][]json.RawMessage
		if err := json.Unmarshal(body, &rows); err != nil {
			return false, string(body)
		}
	next:
		for _, row := range rows[table] {
			for _, p := range parts {
				if !strings.Contains(string(row), p) {
					continue next
				}
			}
			found = string(row)
			return true, ""
		}
		return false, string(body)
	})
	return found
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	data, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, to, string(data))
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}
