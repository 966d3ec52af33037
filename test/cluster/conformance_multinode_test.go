//go:build cluster

package cluster

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// TestNetworkPolicyConformanceMultiNode runs Kubernetes' NetworkPolicy
// suite on the multi-node cluster (APIARY_NODES nodes, 2 by default), the
// suite's pods spread over the nodes by the scheduler. It runs only when
// APIARY_CONFORMANCE_MULTINODE is set: "all" for the whole suite (make
// conformance-multinode), another value for the tests whose names it
// matches. Every test run must pass.
func TestNetworkPolicyConformanceMultiNode(t *testing.T) {
	which := os.Getenv("APIARY_CONFORMANCE_MULTINODE")
	if which == "" {
		t.Skip("APIARY_CONFORMANCE_MULTINODE is not set (make conformance-multinode)")
	}
	testenv.RequireRoot(t)
	bins := testenv.RequireKubeTestbin(t, repoRoot, "e2e.test", "agnhost")
	count := nodeCount(t)
	start := time.Now()
	n, workers := startMultiNode(t, count)
	t.Logf("%d nodes up in %s", count, time.Since(start).Round(time.Millisecond))
	for _, w := range workers {
		w.importAgnhost(bins)
	}
	pinDir := "/sys/fs/bpf/apiary"
	n.install(agentDirs{pinDir: pinDir, stateDir: workers[0].stateDir})
	n.waitAgentsReady(count)
	for _, w := range workers {
		w.waitChained(pinDir)
	}
	focus := regexp.QuoteMeta(netpolSuite)
	if which != "all" {
		focus += `.*(` + which + `)`
	}
	lacking := unsupported()
	var skip []string
	for _, u := range lacking {
		skip = append(skip, u.pattern.String())
	}
	reportDir := filepath.Join(n.dir, "e2e-report")
	logPath := filepath.Join(n.dir, "e2e.log")
	start = time.Now()
	runErr := n.runE2E(bins["e2e.test"], reportDir, logPath, focus, strings.Join(skip, "|"))
	took := time.Since(start)
	t.Logf("e2e.test ran in %s", took.Round(time.Second))
	results, err := readJUnit(filepath.Join(reportDir, "junit_01.xml"), netpolSuite, lacking)
	if err != nil {
		t.Fatalf("e2e.test: %v (exit: %v)\n%s", err, runErr, tail(logPath, 60))
	}
	ran, failed := 0, 0
	for _, r := range results {
		switch r.Result {
		case "passed":
			ran++
		case "failed":
			ran++
			failed++
			t.Errorf("FAILED: %s\n%s", r.Name, r.Reason)
		}
	}
	t.Logf("on %d nodes, %d of the suite's %d tests ran: %d passed, %d failed, %d skipped", count, ran, len(results), ran-failed, failed, len(results)-ran)
	if failed > 0 {
		t.Logf("the end of e2e.test's log:\n%s", tail(logPath, 150))
	}
	if ran == 0 {
		t.Fatalf("no test of the suite ran (exit: %v)\n%s", runErr, tail(logPath, 60))
	}
	if report := os.Getenv("APIARY_CONFORMANCE_REPORT"); report != "" && which == "all" {
		if err := os.WriteFile(report, conformanceTable(results, took), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", report)
	}
}
