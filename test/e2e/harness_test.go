package e2e

// The harness: the binary built once, outside processes with their logs,
// agents started with a temporary state, config and pin directory, and the
// ways a user reads an agent (HTTP, the CLI, /proc).

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// repoRoot is the repository, relative to this package's directory, where
// go test runs the tests.
const repoRoot = "../.."

// apiaryBin is the apiary binary TestMain built.
var apiaryBin string

// cniBin is the apiary-cni plugin TestMain built (or found next to
// $APIARY_E2E_BIN).
var cniBin string

// binEnv names a prebuilt apiary binary to test instead of building one
// (a release artifact, say).
const binEnv = "APIARY_E2E_BIN"

// TestMain builds apiary once, as a user would (`go build ./daemon`), for
// every test of the package; or takes the binary $APIARY_E2E_BIN names.
func TestMain(m *testing.M) {
	// The test binary doubles as the helper processes some tests run in
	// cgroups (see policy_test.go).
	if code, ok := runHelper(); ok {
		os.Exit(code)
	}
	if bin := os.Getenv(binEnv); bin != "" {
		abs, err := filepath.Abs(bin)
		if err != nil {
			fmt.Fprintln(os.Stderr, "e2e:", err)
			os.Exit(1)
		}
		apiaryBin = abs
		cniBin = filepath.Join(filepath.Dir(abs), "apiary-cni")
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "apiary-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	apiaryBin = filepath.Join(dir, "apiary")
	build := exec.Command("go", "build", "-o", apiaryBin, "./daemon")
	build.Dir = repoRoot
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: go build ./daemon: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	cniBin = filepath.Join(dir, "apiary-cni")
	build = exec.Command("go", "build", "-o", cniBin, "./cni")
	build.Dir = repoRoot
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: go build ./cni: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// Timeouts. Generous: the machine may be busy building other packages.
const (
	waitTimeout = 30 * time.Second // for an agent to get somewhere
	stopTimeout = 10 * time.Second // for an agent to exit after SIGTERM
)

// freePort returns a loopback port that was free for both TCP and UDP a
// moment ago.
func freePort(t testing.TB) int {
	t.Helper()
	for range 20 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		pc, err := net.ListenPacket("udp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		ln.Close()
		if err == nil {
			pc.Close()
			return port
		}
	}
	t.Fatal("no loopback port free for both TCP and UDP")
	return 0
}

// writeFile writes data to path atomically (a temporary file renamed over
// it), as an editor or a config management tool would, so that a watcher
// never reads half a file.
func writeFile(t testing.TB, path, data string) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// process is an outside program the test started. It is stopped (SIGTERM,
// then SIGKILL) when the test ends, and killed if the test binary dies
// first; when the test fails, the end of its output is logged.
type process struct {
	name string
	cmd  *exec.Cmd
	log  *testenv.LogBuffer
	done chan struct{} // closed when the process has exited
	err  error         // its exit status, once done is closed
	// stopped: stop was called (by the test, or by a cleanup).
	stopped bool
}

// startProcess runs path with args and env (added to the test's
// environment without its APIARY_ variables).
func startProcess(t testing.TB, name string, env []string, path string, args ...string) *process {
	t.Helper()
	p := &process{name: name, cmd: exec.Command(path, args...), log: &testenv.LogBuffer{}, done: make(chan struct{})}
	p.cmd.Env = append(cleanEnv(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	// Cleanups run last first: stop, then show the log.
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("==== %s (%s): last output ====\n%s", p.name, strings.Join(append(env, p.cmd.Args...), " "), p.log.Tail(60))
		}
	})
	t.Cleanup(func() {
		if !p.stopped {
			p.stop()
		}
	})
	return p
}

// cleanEnv is the test's environment without APIARY_ variables (such as
// APIARY_STRICT), so that only what a test sets reaches apiary.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "APIARY_") {
			env = append(env, kv)
		}
	}
	return env
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM and waits for the exit, killing the process after
// stopTimeout. It returns the exit error and how long the exit took.
func (p *process) stop() (time.Duration, error) {
	p.stopped = true
	start := time.Now()
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return time.Since(start), p.err
	case <-time.After(stopTimeout):
		p.cmd.Process.Kill()
		<-p.done
		return time.Since(start), fmt.Errorf("still running %s after SIGTERM; killed", stopTimeout)
	}
}

// findLog returns the first JSON log record whose msg is msg, or nil.
func (p *process) findLog(msg string) map[string]any {
	sc := bufio.NewScanner(strings.NewReader(p.log.String()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var rec map[string]any
		if json.Unmarshal(sc.Bytes(), &rec) == nil && rec["msg"] == msg {
			return rec
		}
	}
	return nil
}

// agentOptions is what a test chooses about an agent.
type agentOptions struct {
	// configDir is --config-dir; empty: a new empty directory.
	configDir string
	// flags are more agent flags.
	flags []string
	// viaEnv passes --api-addr, --state-dir, --bpf-pin-dir and
	// --config-dir as APIARY_ environment variables instead of flags.
	viaEnv bool
	// startsDegraded: the test expects the agent to be unhealthy at
	// first (it takes away something the agent needs); starting waits
	// only for /healthz to answer.
	startsDegraded bool
}

// agent is an `apiary agent` with its own directories, started and
// restarted as processes of the binary.
type agent struct {
	name      string
	opts      agentOptions
	addr      string // the API's host:port
	stateDir  string
	pinDir    string
	configDir string
	proc      *process // the current (or last) process
	runs      int
}

// startAgent starts an agent on a fresh state directory, pin directory (on
// bpffs) and API port, and waits until /healthz answers 200. It needs root:
// the test skips without it (fails under APIARY_STRICT=1).
func startAgent(t testing.TB, opts agentOptions) *agent {
	t.Helper()
	testenv.RequireRoot(t)
	a := &agent{
		name:     "agent",
		opts:     opts,
		addr:     net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t))),
		stateDir: t.TempDir(),
		// Removed (which also detaches what the agent linked there) after
		// the agent has stopped: cleanups run last first.
		pinDir:    testenv.BPFPinDir(t),
		configDir: opts.configDir,
	}
	if a.configDir == "" {
		a.configDir = t.TempDir()
	}
	a.start(t)
	return a
}

// start starts the agent's process with its options plus extra flags
// (which win over earlier ones) and waits until it is healthy.
func (a *agent) start(t testing.TB, extraFlags ...string) {
	t.Helper()
	a.runs++
	name := a.name
	if a.runs > 1 {
		name = fmt.Sprintf("%s (run %d)", a.name, a.runs)
	}
	dirs := map[string]string{
		"api-addr":    a.addr,
		"state-dir":   a.stateDir,
		"bpf-pin-dir": a.pinDir,
		"config-dir":  a.configDir,
	}
	args := []string{"agent", "--log-format=json"}
	var env []string
	for _, flag := range []string{"api-addr", "state-dir", "bpf-pin-dir", "config-dir"} {
		if a.opts.viaEnv {
			env = append(env, "APIARY_"+strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))+"="+dirs[flag])
		} else {
			args = append(args, "--"+flag+"="+dirs[flag])
		}
	}
	args = append(append(args, a.opts.flags...), extraFlags...)
	p := startProcess(t, name, env, apiaryBin, args...)
	a.proc = p
	// Runs before startProcess's cleanups: every agent must exit 0, at
	// once, on SIGTERM, and not before it is asked to.
	t.Cleanup(func() {
		if p.stopped {
			return
		}
		if p.exited() {
			t.Errorf("%s exited before it was stopped: %v", p.name, p.err)
			return
		}
		if took, err := p.stop(); err != nil {
			t.Errorf("%s did not exit cleanly on SIGTERM: %v", p.name, err)
		} else {
			t.Logf("%s exited with status 0 %s after SIGTERM", p.name, took.Round(time.Millisecond))
		}
	})
	if a.opts.startsDegraded {
		a.waitAnswers(t)
		return
	}
	a.waitHealthy(t)
}

// stop sends SIGTERM and checks that the agent exits with status 0 within
// stopTimeout.
func (a *agent) stop(t testing.TB) {
	t.Helper()
	if a.proc.exited() {
		t.Fatalf("%s had exited before it was stopped: %v", a.proc.name, a.proc.err)
	}
	took, err := a.proc.stop()
	if err != nil {
		t.Fatalf("%s did not exit cleanly on SIGTERM: %v", a.proc.name, err)
	}
	t.Logf("%s exited with status 0 %s after SIGTERM", a.proc.name, took.Round(time.Millisecond))
}

// restart stops the agent and starts it again on the same directories and
// address, with extra flags, as an upgrade or a node reboot would.
func (a *agent) restart(t testing.TB, extraFlags ...string) {
	t.Helper()
	a.stop(t)
	a.start(t, extraFlags...)
}

// pid is the agent process's ID.
func (a *agent) pid() int { return a.proc.cmd.Process.Pid }

func (a *agent) url(path string) string { return "http://" + a.addr + path }

// alive fails the test at once if the agent has exited.
func (a *agent) alive(t testing.TB) {
	t.Helper()
	if a.proc.exited() {
		t.Fatalf("%s exited: %v", a.proc.name, a.proc.err)
	}
}

// waitHealthy waits until GET /healthz answers 200.
func (a *agent) waitHealthy(t testing.TB) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, a.proc.name+" /healthz 200", func() (bool, string) {
		a.alive(t)
		code, body, err := httpGet(a.url("/healthz"))
		if err != nil {
			return false, err.Error()
		}
		return code == http.StatusOK, fmt.Sprintf("%d %s", code, body)
	})
}

// waitAnswers waits until /healthz answers, healthy or not.
func (a *agent) waitAnswers(t testing.TB) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, a.proc.name+" /healthz answering", func() (bool, string) {
		a.alive(t)
		code, body, err := httpGet(a.url("/healthz"))
		if err != nil {
			return false, err.Error()
		}
		return code == http.StatusOK || code == http.StatusServiceUnavailable, fmt.Sprintf("%d %s", code, body)
	})
}

// waitLog waits until the agent logs a record with message msg, and
// returns it.
func (a *agent) waitLog(t testing.TB, msg string) map[string]any {
	t.Helper()
	var rec map[string]any
	testenv.Eventually(t, waitTimeout, a.proc.name+" to log "+strconv.Quote(msg), func() (bool, string) {
		if rec = a.proc.findLog(msg); rec != nil {
			return true, ""
		}
		a.alive(t)
		return false, "not logged yet"
	})
	return rec
}

// httpGet returns the status code and body of GET url.
func httpGet(url string) (int, string, error) {
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), err
}

// dump reads a table from /statedb/dump/{table} into rows, a pointer to a
// slice of the table's objects.
func (a *agent) dump(table string, rows any) error {
	code, body, err := httpGet(a.url("/statedb/dump/" + table))
	if err != nil {
		return err
	}
	if code != http.StatusOK {
		return fmt.Errorf("GET /statedb/dump/%s: %d %s", table, code, body)
	}
	var all map[string]json.RawMessage
	if err := json.Unmarshal([]byte(body), &all); err != nil {
		return fmt.Errorf("GET /statedb/dump/%s: %w: %s", table, err, body)
	}
	raw, ok := all[table]
	if !ok {
		return fmt.Errorf("GET /statedb/dump/%s has no %q: %s", table, table, body)
	}
	return json.Unmarshal(raw, rows)
}

// metric returns the value of an unlabelled metric from /metrics.
func (a *agent) metric(name string) (float64, error) {
	code, body, err := httpGet(a.url("/metrics"))
	if err != nil {
		return 0, err
	}
	if code != http.StatusOK {
		return 0, fmt.Errorf("GET /metrics: %d", code)
	}
	for line := range strings.Lines(body) {
		if f := strings.Fields(line); len(f) == 2 && f[0] == name {
			return strconv.ParseFloat(f[1], 64)
		}
	}
	return 0, fmt.Errorf("no metric %s in /metrics", name)
}

// runApiary runs the apiary CLI with args and env (added to the test's
// environment without its APIARY_ variables) and returns its stdout, or an
// error with its stderr.
func runApiary(env []string, args ...string) (string, error) {
	cmd := exec.Command(apiaryBin, args...)
	cmd.Env = append(cleanEnv(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("apiary %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// db runs `apiary db ARGS --server <the agent>`.
func (a *agent) db(args ...string) (string, error) {
	return runApiary(nil, append(append([]string{"db"}, args...), "--server", "http://"+a.addr)...)
}

// bpf runs `apiary bpf ARGS --bpf-pin-dir <the agent's>`.
func (a *agent) bpf(args ...string) (string, error) {
	return runApiary(nil, append(append([]string{"bpf"}, args...), "--bpf-pin-dir", a.pinDir)...)
}

// showJSON runs `apiary db show TABLE -o json` against the agent and decodes
// the answer into rows.
func (a *agent) showJSON(table string, rows any) error {
	out, err := a.db("show", table, "-o", "json")
	if err != nil {
		return err
	}
	if err := json.Unmarshal([]byte(out), rows); err != nil {
		return fmt.Errorf("apiary db show %s -o json: %w:\n%s", table, err, out)
	}
	return nil
}

// ipcacheMap returns `apiary bpf ipcache list` as prefix → identity.
func (a *agent) ipcacheMap() (map[string]uint32, error) {
	return a.prefixMap("ipcache")
}

// prefixMap is ipcacheMap for `apiary bpf <cmd> list`: ipcache or
// policy-prefixes.
func (a *agent) prefixMap(cmd string) (map[string]uint32, error) {
	out, err := a.bpf(cmd, "list")
	if err != nil {
		return nil, err
	}
	ids := map[string]uint32{}
	for line := range strings.Lines(out) {
		f := strings.Fields(line)
		if len(f) < 2 || !strings.HasPrefix(f[1], "identity=") {
			return nil, fmt.Errorf("apiary bpf %s list: unexpected line %q", cmd, line)
		}
		id, err := strconv.ParseUint(strings.TrimPrefix(f[1], "identity="), 10, 32)
		if err != nil {
			return nil, fmt.Errorf("apiary bpf %s list: %q: %w", cmd, line, err)
		}
		ids[f[0]] = uint32(id)
	}
	return ids, nil
}

// procStats is what /proc says about a process.
type procStats struct {
	cpuTicks uint64 // utime + stime, in clock ticks (USER_HZ, 100 a second)
	rssKB    uint64 // VmRSS
	fds      int    // entries of /proc/PID/fd
}

// clockTicks is USER_HZ, the unit of utime and stime in /proc/PID/stat:
// 100 on every Linux architecture Go supports.
const clockTicks = 100

func readProcStats(pid int) (procStats, error) {
	var s procStats
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return s, err
	}
	// Fields after the command name (which may hold spaces) start with the
	// state, field 3; utime and stime are fields 14 and 15.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return s, fmt.Errorf("/proc/%d/stat: %q", pid, stat)
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 13 {
		return s, fmt.Errorf("/proc/%d/stat: %q", pid, stat)
	}
	utime, err1 := strconv.ParseUint(f[11], 10, 64)
	stime, err2 := strconv.ParseUint(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return s, err
	}
	s.cpuTicks = utime + stime

	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return s, err
	}
	for line := range strings.Lines(string(status)) {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				return s, fmt.Errorf("/proc/%d/status: %q: %w", pid, line, err)
			}
			s.rssKB = kb
		}
	}
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return s, err
	}
	s.fds = len(fds)
	return s, nil
}

// runInCgroup runs a program started directly inside the cgroup dir
// (clone3 with CLONE_INTO_CGROUP) and returns its output.
func runInCgroup(dir, path string, args ...string) (string, error) {
	f, err := os.Open(dir)
	if err != nil {
		return "", err
	}
	defer f.Close()
	cmd := exec.Command(path, args...)
	cmd.Env = cleanEnv()
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd())}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s (in cgroup %s): %w: %s", path, strings.Join(args, " "), dir, err, out)
	}
	return string(out), nil
}
