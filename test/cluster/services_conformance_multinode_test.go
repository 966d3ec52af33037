//go:build cluster

package cluster

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// granularServices begins the names of networking.go's "Granular Checks:
// Services" specs, which all skip themselves on fewer than 2 nodes.
const granularServices = "[sig-network] Networking Granular Checks: Services"

// servicesMultiNode are the Services specs that skip themselves on one
// node (they need two schedulable nodes).
var servicesMultiNode = []string{
	`should be able to connect to terminating and unready endpoints if PublishNotReadyAddresses is true`,
	`should not be able to connect to terminating and unready endpoints if PublishNotReadyAddresses is false`,
	`should fail health check node port if there are only terminating endpoints`,
	`should fallback to local terminating endpoints when there are no ready endpoints with externalTrafficPolicy=Local`,
	`should fallback to local terminating endpoints when there are no ready endpoints with internalTrafficPolicy=Local`,
	`should fallback to terminating endpoints when there are no ready endpoints with externallTrafficPolicy=Cluster`,
	`should fallback to terminating endpoints when there are no ready endpoints with internalTrafficPolicy=Cluster`,
	`should preserve source pod IP for traffic thru service cluster IP`,
	`should respect internalTrafficPolicy=Local Pod (hostNetwork: true) to Pod`,
	`should respect internalTrafficPolicy=Local Pod and Node, to Pod (hostNetwork: true)`,
	`should respect internalTrafficPolicy=Local Pod to Pod`,
	`should support externalTrafficPolicy=Local for type=NodePort`,
}

// TestServicesConformanceMultiNode runs the Services specs of Kubernetes'
// e2e suite that need two nodes (servicesMultiNode and every "Granular
// Checks: Services" spec) on the multi-node cluster, against apiary with
// no kube-proxy. It runs only when APIARY_SERVICES_CONFORMANCE_MULTINODE
// is set (make conformance-multinode): 1 or all runs them all, any other
// value those of them whose names it matches (a regular expression);
// APIARY_CONFORMANCE_REPORT_SERVICES
// writes the results as Markdown. Failures are reported and listed; the
// test fails on them.
func TestServicesConformanceMultiNode(t *testing.T) {
	if os.Getenv("APIARY_SERVICES_CONFORMANCE_MULTINODE") == "" {
		t.Skip("APIARY_SERVICES_CONFORMANCE_MULTINODE is not set (make conformance-multinode)")
	}
	testenv.RequireRoot(t)
	bins := testenv.RequireKubeTestbin(t, repoRoot, "e2e.test", "agnhost")
	kubectl := findKubectl(t, bins["e2e.test"])
	count := nodeCount(t)
	if count < 2 {
		t.Fatalf("APIARY_NODES=%d: these specs need 2 nodes", count)
	}
	start := time.Now()
	n, workers := startMultiNode(t, count)
	t.Logf("%d nodes up in %s", count, time.Since(start).Round(time.Millisecond))
	for _, w := range workers {
		w.importAgnhost(bins)
		// A cluster IP nobody serves must not be answered (this
		// machine's default route leads to a proxy that answers port
		// 80): the service range goes nowhere from a node, as on a
		// cluster's network. The route goes with the node's namespace.
		w.run("ip", "netns", "exec", w.netns, "ip", "route", "add", "blackhole", serviceCIDR)
	}
	pinDir := "/sys/fs/bpf/apiary"
	n.install(agentDirs{pinDir: pinDir, stateDir: workers[0].stateDir})
	n.waitAgentsReady(count)
	for _, w := range workers {
		w.waitChained(pinDir)
	}
	quoted := make([]string, len(servicesMultiNode))
	for i, s := range servicesMultiNode {
		quoted[i] = regexp.QuoteMeta(s)
	}
	focus := regexp.QuoteMeta(granularServices) + `|` + regexp.QuoteMeta(servicesSuite) + ` .*(` + strings.Join(quoted, "|") + `)`
	if which := os.Getenv("APIARY_SERVICES_CONFORMANCE_MULTINODE"); which != "1" && which != "all" {
		// Some of them by name: the specs whose names the value matches.
		if _, err := regexp.Compile(which); err != nil {
			t.Fatalf("APIARY_SERVICES_CONFORMANCE_MULTINODE: %v", err)
		}
		focus = which
	}
	lacking := append(unsupported(), servicesOutOfScope...)
	var skip []string
	for _, u := range lacking {
		skip = append(skip, u.pattern.String())
	}
	reportDir := filepath.Join(n.dir, "e2e-report")
	logPath := filepath.Join(n.dir, "e2e.log")
	start = time.Now()
	runErr := n.runE2E(bins["e2e.test"], reportDir, logPath, focus, strings.Join(skip, "|"), "--kubectl-path="+kubectl)
	took := time.Since(start)
	t.Logf("e2e.test ran in %s", took.Round(time.Second))
	junit := filepath.Join(reportDir, "junit_01.xml")
	granular, err := readJUnit(junit, granularServices, lacking)
	if err != nil {
		t.Fatalf("e2e.test: %v (exit: %v)\n%s", err, runErr, tail(logPath, 60))
	}
	services, err := readJUnit(junit, servicesSuite+" ", lacking)
	if err != nil {
		t.Fatal(err)
	}
	results := granular
	for _, r := range services {
		for _, s := range servicesMultiNode {
			if strings.Contains(r.Name, s) {
				results = append(results, r)
				break
			}
		}
	}
	ran, failed := 0, 0
	for _, r := range results {
		if r.Result != "skipped" {
			t.Logf("%s: %s", r.Result, r.Name)
		}
		switch r.Result {
		case "passed":
			ran++
		case "failed":
			ran++
			failed++
			t.Errorf("FAILED: %s\n%s", r.Name, r.Reason)
		}
	}
	t.Logf("on %d nodes, %d of %d specs ran: %d passed, %d failed, %d skipped", count, ran, len(results), ran-failed, failed, len(results)-ran)
	if failed > 0 {
		t.Logf("the end of e2e.test's log:\n%s", tail(logPath, 150))
	}
	if ran == 0 {
		t.Fatalf("no spec ran (exit: %v)\n%s", runErr, tail(logPath, 60))
	}
	if report := os.Getenv("APIARY_CONFORMANCE_REPORT_SERVICES"); report != "" {
		var b bytes.Buffer
		fmt.Fprintf(&b, "## Services on %d nodes\n\nThe Services specs that need two nodes and networking.go's \"Granular Checks: Services\", run by `make conformance-multinode` (test/cluster `TestServicesConformanceMultiNode`).\n\n", count)
		writeResults(&b, results, took)
		if err := os.WriteFile(report, b.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", report)
	}
}
