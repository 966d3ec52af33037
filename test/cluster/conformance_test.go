//go:build cluster

package cluster

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/xml"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/internal/imagetar"
	"github.com/apiary-net/apiary/internal/testenv"
)

// netpolSuite begins the names of the NetworkPolicy tests of Kubernetes'
// own e2e suite (k8s.io/kubernetes/test/e2e/network/netpol): the Describe
// texts of its files.
const netpolSuite = "[sig-network] Netpol"

// lack is tests of the suite that need what this machine lacks.
type lack struct {
	pattern *regexp.Regexp // of the tests' names
	reason  string
}

// unsupported are the suite's tests that need what this machine lacks,
// each with its reason: they are skipped and listed as such.
func unsupported() []lack {
	var u []lack
	if !sctpSupported() {
		u = append(u, lack{regexp.MustCompile(`\[Feature:SCTPConnectivity\]`),
			"needs SCTP sockets, which this kernel does not have (no CONFIG_IP_SCTP: socket() gives EPROTONOSUPPORT), so pods cannot serve SCTP"})
	}
	return u
}

// sctpSupported reports whether this kernel makes SCTP sockets.
func sctpSupported() bool {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, unix.IPPROTO_SCTP)
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
}

// ciSubset is the part of the suite TestNetworkPolicyConformance runs by
// default (CI, make test-cluster): one test of each kind of rule, chosen to
// finish in under 10 minutes on 2 cores. make conformance runs them all.
var ciSubset = []string{
	`should support a 'default-deny-ingress' policy`,
	`should support a 'default-deny-all' policy`,
	`should enforce policy based on PodSelector and NamespaceSelector`,
	`should enforce policy based on Ports`,
	`should allow ingress access on one named port`,
	`should allow egress access on one named port`,
	`should enforce updated policy`,
	`should allow egress access to server in CIDR block`,
	`should enforce except clause while egress access to server in CIDR block`,
	`should deny egress from all pods in a namespace`,
	`should not allow access by TCP when a policy specifies only UDP`,
	`should stop enforcing policies after they are deleted`,
	`should support creating NetworkPolicy API operations`,
}

// TestNetworkPolicyConformance runs Kubernetes' NetworkPolicy e2e suite
// (e2e.test, with agnhost imported under the name the suite asks for)
// against apiary installed from deploy/ on the real node. Every test run
// must pass.
//
// APIARY_CONFORMANCE=all runs the whole suite instead of ciSubset, any
// other value the suite's tests whose names it matches (a regular
// expression), and APIARY_CONFORMANCE_REPORT=FILE writes the results of a
// whole run as a Markdown table (make conformance writes
// docs/conformance.md).
func TestNetworkPolicyConformance(t *testing.T) {
	testenv.RequireRoot(t)
	bins := testenv.RequireKubeTestbin(t, repoRoot, "e2e.test", "agnhost")
	which := os.Getenv("APIARY_CONFORMANCE")
	all := which == "all"

	start := time.Now()
	n := startNode(t)
	t.Logf("cluster up in %s", time.Since(start).Round(time.Millisecond))
	agnhost := n.importAgnhost(bins)
	n.pinDir = "/sys/fs/bpf/apiary-conformance-" + strings.ToLower(rand.Text()[:8])
	n.install(agentDirs{pinDir: n.pinDir, stateDir: filepath.Join(n.dir, "agent-state")})
	n.waitAgentReady()
	n.waitAgentHealthy()
	n.waitCNIChained()
	t.Logf("apiary installed; %s imported as %s", bins["agnhost"], agnhost)

	netpolFocus := regexp.QuoteMeta(netpolSuite)
	focus := netpolFocus
	switch {
	case all:
	case which != "":
		focus = netpolFocus + `.*(` + which + `)`
	default:
		quoted := make([]string, len(ciSubset))
		for i, s := range ciSubset {
			quoted[i] = regexp.QuoteMeta(s)
		}
		focus = netpolFocus + `.*(` + strings.Join(quoted, "|") + `)`
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
	t.Logf("e2e.test ran in %s", time.Since(start).Round(time.Second))

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
	checkSuiteFlows(t, n)
	if report := os.Getenv("APIARY_CONFORMANCE_REPORT"); report != "" {
		if !all {
			t.Fatalf("APIARY_CONFORMANCE_REPORT needs APIARY_CONFORMANCE=all: the report lists the whole suite")
		}
		if err := writeShapeSection(report, "1 node", "On test/cluster's single-node cluster.", results, time.Since(start)); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", report)
	}
}

// shellTools are the programs the suites exec in agnhost's pods beside
// agnhost itself, as Kubernetes' own agnhost image (Alpine-based) has
// them: seq, sleep … from Debian's busybox-static (its applets are links
// to it), and dash as /bin/sh, bash (network-policy-api's suite starts its
// servers with /bin/bash -c), curl, GNU wget and OpenBSD's nc with the
// shared libraries they load (ldd's list, at the same paths, with the
// dynamic loader). busybox's own sh, wget and nc will not do: its static
// wget crashes (SIGSEGV) in a container, its nc lacks the `-v -t` the
// suites pass, and its sh runs its own applets before any program on
// PATH (Debian builds it so).
func (n *node) shellTools() []imagetar.File {
	t := n.t
	busybox := testenv.RequireProgram(t, "busybox", "/bin", "/usr/bin")
	out, err := exec.Command(busybox, "--list").Output()
	if err != nil {
		t.Fatalf("busybox --list: %v", err)
	}
	// Where each dynamic program goes in the image, and the host's.
	dynamic := []struct{ path, host string }{
		{"/bin/sh", testenv.RequireProgram(t, "dash", "/usr/bin", "/bin")},
		{"/bin/bash", testenv.RequireProgram(t, "bash", "/usr/bin", "/bin")},
		{"/usr/bin/curl", testenv.RequireProgram(t, "curl", "/usr/bin", "/bin")},
		{"/usr/bin/nc", testenv.RequireProgram(t, "nc.openbsd", "/usr/bin", "/bin")},
		{"/usr/bin/wget", testenv.RequireProgram(t, "wget", "/usr/bin", "/bin")},
	}
	files := []imagetar.File{{Path: "/bin/busybox", Data: readFile(t, busybox), Mode: 0o755}}
	for _, applet := range strings.Fields(string(out)) {
		if applet != "busybox" && !slices.ContainsFunc(dynamic, func(d struct{ path, host string }) bool { return filepath.Base(d.path) == applet }) &&
			applet != "wget" {
			files = append(files, imagetar.File{Path: "/bin/" + applet, Link: "busybox"})
		}
	}
	libs := map[string]bool{}
	for _, d := range dynamic {
		files = append(files, imagetar.File{Path: d.path, Data: readFile(t, d.host), Mode: 0o755})
		out, err := exec.Command("ldd", d.host).Output()
		if err != nil {
			t.Fatalf("ldd %s: %v", d.host, err)
		}
		for _, l := range strings.Split(string(out), "\n") {
			// "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x…)" or
			// "/lib64/ld-linux-x86-64.so.2 (0x…)"; linux-vdso has no file.
			f := strings.Fields(l)
			switch {
			case len(f) >= 3 && f[1] == "=>" && strings.HasPrefix(f[2], "/"):
				libs[filepath.Clean(f[2])] = true
			case len(f) >= 1 && strings.HasPrefix(f[0], "/"):
				libs[filepath.Clean(f[0])] = true
			}
		}
	}
	for lib := range libs {
		files = append(files, imagetar.File{Path: lib, Data: readFile(t, lib), Mode: 0o755})
	}
	return files
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// importAgnhost imports agnhost into containerd under the names the
// suites ask for, which e2e.test --list-images prints (the current one and
// older ones that some suites pin), and under extra names (those of
// network-policy-api's suite), and returns them. Like Kubernetes' own
// agnhost image, it runs `agnhost pause` when a pod gives no arguments.
func (n *node) importAgnhost(bins map[string]string, extra ...string) []string {
	t := n.t
	out, err := exec.Command(bins["e2e.test"], "--list-images").Output()
	if err != nil {
		t.Fatalf("e2e.test --list-images: %v", err)
	}
	var tags []string
	for _, l := range strings.Fields(string(out)) {
		if strings.Contains(l, "/e2e-test-images/agnhost:") {
			tags = append(tags, l)
		}
	}
	if len(tags) == 0 {
		t.Fatalf("e2e.test --list-images names no agnhost image:\n%s", out)
	}
	for _, e := range extra {
		if !slices.Contains(tags, e) {
			tags = append(tags, e)
		}
	}
	data, err := os.ReadFile(bins["agnhost"])
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(n.dir, "agnhost.tar")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	files := append([]imagetar.File{{Path: "/agnhost", Data: data, Mode: 0o755}}, n.shellTools()...)
	if _, err := imagetar.Write(f, imagetar.Image{
		Tags:         tags,
		Files:        files,
		Entrypoint:   []string{"/agnhost"},
		Cmd:          []string{"pause"},
		Architecture: runtime.GOARCH,
	}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	ctr := testenv.RequireProgram(t, "ctr", "/usr/sbin", "/usr/bin")
	n.run(ctr, "--address", n.ctrSock, "-n", "k8s.io", "images", "import", path)
	return tags
}

// runE2E runs e2e.test against the node, its output to logPath and its
// JUnit report to reportDir.
func (n *node) runE2E(e2e, reportDir, logPath, focus, skip string, extra ...string) error {
	log, err := os.Create(logPath)
	if err != nil {
		n.t.Fatal(err)
	}
	defer log.Close()
	args := []string{
		"--kubeconfig=" + n.kubeconfigPath,
		"--provider=skeleton",
		"--report-dir=" + reportDir,
		"--ginkgo.focus=" + focus,
		"--ginkgo.skip=" + skip,
		"--ginkgo.no-color",
		"--ginkgo.timeout=2h",
		// The node runs no cluster add-ons and kubelet logs are the
		// test's own to show.
		"--disable-log-dump",
		"--minStartupPods=0",
		"--allowed-not-ready-nodes=0",
		"--e2e-output-dir=" + filepath.Join(n.dir, "e2e-output"),
	}
	args = append(args, extra...)
	cmd := exec.Command(e2e, args...)
	cmd.Dir = n.dir
	cmd.Stdout, cmd.Stderr = log, log
	// e2e.test finds kubectl (--kubectl-path in extra, else on PATH);
	// HOME keeps its caches in the test's directory.
	cmd.Env = append(os.Environ(), "HOME="+n.dir)
	n.t.Logf("running e2e.test (log: %s)", logPath)
	return cmd.Run()
}

// specResult is one test of the suite and how it ended.
type specResult struct {
	Name   string // without the [It] and [sig-network] decorations
	Result string // passed, failed or skipped
	Reason string // why it failed or was skipped
}

// readJUnit reads the tests of suite (the text their names hold, such as
// netpolSuite) from e2e.test's JUnit report, leaving out the suite's own
// setup and the specs of other suites; a test skipped for what the
// machine lacks says so.
func readJUnit(path, suite string, lacking []lack) ([]specResult, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read JUnit report: %w", err)
	}
	var doc struct {
		Suites []struct {
			Cases []struct {
				Name    string `xml:"name,attr"`
				Status  string `xml:"status,attr"`
				Skipped *struct {
					Message string `xml:"message,attr"`
				} `xml:"skipped"`
				Failure *struct {
					Message string `xml:"message,attr"`
					Text    string `xml:",chardata"`
				} `xml:"failure"`
				Error *struct {
					Message string `xml:"message,attr"`
					Text    string `xml:",chardata"`
				} `xml:"error"`
			} `xml:"testcase"`
		} `xml:"testsuite"`
	}
	if err := xml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("parse JUnit report %s: %w", path, err)
	}
	var out []specResult
	for _, s := range doc.Suites {
		for _, c := range s.Cases {
			if !strings.Contains(c.Name, suite) {
				continue
			}
			// Anything but a pass or a skip (a failure, a panic, a
			// timeout, an interruption) fails.
			r := specResult{Name: cleanName(c.Name), Result: "failed"}
			switch {
			case c.Failure != nil:
				r.Reason = firstLines(c.Failure.Message+"\n"+c.Failure.Text, 6)
			case c.Error != nil:
				r.Reason = firstLines(c.Error.Message+"\n"+c.Error.Text, 6)
			case c.Status == "passed":
				r.Result = "passed"
			case c.Skipped != nil || c.Status == "skipped" || c.Status == "pending":
				r.Result = "skipped"
				r.Reason = skipReason(c.Name, lacking)
				// A test that skipped itself (too few nodes, a
				// provider it needs) says why after "skipped - ".
				if c.Skipped != nil && strings.HasPrefix(c.Skipped.Message, "skipped - ") {
					r.Reason = firstLines(strings.TrimPrefix(c.Skipped.Message, "skipped - "), 2)
				}
			default:
				r.Reason = "ended " + c.Status
			}
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b specResult) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// skipReason is why a test the run left out was left out.
func skipReason(name string, lacking []lack) string {
	for _, u := range lacking {
		if u.pattern.MatchString(name) {
			return u.reason
		}
	}
	return "not in this run (APIARY_CONFORMANCE=all runs it)"
}

var decorations = regexp.MustCompile(`^\[It\] |\[sig-network\] `)

func cleanName(s string) string { return strings.TrimSpace(decorations.ReplaceAllString(s, "")) }

func firstLines(s string, n int) string {
	var lines []string
	sc := bufio.NewScanner(strings.NewReader(strings.TrimSpace(s)))
	for sc.Scan() && len(lines) < n {
		if l := strings.TrimSpace(sc.Text()); l != "" {
			lines = append(lines, l)
		}
	}
	return strings.Join(lines, " ")
}

// conformanceIntro heads docs/conformance.md, whose sections, one per
// cluster shape, each run of the suite rewrites (writeShapeSection).
const conformanceIntro = `# NetworkPolicy conformance

Kubernetes' own NetworkPolicy e2e suite (` + "`k8s.io/kubernetes/test/e2e/network/netpol`" + `,
v1.36.4) run against apiary on test/cluster's real clusters (kubelet, containerd,
runc, the bridge CNI plugin; no kube-proxy: Service cluster IPs, which the
suite probes, go through apiary's socket load balancer), one section per
cluster shape. apiary is installed from ` + "`deploy/`" + ` with its image; the
suite's ` + "`agnhost`" + ` image is built from Kubernetes' sources and imported
under the name the suite asks for.

Generated: ` + "`make conformance`" + ` (test/cluster ` + "`TestNetworkPolicyConformance`" + `
with APIARY_CONFORMANCE=all) rewrites "1 node", ` + "`make conformance-multinode`" + `
(` + "`TestNetworkPolicyConformanceMultiNode`" + `) the section of its number of
nodes; do not edit by hand. CI runs a part of the suite (` + "`ciSubset`" + ` in
test/cluster/conformance_test.go) on every change.

Kubernetes' Services suite has its own page: [conformance-services.md](conformance-services.md); the Services specs that need more than one node have theirs: [conformance-multinode.md](conformance-multinode.md);
network-policy-api's ClusterNetworkPolicy suite too: [conformance-clusternetpol.md](conformance-clusternetpol.md).
`

// writeShapeSection rewrites, in the report at path, the section headed
// "## <shape>" with a run's results (about says where it ran), keeping the
// other shapes' sections; a missing report is made with conformanceIntro.
func writeShapeSection(path, shape, about string, results []specResult, took time.Duration) error {
	old, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	sections := map[string]string{}
	var order []string
	text := string(old)
	if i := strings.Index(text, "\n## "); i >= 0 {
		for _, part := range strings.Split(text[i+1:], "\n## ") {
			part = strings.TrimPrefix(part, "## ")
			head, body, _ := strings.Cut(part, "\n")
			sections[head] = body
			order = append(order, head)
		}
	}
	var b bytes.Buffer
	b.WriteString(about)
	b.WriteString("\n\n")
	writeResults(&b, results, took)
	if _, ok := sections[shape]; !ok {
		order = append(order, shape)
	}
	sections[shape] = "\n" + b.String()
	// Sections by number of nodes, whatever order the runs came in.
	nodes := func(h string) int {
		n, _ := strconv.Atoi(strings.Fields(h + " 0")[0])
		return n
	}
	slices.SortStableFunc(order, func(a, b string) int { return nodes(a) - nodes(b) })
	out := conformanceIntro
	for _, h := range order {
		out += "\n## " + h + "\n" + strings.TrimRight(sections[h], "\n") + "\n"
	}
	return os.WriteFile(path, []byte(out), 0o644)
}

// writeResults writes the counts and the table of a run's results.
func writeResults(b *bytes.Buffer, results []specResult, took time.Duration) {
	count := map[string]int{}
	for _, r := range results {
		count[r.Result]++
	}
	fmt.Fprintf(b, "**%d passed, %d failed, %d skipped** of %d, in %s.\n\n| Test | Result | Reason |\n| --- | --- | --- |\n",
		count["passed"], count["failed"], count["skipped"], len(results), took.Round(time.Second))
	for _, r := range results {
		fmt.Fprintf(b, "| %s | %s | %s |\n", mdEscape(r.Name), r.Result, mdEscape(r.Reason))
	}
}

func mdEscape(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(s)
}
