//go:build cluster

package cluster

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/apiary-net/apiary/internal/testenv"
)

// cnpSuiteTest is the go test entry point of network-policy-api's
// conformance suite (sigs.k8s.io/network-policy-api/conformance, v0.3.0):
// its tests are subtests of it, and theirs subtests of them.
const cnpSuiteTest = "TestConformanceProfiles"

// cnpCISubset is the part of the suite TestClusterNetworkPolicyConformance
// runs by default (CI, make test-cluster): subtests, by test, that pass on
// main (Admin tier, Deny rules only) and with Accept, Pass and the Baseline
// tier, each independent of the subtests before it, about a minute of the
// suite's time after its pods are up.
// make conformance-clusternetpol runs them all.
var cnpCISubset = map[string][]string{
	"CNPAdminTierIngressTCP": {
		"Should not affect egress traffic when only ingress rules are specified",
		"Should support an 'deny-ingress' policy for TCP protocol; ensure rule ordering is respected",
	},
	"CNPAdminTierIngressUDP": {
		"Should support an 'deny-ingress' policy for UDP protocol; ensure rule ordering is respected",
	},
	// An egress Deny is a drop (a timeout to the client), not EPERM, and
	// a networks peer holds pod addresses.
	"CNPAdminTierEgressTCP": {
		"Should support a 'deny-egress' policy for TCP protocol at the specified port",
	},
	"CNPAdminTierEgressInlineCIDRPeers": {
		"Should support a 'deny-egress' rule policy for egress-cidr-peer",
	},
	"CNPAdminTierIntegration": {
		"Should Deny traffic from slytherin to gryffindor respecting admin CNP",
	},
	// nodes peers, and pod selectors on a label the identity filter
	// leaves out (statefulset.kubernetes.io/pod-name).
	"CNPAdminTierEgressNodePeers": {
		"Should support an 'allow-egress' rule policy for egress-node-peer",
		"Should support a 'pass-egress' rule policy for egress-node-peer",
	},
	"CNPBaselineTierEgressNodePeers": {
		"Should support an 'allow-egress' rule policy for egress-node-peer",
	},
	"CNPAdminTierPodSelector": {
		"Should support pod selectors in ingress peers",
	},
	"CNPBaselineTierPodSelector": {
		"Should support pod selectors in ingress peers",
	},
}

// cnpRunPattern is the -test.run pattern of a subset: go test matches each
// level of a name on its own, so the tests' names and the subtests' are
// two alternations (the subtests' names are unique across the tests).
func cnpRunPattern(subset map[string][]string) string {
	var tests, subtests []string
	for test, subs := range subset {
		tests = append(tests, regexp.QuoteMeta(test))
		for _, sub := range subs {
			subtests = append(subtests, regexp.QuoteMeta(strings.ReplaceAll(sub, " ", "_")))
		}
	}
	slices.Sort(tests)
	slices.Sort(subtests)
	return "^(" + strings.Join(tests, "|") + ")$/^(" + strings.Join(subtests, "|") + ")$"
}

// TestClusterNetworkPolicyConformance runs SIG Network's ClusterNetworkPolicy
// conformance suite (network-policy-api v0.3.0, built by
// scripts/cnp-testbin) with the ClusterNetworkPolicy profile and both
// experimental features (ClusterNetworkPolicyNamedPorts,
// ClusterNetworkPolicyEgressNodePeers) against apiary installed from
// deploy/ on the multi-node cluster (APIARY_NODES nodes, 2 by default: the
// suite needs two), with the experimental-channel CRD the features need
// and agnhost imported under the name the suite's manifests give. Every
// test run must pass.
//
// On a kernel without SCTP the suite runs with APIARY_CNP_NO_SCTP=1 (see
// scripts/cnp-testbin): its SCTP servers and probes are left out, and a
// test whose probes are all SCTP's counts as skipped.
//
// APIARY_CNP_CONFORMANCE=all runs the whole suite instead of cnpCISubset,
// any other value the suite's tests that -test.run=TestConformanceProfiles/
// VALUE selects, and APIARY_CONFORMANCE_REPORT=FILE writes the results of a
// whole run as a Markdown page (make conformance-clusternetpol writes
// docs/conformance-clusternetpol.md). APIARY_CNP_CONFORMANCE_LOG=FILE keeps
// the suite's go test -json events (make conformance-clusternetpol keeps
// them in bin/cnp-conformance.json).
func TestClusterNetworkPolicyConformance(t *testing.T) {
	testenv.RequireRoot(t)
	bins := testenv.RequireKubeTestbin(t, repoRoot, "e2e.test", "agnhost")
	suiteDir := testenv.RequireCNPTestbin(t, repoRoot)
	goTool, err := exec.LookPath("go")
	if err != nil {
		testenv.Skip(t, "needs go on PATH for go tool test2json")
	}
	which := os.Getenv("APIARY_CNP_CONFORMANCE")
	all := which == "all"
	images := strings.Fields(string(readFile(t, filepath.Join(suiteDir, "images"))))

	// The suite's host-network StatefulSet has two replicas with the same
	// host ports, so they need two nodes.
	count := nodeCount(t)
	if count < 2 {
		t.Fatalf("APIARY_NODES=%d: the suite needs 2 nodes or more (two host-network pods with the same ports)", count)
	}
	start := time.Now()
	n, workers := startMultiNode(t, count)
	t.Logf("%d nodes up in %s", count, time.Since(start).Round(time.Millisecond))
	var agnhost []string
	for _, w := range workers {
		agnhost = w.importAgnhost(bins, images...)
	}
	pinDir := "/sys/fs/bpf/apiary"
	n.install(agentDirs{pinDir: pinDir, stateDir: workers[0].stateDir})
	// The experimental features need the experimental channel's schema
	// (destinationNamedPort, nodes peers): it replaces the standard CRD
	// deploy/ installs, as docs/policy.md tells users who want them.
	n.replaceCRD(filepath.Join(suiteDir, "crd-experimental.yaml"))
	n.waitAgentsReady(count)
	for _, w := range workers {
		w.waitChained(pinDir)
	}
	t.Logf("apiary installed on %d nodes; %s imported as %s", count, bins["agnhost"], agnhost)

	run := "^" + cnpSuiteTest + "$"
	switch {
	case all:
	case which != "":
		run += "/" + which
	default:
		run += "/" + cnpRunPattern(cnpCISubset)
	}
	noSCTP := !sctpSupported()
	logPath := filepath.Join(n.dir, "cnp-conformance.json")
	start = time.Now()
	runErr := n.runCNPSuite(goTool, filepath.Join(suiteDir, "cnp-conformance.test"), logPath, run, noSCTP)
	took := time.Since(start)
	t.Logf("the suite ran in %s (go test -json log: %s)", took.Round(time.Second), logPath)

	if keep := os.Getenv("APIARY_CNP_CONFORMANCE_LOG"); keep != "" {
		if err := os.WriteFile(keep, readFile(t, logPath), 0o644); err != nil {
			t.Error(err)
		}
	}
	results, err := readTest2JSON(logPath)
	if err != nil {
		t.Fatalf("the suite: %v (exit: %v)", err, runErr)
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
	t.Logf("%d of the suite's %d subtests ran: %d passed, %d failed, %d skipped", ran, len(results), ran-failed, failed, len(results)-ran)
	if ran == 0 {
		t.Fatalf("no test of the suite ran (exit: %v)\n%s", runErr, tail(logPath, 40))
	}
	if runErr != nil && failed == 0 {
		t.Errorf("the suite failed outside its tests: %v\n%s", runErr, tail(logPath, 40))
	}
	if report := os.Getenv("APIARY_CONFORMANCE_REPORT"); report != "" {
		if !all {
			t.Fatalf("APIARY_CONFORMANCE_REPORT needs APIARY_CNP_CONFORMANCE=all: the report lists the whole suite")
		}
		if err := os.WriteFile(report, cnpConformancePage(results, took, noSCTP), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", report)
	}
}

// replaceCRD replaces an installed CRD with the one in file.
func (n *node) replaceCRD(file string) {
	t := n.t
	objs := n.readManifests(filepath.Dir(file))
	objs = slices.DeleteFunc(objs, func(o *unstructured.Unstructured) bool { return o.GetKind() != "CustomResourceDefinition" })
	if len(objs) != 1 {
		t.Fatalf("%s: %d CRDs, want 1", file, len(objs))
	}
	dyn, err := dynamic.NewForConfig(n.admin)
	if err != nil {
		t.Fatal(err)
	}
	r := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	cur, err := r.Get(context.Background(), objs[0].GetName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	objs[0].SetResourceVersion(cur.GetResourceVersion())
	if _, err := r.Update(context.Background(), objs[0], metav1.UpdateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("replace CRD %s: %v", objs[0].GetName(), err)
	}
	n.waitCRDs(objs)
}

// runCNPSuite runs the suite's test binary through go tool test2json (its
// events to logPath), with the ClusterNetworkPolicy profile, both
// experimental features and the tests run selects.
func (n *node) runCNPSuite(goTool, bin, logPath, run string, noSCTP bool) error {
	log, err := os.Create(logPath)
	if err != nil {
		n.t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command(goTool, "tool", "test2json", "-t", bin,
		"-test.v=test2json",
		"-test.run="+run,
		"-test.timeout=110m",
		"-conformance-profiles=ClusterNetworkPolicy",
		"-supported-features=ClusterNetworkPolicyNamedPorts,ClusterNetworkPolicyEgressNodePeers",
		// The profile report (written beside the log) names its maker.
		"-organization=apiary-net",
		"-project=apiary",
		"-url=https://github.com/apiary-net/apiary",
		"-version=dev",
		"-contact=https://github.com/apiary-net/apiary/issues",
		"-additional-info=test/cluster TestClusterNetworkPolicyConformance",
		"-report-output="+filepath.Join(n.dir, "cnp-conformance-report.yaml"),
	)
	cmd.Dir = n.dir
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Env = append(os.Environ(), "HOME="+n.dir, "KUBECONFIG="+n.kubeconfigPath)
	if noSCTP {
		cmd.Env = append(cmd.Env, "APIARY_CNP_NO_SCTP=1")
	}
	n.t.Logf("running the ClusterNetworkPolicy suite (%s)", run)
	return cmd.Run()
}

// probeLine is the line the suite (as scripts/cnp-testbin builds it) logs
// for each attempt of a probe.
var probeLine = regexp.MustCompile(`APIARY-PROBE (\S+) (\S+ -> \S+) connect=(\w+) skipped=(\w+)`)

// testEvent is one event of go test -json.
type testEvent struct {
	Action string
	Test   string
	Output string
}

// cnpTest is what the events say of one test or subtest.
type cnpTest struct {
	result string // pass, fail, skip; "" if it never ended
	output []string
	probes map[string]bool // distinct probes, true if left out for SCTP
}

// readTest2JSON turns the suite's events into a result per subtest (the
// suite's tests all have subtests; a test that ended before any ran is
// one result of its own), in the order they ran.
func readTest2JSON(path string) ([]specResult, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	tests := map[string]*cnpTest{}
	var order []string
	var setup []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		var e testEvent
		if json.Unmarshal(sc.Bytes(), &e) != nil || e.Test == "" {
			continue
		}
		ct := tests[e.Test]
		if ct == nil {
			ct = &cnpTest{probes: map[string]bool{}}
			tests[e.Test] = ct
			order = append(order, e.Test)
		}
		switch e.Action {
		case "pass", "fail", "skip":
			ct.result = e.Action
		case "output":
			line := strings.TrimRight(e.Output, "\n")
			ct.output = append(ct.output, line)
			if m := probeLine.FindStringSubmatch(line); m != nil {
				ct.probes[m[1]+" "+m[2]+" "+m[3]] = m[4] == "true"
			}
			if e.Test == cnpSuiteTest {
				setup = append(setup, line)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if len(tests) == 0 {
		return nil, fmt.Errorf("%s has no test events", path)
	}
	hasChildren := func(name string) bool {
		for _, o := range order {
			if strings.HasPrefix(o, name+"/") {
				return true
			}
		}
		return false
	}
	var out []specResult
	for _, name := range order {
		parts := strings.Split(name, "/")
		if len(parts) < 2 || len(parts) > 3 || (len(parts) == 2 && hasChildren(name)) {
			continue
		}
		ct := tests[name]
		r := specResult{Name: strings.ReplaceAll(strings.Join(parts[1:], ": "), "_", " ")}
		sctp, other := 0, 0
		for _, skipped := range ct.probes {
			if skipped {
				sctp++
			} else {
				other++
			}
		}
		switch ct.result {
		case "pass":
			r.Result = "passed"
			switch {
			case sctp > 0 && other == 0:
				r.Result = "skipped"
				r.Reason = fmt.Sprintf("needs SCTP: all its %d probes are SCTP's, and this kernel has no SCTP (no CONFIG_IP_SCTP)", sctp)
			case sctp > 0:
				r.Reason = fmt.Sprintf("its %d TCP/UDP probes passed; its %d SCTP probes were left out (no SCTP in this kernel)", other, sctp)
			}
		case "skip":
			r.Result = "skipped"
			r.Reason = firstLines(strings.Join(ct.output, "\n"), 2)
		default:
			r.Result = "failed"
			r.Reason = failureReason(ct.output)
		}
		out = append(out, r)
	}
	if top := tests[cnpSuiteTest]; top != nil && top.result == "fail" && !slices.ContainsFunc(out, func(r specResult) bool { return r.Result == "failed" }) {
		out = append(out, specResult{Name: cnpSuiteTest + " (setup)", Result: "failed", Reason: failureReason(setup)})
	}
	return out, nil
}

// failureReason picks from a failed test's output the probe that failed
// last (the suite logs the command and what it expected) or testify's
// error message.
func failureReason(output []string) string {
	strip := regexp.MustCompile(`^\s*\S+\.go:\d+: `)
	var cmd, expected, errMsg string
	for i, l := range output {
		l = strings.TrimSpace(l)
		switch {
		case strings.Contains(l, "FAILED Command was"):
			cmd = strip.ReplaceAllString(l, "")
		case strings.Contains(l, "Expected connection"):
			expected = strip.ReplaceAllString(l, "")
		case strings.HasPrefix(l, "Error:") && errMsg == "":
			errMsg = l
			if i+1 < len(output) {
				errMsg += " " + strings.TrimSpace(output[i+1])
			}
		}
	}
	switch {
	case expected != "":
		return strings.TrimSpace(cmd + ": " + expected)
	case errMsg != "":
		return errMsg
	}
	return firstLines(strings.Join(output, "\n"), 4)
}

// cnpConformancePage is docs/conformance-clusternetpol.md: the results of
// a whole run.
func cnpConformancePage(results []specResult, took time.Duration, noSCTP bool) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, `# ClusterNetworkPolicy conformance

SIG Network's conformance suite for ClusterNetworkPolicy
(`+"`sigs.k8s.io/network-policy-api/conformance`"+`, v0.3.0, its own go test
entry point `+"`TestConformanceProfiles`"+`) with the `+"`ClusterNetworkPolicy`"+`
profile and both experimental features (`+"`ClusterNetworkPolicyNamedPorts`"+`,
`+"`ClusterNetworkPolicyEgressNodePeers`"+`), run against apiary on test/cluster's
multi-node cluster (2 nodes, each a kubelet, containerd and runc in namespaces
of one machine; the suite's two host-network pods use the same ports, so they
need a node each). apiary is installed from
`+"`deploy/`"+` with its image, and the CRD replaced by the module's experimental
channel, which the experimental features need. The suite's `+"`agnhost:2.45`"+`
image is agnhost built from Kubernetes v1.36.4's sources, imported under that
name (with bash, which the suite's servers are started with). The suite is
built by `+"`scripts/cnp-testbin`"+`; one row per subtest.

Generated by `+"`make conformance-clusternetpol`"+` (test/cluster
`+"`TestClusterNetworkPolicyConformance`"+` with APIARY_CNP_CONFORMANCE=all); do
not edit by hand. CI runs a part of the suite (`+"`cnpCISubset`"+` in
test/cluster/clusternetpol_conformance_test.go) on every change.
`)
	if noSCTP {
		fmt.Fprintf(&b, `
This machine's kernel has no SCTP (no CONFIG_IP_SCTP), so the suite ran with
APIARY_CNP_NO_SCTP=1 (see scripts/cnp-testbin/build.sh): its SCTP server
containers and SCTP probes were left out. A subtest whose probes are all
SCTP's is listed as skipped; one with TCP or UDP probes too passes or fails on
those, and says how many SCTP probes it left out.
`)
	}
	b.WriteString("\n")
	writeResults(&b, results, took)
	return b.Bytes()
}
