package e2e

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// cpuShare samples the agent's CPU time (utime + stime) over d and returns
// it as a fraction of one core.
func (a *agent) cpuShare(t *testing.T, d time.Duration) float64 {
	t.Helper()
	before, err := readProcStats(a.pid())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	time.Sleep(d)
	after, err := readProcStats(a.pid())
	if err != nil {
		t.Fatal(err)
	}
	return float64(after.cpuTicks-before.cpuTicks) / clockTicks / time.Since(start).Seconds()
}

// waitStartupDone waits until the work an agent does once after it starts
// is over: the ipcache initialized, the load-balancing state restored, and
// the first conntrack GC run. /healthz turns 200 before that: with
// conntrack maps sized from the node's memory (300,000 entries on a 24 GB
// machine) the first half second after it costs 0.1-0.2 s of CPU, and next
// to none with small --bpf-ct-global-*-max. That is start-up, not idling.
func (a *agent) waitStartupDone(t *testing.T) {
	t.Helper()
	a.waitLog(t, "ipcache initialized")
	a.waitLog(t, "Restored load-balancing state from the pinned maps")
	testenv.Eventually(t, waitTimeout, "the first conntrack GC run", func() (bool, string) {
		var rows []healthRow
		if err := a.dump("health", &rows); err != nil {
			return false, err.Error()
		}
		for _, r := range rows {
			if r.Scope == "ct.job-gc" {
				return strings.HasPrefix(r.Message, "Deleted "), fmt.Sprintf("%+v", r)
			}
		}
		return false, fmt.Sprintf("no ct.job-gc scope: %+v", rows)
	})
}

// maxIdleCPU is the most CPU an idle agent may use, as a fraction of a
// core: generous, for a busy machine. The agent once spun a watch loop at
// 130% of a core.
const maxIdleCPU = 0.10

// TestIdleCPU: a healthy agent with nothing to do uses next to no CPU, with
// an empty config dir and with docs/examples.
func TestIdleCPU(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		configDir func(t *testing.T) string
	}{
		{"empty config dir", func(t *testing.T) string { return t.TempDir() }},
		{"docs/examples", examplesDir},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			a := startAgent(t, agentOptions{configDir: tc.configDir(t)})
			a.waitStartupDone(t)
			share := a.cpuShare(t, 3*time.Second)
			t.Logf("idle agent (%s): %.1f%% of a core over 3 s", tc.name, 100*share)
			if share > maxIdleCPU {
				t.Errorf("idle agent (%s) used %.1f%% of a core, more than %.0f%%", tc.name, 100*share, 100*maxIdleCPU)
			}
		})
	}
}

// soakDuration is how long TestSoak churns: 20 s, or $APIARY_SOAK (a Go
// duration such as 10m) for a longer run.
func soakDuration(t *testing.T) time.Duration {
	t.Helper()
	v := os.Getenv("APIARY_SOAK")
	if v == "" {
		return 20 * time.Second
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("APIARY_SOAK=%q: want a positive Go duration such as 10m", v)
	}
	return d
}

// soakPolicy is a CiliumNetworkPolicy allowing egress to one of a series
// of CIDRs and FQDN patterns.
func soakPolicy(i int) string {
	return fmt.Sprintf(`apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: churn, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toCIDR: [10.%d.0.0/16]
  - toFQDNs:
    - matchPattern: "*.churn-%d.example.com"
`, 100+i%50, i%50)
}

// soakSample is what the soak compares between its start and its end.
type soakSample struct {
	rssKB      uint64
	goroutines float64
	fds        int
}

func (a *agent) soakSample(t *testing.T) soakSample {
	t.Helper()
	st, err := readProcStats(a.pid())
	if err != nil {
		t.Fatal(err)
	}
	g, err := a.metric("go_goroutines")
	if err != nil {
		t.Fatal(err)
	}
	return soakSample{rssKB: st.rssKB, goroutines: g, fds: st.fds}
}

// TestSoak: the agent under config churn — a Service/EndpointSlice file and
// a policy file rewritten over and over, each change waited for — stays
// healthy, and its memory, goroutines and open files do not grow. 20 s by
// default; APIARY_SOAK=10m for a longer run.
func TestSoak(t *testing.T) {
	t.Parallel()
	duration := soakDuration(t)
	configDir := t.TempDir()
	svcFile, policyFile := filepath.Join(configDir, "web.yaml"), filepath.Join(configDir, "policy.yaml")
	// churn makes change i: the Service gets 1 to 5 backends, the policy
	// another CIDR and FQDN pattern. It waits until the frontends table
	// and the policies table show the change, and checks /healthz.
	churn := func(a *agent, i int) {
		t.Helper()
		n := 1 + i%5
		var eps, want []string
		for j := range n {
			ip := fmt.Sprintf("10.244.%d.%d", i%200, j+1)
			eps = append(eps, ip)
			want = append(want, ip+":8080/TCP/active")
		}
		slices.Sort(want)
		writeFile(t, svcFile, webService(nil, 8080, eps...))
		writeFile(t, policyFile, soakPolicy(i))
		wantFE := "10.96.0.10:80/TCP default/web " + strings.Join(want, ",") + " Done"
		wantCIDR := fmt.Sprintf("cidr:10.%d.0.0/16", 100+i%50)
		testenv.Eventually(t, waitTimeout, fmt.Sprintf("change %d applied", i), func() (bool, string) {
			a.alive(t)
			got, err := a.frontends()
			if err != nil {
				return false, err.Error()
			}
			if !slices.Equal(got, []string{wantFE}) {
				return false, fmt.Sprintf("frontends %v, want %s", got, wantFE)
			}
			var sels []struct {
				Selector string `json:"selector"`
			}
			if err := a.dump("selectors", &sels); err != nil {
				return false, err.Error()
			}
			for _, s := range sels {
				if s.Selector == wantCIDR {
					return true, ""
				}
			}
			return false, fmt.Sprintf("selectors %v, want %s among them", sels, wantCIDR)
		})
		code, body, err := httpGet(a.url("/healthz"))
		if err != nil || code != http.StatusOK {
			t.Fatalf("change %d: /healthz %d %s %v", i, code, body, err)
		}
	}

	a := startAgent(t, agentOptions{configDir: configDir})
	// Warm up (first of each object, lazily started things), then sample.
	i := 0
	for ; i < 10; i++ {
		churn(a, i)
	}
	start := a.soakSample(t)
	deadline := time.Now().Add(duration)
	for ; time.Now().Before(deadline); i++ {
		churn(a, i)
	}
	// Let the garbage collector and the health tables settle by waiting
	// for what one last change brings, then sample.
	churn(a, i)
	end := a.soakSample(t)
	t.Logf("soak: %d changes in %s; RSS %d → %d kB, goroutines %.0f → %.0f, open fds %d → %d",
		i+1, duration, start.rssKB, end.rssKB, start.goroutines, end.goroutines, start.fds, end.fds)

	// Generous bounds: a leak of one object, goroutine or file per change
	// exceeds them; noise does not.
	if end.rssKB > start.rssKB*3/2+32*1024 {
		t.Errorf("RSS grew from %d kB to %d kB", start.rssKB, end.rssKB)
	}
	if end.goroutines > start.goroutines+20 {
		t.Errorf("goroutines grew from %.0f to %.0f", start.goroutines, end.goroutines)
	}
	if end.fds > start.fds+10 {
		t.Errorf("open fds grew from %d to %d", start.fds, end.fds)
	}
	// Nothing is left of earlier changes: one policy, its two selectors.
	var prefixes []struct {
		Prefix string `json:"prefix"`
		Owner  string `json:"owner"`
	}
	if err := a.dump("prefixes", &prefixes); err != nil {
		t.Fatal(err)
	}
	var policyPrefixes []string
	for _, p := range prefixes {
		if !strings.HasPrefix(p.Owner, "node") {
			policyPrefixes = append(policyPrefixes, p.Prefix+" "+p.Owner)
		}
	}
	if len(policyPrefixes) != 1 {
		t.Errorf("prefixes other than the node's after the churn: %v, want only the last policy's CIDR", policyPrefixes)
	}
}
