//go:build cluster

package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
	placed := n.watchPlacement("netpol-")
	runErr := n.runE2E(bins["e2e.test"], reportDir, logPath, focus, strings.Join(skip, "|"))
	where := placed.stop()
	t.Logf("the suite's pods ran on: %s", where)
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
		about := fmt.Sprintf("On test/cluster's multi-node cluster of %d nodes; the scheduler spread the suite's pods over them, so its probes cross nodes (pods of the suite per node: %s).", count, where)
		if err := writeShapeSection(report, fmt.Sprintf("%d nodes", count), about, results, took); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", report)
	}
}

// placement records on which node each pod of some namespaces ran, while
// a suite runs.
type placement struct {
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	node   map[string]string // "<namespace>/<pod>" -> node
}

// watchPlacement records the nodes of the pods of the namespaces whose
// names start with prefix until stop.
func (n *node) watchPlacement(prefix string) *placement {
	ctx, cancel := context.WithCancel(context.Background())
	p := &placement{cancel: cancel, done: make(chan struct{}), node: map[string]string{}}
	go func() {
		defer close(p.done)
		for ctx.Err() == nil {
			w, err := n.cs.CoreV1().Pods("").Watch(ctx, metav1.ListOptions{})
			if err != nil {
				select {
				case <-ctx.Done():
				case <-time.After(time.Second):
				}
				continue
			}
			for ev := range w.ResultChan() {
				pod, ok := ev.Object.(*corev1.Pod)
				if !ok || !strings.HasPrefix(pod.Namespace, prefix) || pod.Spec.NodeName == "" {
					continue
				}
				p.mu.Lock()
				p.node[pod.Namespace+"/"+pod.Name] = pod.Spec.NodeName
				p.mu.Unlock()
			}
		}
	}()
	return p
}

// stop ends the watch and returns the count of pods per node, "node-1: 40,
// node-2: 38".
func (p *placement) stop() string {
	p.cancel()
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	count := map[string]int{}
	for _, node := range p.node {
		count[node]++
	}
	var out []string
	for node, c := range count {
		out = append(out, fmt.Sprintf("%s: %d", node, c))
	}
	sort.Strings(out)
	if len(out) == 0 {
		return "none seen"
	}
	return strings.Join(out, ", ")
}
