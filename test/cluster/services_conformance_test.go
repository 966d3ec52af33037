//go:build cluster

package cluster

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// servicesSuite begins the names of the Services tests of Kubernetes' own
// e2e suite (k8s.io/kubernetes/test/e2e/network/service.go).
const servicesSuite = "[sig-network] Services"

// servicesOutOfScope are the Services tests that cannot run on
// test/cluster's node whatever the agent does, each with its reason: they
// are skipped and listed as such. The selection follows the reference's
// CI skip list for a cluster without kube-proxy.
var servicesOutOfScope = []lack{
	{regexp.MustCompile(`\[Disruptive\]|\[Serial\]`),
		"disrupts or monopolises the cluster (restarts nodes or components); the reference's CI skips it too"},
	{regexp.MustCompile(`LoadBalancer|\[Feature:`),
		"needs a cloud load balancer or a feature gate this cluster does not turn on"},
	{regexp.MustCompile(`kube-proxy|KubeProxy`),
		"restarts or probes kube-proxy, which this cluster does not run (apiary replaces it)"},
	{regexp.MustCompile(`restarting apiserver`),
		"restarts the API server, which test/cluster runs as a process the suite cannot restart"},
}

// servicesCISubset is the part of the Services suite TestServicesConformance
// runs by default (CI, make test-cluster): cluster IPs, node ports reached
// from the node, session affinity, endpoint changes and a service with no
// endpoints, chosen to finish in a few minutes on 2 cores. make
// conformance-services runs them all.
var servicesCISubset = []string{
	`should serve a basic endpoint from pods`,
	`should serve multiport endpoints from pods`,
	`should be updated after adding or deleting ports`,
	`should be able to create a functioning NodePort service`,
	`should have session affinity work for service with type clusterIP`,
	`should be rejected when no endpoints exist`,
	`should implement service.kubernetes.io/headless`,
	`should implement service.kubernetes.io/service-proxy-name`,
	`should prevent NodePort collisions`,
	`should find a service from listing all namespaces`,
}

// TestServicesConformance runs Kubernetes' [sig-network] Services e2e
// suite against apiary installed from deploy/ on the real node, with no
// kube-proxy. Every test run must pass.
//
// APIARY_SERVICES_CONFORMANCE=all runs every test of the suite but those
// of servicesOutOfScope (and those that skip themselves for the cluster's
// shape, one node), any other value the suite's tests whose names it
// matches (a regular expression), and APIARY_CONFORMANCE_REPORT=FILE
// writes the results of a whole run as a Markdown section (make
// conformance-services writes docs/conformance-services.md).
func TestServicesConformance(t *testing.T) {
	testenv.RequireRoot(t)
	bins := testenv.RequireKubeTestbin(t, repoRoot, "e2e.test", "agnhost")
	kubectl := findKubectl(t, bins["e2e.test"])
	which := os.Getenv("APIARY_SERVICES_CONFORMANCE")
	all := which == "all"

	start := time.Now()
	n := startNode(t, withClusterDNS())
	t.Logf("cluster up in %s", time.Since(start).Round(time.Millisecond))
	// The specs that check a Service is down ("service-proxy-name",
	// "headless") expect a connection to a cluster IP nobody serves to
	// fail, as on a cluster's network, where the service range is routed
	// nowhere. This machine's default route leads to an egress proxy that
	// answers any port 80 (an HTTP 404), so the range is routed onto the
	// node's bridge, where nothing answers (the route goes with the
	// bridge).
	n.run("ip", "route", "add", serviceCIDR, "dev", bridgeName)
	agnhost := n.importAgnhost(bins)
	n.pinDir = "/sys/fs/bpf/apiary-svc-conformance-" + strings.ToLower(rand.Text()[:8])
	n.install(agentDirs{pinDir: n.pinDir, stateDir: filepath.Join(n.dir, "agent-state")})
	n.waitAgentReady()
	n.waitAgentHealthy()
	n.waitCNIChained()
	t.Logf("apiary installed; %s imported as %s; kubectl %s", bins["agnhost"], agnhost, kubectl)

	suiteFocus := regexp.QuoteMeta(servicesSuite) + ` `
	focus := suiteFocus
	switch {
	case all:
	case which != "":
		focus = suiteFocus + `.*(` + which + `)`
	default:
		quoted := make([]string, len(servicesCISubset))
		for i, s := range servicesCISubset {
			quoted[i] = regexp.QuoteMeta(s)
		}
		focus = suiteFocus + `.*(` + strings.Join(quoted, "|") + `)`
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

	results, err := readJUnit(filepath.Join(reportDir, "junit_01.xml"), servicesSuite+" ", lacking)
	if err != nil {
		t.Fatalf("e2e.test: %v (exit: %v)\n%s", err, runErr, tail(logPath, 60))
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
	t.Logf("%d of the suite's %d tests ran: %d passed, %d failed, %d skipped", ran, len(results), ran-failed, failed, len(results)-ran)
	if failed > 0 {
		t.Logf("the end of e2e.test's log:\n%s", tail(logPath, 150))
	}
	if ran == 0 {
		t.Fatalf("no test of the suite ran (exit: %v)\n%s", runErr, tail(logPath, 60))
	}
	if runErr != nil && failed == 0 {
		t.Errorf("e2e.test failed outside the tests: %v\n%s", runErr, tail(logPath, 60))
	}
	if report := os.Getenv("APIARY_CONFORMANCE_REPORT"); report != "" {
		if !all {
			t.Fatalf("APIARY_CONFORMANCE_REPORT needs APIARY_SERVICES_CONFORMANCE=all: the report lists the whole suite")
		}
		if err := os.WriteFile(report, servicesTable(results, took), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", report)
	}
}

// findKubectl is the kubectl the suite runs (its pods are exec'd through
// `kubectl exec`): one beside e2e.test when scripts/kube-testbin built it,
// else the first on PATH.
func findKubectl(t *testing.T, e2e string) string {
	beside := filepath.Join(filepath.Dir(e2e), "kubectl")
	if st, err := os.Stat(beside); err == nil && st.Mode()&0o111 != 0 {
		return beside
	}
	if p, err := exec.LookPath("kubectl"); err == nil {
		return p
	}
	testenv.Skip(t, "the Services suite execs into its pods with kubectl: put one on PATH")
	return ""
}

// servicesTable is docs/conformance-services.md: the results of a whole
// run of the Services suite.
func servicesTable(results []specResult, took time.Duration) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, `# Services conformance

Kubernetes' own `+"`[sig-network] Services`"+` e2e suite
(`+"`k8s.io/kubernetes/test/e2e/network/service.go`"+`, v1.36.4) run against
apiary on test/cluster's real single-node cluster with no kube-proxy: every
Service path the suite probes (cluster IPs, node ports, external IPs, session
affinity, services with no endpoints) goes through apiary. The suite's pods
run `+"`agnhost`"+` built from Kubernetes' sources with busybox (`+"`/bin/sh`"+`,
`+"`wget`"+`, `+"`nc`"+`) and curl beside it, as Kubernetes' own agnhost image has them.

Generated by `+"`make conformance-services`"+` (test/cluster `+"`TestServicesConformance`"+`
with APIARY_SERVICES_CONFORMANCE=all); do not edit by hand. CI runs a part of
the suite (`+"`servicesCISubset`"+` in test/cluster/services_conformance_test.go) on
every change. Tests that need more than one node skip themselves (their reason
is the suite's own); they run on 2 nodes in [conformance-multinode.md](conformance-multinode.md).
How the suite runs here and what its runs found:
[testing.md](testing.md#services-conformance-kubernetes-own-suite).

`)
	writeResults(&b, results, took)
	return b.Bytes()
}
