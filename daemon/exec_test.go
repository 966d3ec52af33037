package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// buildBinary builds the apiary binary once per test run, as a user would.
func buildBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "apiary")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %s\n%s", err, out)
	}
	return bin
}

func TestBinary(t *testing.T) {
	bin := buildBinary(t)

	t.Run("help lists every flag with its default", func(t *testing.T) {
		out, err := exec.Command(bin, "agent", "--help").CombinedOutput()
		if err != nil {
			t.Fatalf("agent --help: %s\n%s", err, out)
		}
		for _, want := range []string{
			`--api-addr string`, `(default "127.0.0.1:9234")`,
			`--state-dir string`, `(default "/var/run/apiary")`,
			`--bpf-pin-dir string`, `(default "/sys/fs/bpf/apiary")`,
			`--config-dir string`, `--kubeconfig string`, `--node-name string`,
			`--log-format string`, `(default "text")`,
			`--log-level string`, `(default "info")`,
		} {
			if !strings.Contains(string(out), want) {
				t.Errorf("agent --help lacks %q:\n%s", want, out)
			}
		}
	})

	t.Run("version", func(t *testing.T) {
		out, err := exec.Command(bin, "version").CombinedOutput()
		if err != nil {
			t.Fatalf("version: %s\n%s", err, out)
		}
		for _, want := range []string{"apiary ", "git commit: ", "go: go1."} {
			if !strings.Contains(string(out), want) {
				t.Errorf("version output lacks %q:\n%s", want, out)
			}
		}
	})

	testenv.RequireRoot(t)

	t.Run("bad flags exit non-zero with one line", func(t *testing.T) {
		for _, tc := range []struct {
			flag, want string
			// afterInfo: checked when a feature's cell is built, after the
			// info lines of the cells built before it; the error is the
			// last line.
			afterInfo bool
		}{
			{"--api-addr=nonsense", "--api-addr", false},
			{"--api-addr=127.0.0.1:99999", "--api-addr", false},
			{"--state-dir=/etc/hostname/sub", "--state-dir", false},
			{"--log-level=loud", "--log-level", false},
			{"--log-format=xml", "--log-format", false},
			{"--bpf-pin-dir=" + t.TempDir(), "not on a bpffs mount", false},
			{"--no-such-flag", "unknown flag", false},
			{"--dns-proxy-addr=localhost:5353", "--dns-proxy-addr", true},
			{"--dns-proxy-addr=127.0.0.1", "--dns-proxy-addr", true},
			{"--dns-proxy-addr=127.0.0.1:0 --dns-upstream=dns.example:53", "--dns-upstream", true},
			{"--dns-proxy-addr=127.0.0.1:0 --dns-upstream=127.0.0.1:0", "--dns-upstream", true},
		} {
			t.Run(tc.flag, func(t *testing.T) {
				args := append([]string{"agent", "--state-dir=" + t.TempDir(), "--api-addr=127.0.0.1:0"}, strings.Fields(tc.flag)...)
				cmd := exec.Command(bin, args...)
				out, err := cmd.CombinedOutput()
				var exitErr *exec.ExitError
				if err == nil || !errors.As(err, &exitErr) || exitErr.ExitCode() == 0 {
					t.Fatalf("want a non-zero exit, got %v:\n%s", err, out)
				}
				lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
				if tc.afterInfo {
					for _, l := range lines[:len(lines)-1] {
						if !strings.Contains(l, " INF ") {
							t.Fatalf("want info lines, then the error, got:\n%s", out)
						}
					}
					lines = lines[len(lines)-1:]
				}
				if len(lines) != 1 || !strings.Contains(lines[0], tc.want) {
					t.Fatalf("want one line mentioning %q, got:\n%s", tc.want, out)
				}
			})
		}
	})

	t.Run("starts, serves and stops", func(t *testing.T) {
		pinDir := testenv.BPFPinDir(t)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		start := time.Now()
		cmd := exec.CommandContext(ctx, bin, "agent",
			"--api-addr=127.0.0.1:0", "--state-dir="+t.TempDir(), "--bpf-pin-dir="+pinDir,
			"--log-format=json")
		stderr, err := cmd.StderrPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		addr := waitForLog(t, stderr, "API listening")
		var healthy time.Duration
		for {
			resp, err := http.Get("http://" + addr + "/healthz")
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					healthy = time.Since(start)
					break
				}
			}
			if ctx.Err() != nil {
				t.Fatalf("agent never became healthy: %v", err)
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Logf("agent process started and served /healthz 200 after %s", healthy)
		for _, path := range []string{"/statedb/dump", "/metrics"} {
			resp, err := http.Get("http://" + addr + path)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("GET %s: %s", path, resp.Status)
			}
		}
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Wait(); err != nil {
			t.Fatalf("agent did not stop cleanly on SIGTERM: %s", err)
		}
	})

	t.Run("SIGTERM while starting stops cleanly", func(t *testing.T) {
		// Hive handles signals only once started; a signal during the
		// build of the cells must still run the stop hooks.
		cmd := exec.Command(bin, "agent", "--api-addr=127.0.0.1:0", "--state-dir="+t.TempDir(),
			"--bpf-pin-dir="+testenv.BPFPinDir(t), "--log-format=json")
		stderr, err := cmd.StderrPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill() })
		scanner := bufio.NewScanner(stderr)
		var signalled, stopped bool
		for scanner.Scan() {
			var rec map[string]any
			if json.Unmarshal(scanner.Bytes(), &rec) != nil {
				continue
			}
			// The first record of a cell: the hive is being built.
			if _, ok := rec["module"]; ok && !signalled {
				if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
					t.Fatal(err)
				}
				signalled = true
			}
			stopped = stopped || rec["msg"] == "Stopped hive"
		}
		if err := cmd.Wait(); err != nil || !signalled || !stopped {
			t.Fatalf("agent signalled while starting: exit %v, signalled %t, stop hooks ran %t", err, signalled, stopped)
		}
	})

	t.Run("one agent per state and pin directory", func(t *testing.T) {
		stateDir, pinDir := t.TempDir(), testenv.BPFPinDir(t)
		first := startAgent(t, bin, "--state-dir="+stateDir, "--bpf-pin-dir="+pinDir)
		pid := strconv.Itoa(first.Process.Pid)

		for _, tc := range []struct {
			name, stateDir, pinDir, want string
		}{
			{"same state dir", stateDir, testenv.BPFPinDir(t),
				"apiary: invalid configuration: another apiary agent (pid " + pid + ") holds " +
					filepath.Join(stateDir, "apiary.lock") + ": stop it or give this agent another --state-dir"},
			{"same pin dir", t.TempDir(), pinDir,
				"apiary: invalid configuration: another apiary agent (pid " + pid + ") holds " +
					pinDir + ": stop it or give this agent another --bpf-pin-dir"},
			{"both", stateDir, pinDir, "holds " + filepath.Join(stateDir, "apiary.lock")},
		} {
			t.Run(tc.name, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
				defer cancel()
				start := time.Now()
				out, err := exec.CommandContext(ctx, bin, "agent", "--api-addr=127.0.0.1:0",
					"--state-dir="+tc.stateDir, "--bpf-pin-dir="+tc.pinDir).CombinedOutput()
				took := time.Since(start)
				var exitErr *exec.ExitError
				if !errors.As(err, &exitErr) || exitErr.ExitCode() == 0 || ctx.Err() != nil {
					t.Fatalf("second agent: want a non-zero exit, got %v after %s:\n%s", err, took, out)
				}
				lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
				if len(lines) != 1 || !strings.Contains(lines[0], tc.want) {
					t.Fatalf("second agent: want one line with %q, got:\n%s", tc.want, out)
				}
				t.Logf("second agent refused after %s: %s", took, lines[0])
			})
		}

		// The lock dies with its holder, however it dies.
		if err := first.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		first.Wait()
		startAgent(t, bin, "--state-dir="+stateDir, "--bpf-pin-dir="+pinDir)
	})

	t.Run("a pinned map of another layout stops the agent with the reason", func(t *testing.T) {
		for _, tc := range []struct {
			name string
			spec *ebpf.MapSpec
			want string
		}{
			{bpf.LB4ServicesMap, &ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 12, MaxEntries: 64},
				"pinned map lb4_services has key size 8, want 12: its entries cannot be converted; remove it (rm "},
			{bpf.IPCacheMap, &ebpf.MapSpec{Type: ebpf.LPMTrie, KeySize: 8, ValueSize: 24, MaxEntries: 64, Flags: unix.BPF_F_NO_PREALLOC},
				"pinned map ipcache has key size 8, want 24: its entries cannot be converted; remove it (rm "},
		} {
			t.Run(tc.name, func(t *testing.T) {
				stateDir, pinDir := t.TempDir(), testenv.BPFPinDir(t)
				path := filepath.Join(pinDir, tc.name)
				stale, err := ebpf.NewMap(tc.spec)
				if err != nil {
					t.Fatal(err)
				}
				err = stale.Pin(path)
				stale.Close()
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
				defer cancel()
				out, err := exec.CommandContext(ctx, bin, "agent", "--api-addr=127.0.0.1:0",
					"--state-dir="+stateDir, "--bpf-pin-dir="+pinDir).CombinedOutput()
				var exitErr *exec.ExitError
				if !errors.As(err, &exitErr) || exitErr.ExitCode() == 0 || ctx.Err() != nil {
					t.Fatalf("want a non-zero exit at start, got %v:\n%s", err, out)
				}
				lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
				last := lines[len(lines)-1]
				if !strings.HasPrefix(last, "apiary: failed to start: ") || !strings.Contains(last, tc.want+path+")") {
					t.Fatalf("want a last line with %q, got:\n%s", tc.want, out)
				}

				// Doing what it says is enough.
				if err := os.Remove(path); err != nil {
					t.Fatal(err)
				}
				startAgent(t, bin, "--state-dir="+stateDir, "--bpf-pin-dir="+pinDir)
			})
		}
	})
}

// startAgent starts the agent with a free API port and the given flags,
// waits until it has started and serves /healthz with 200, and kills it
// when the test ends.
func startAgent(t *testing.T, bin string, flags ...string) *exec.Cmd {
	t.Helper()
	args := append([]string{"agent", "--api-addr=127.0.0.1:0", "--log-format=json"}, flags...)
	cmd := exec.Command(bin, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	var addr string
	scanner := bufio.NewScanner(stderr)
	for addr == "" || !strings.Contains(scanner.Text(), `"msg":"Started hive"`) {
		if !scanner.Scan() {
			t.Fatalf("agent %v exited before it started", flags)
		}
		var rec map[string]any
		if json.Unmarshal(scanner.Bytes(), &rec) == nil && rec["msg"] == "API listening" {
			addr, _ = rec["address"].(string)
		}
	}
	go func() { // keep draining so the agent never blocks on stderr
		for scanner.Scan() {
		}
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return cmd
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent %v never became healthy: %v", flags, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitForLog reads JSON log records until one has the given message and
// returns its "address" attribute.
func waitForLog(t *testing.T, r io.Reader, msg string) string {
	t.Helper()
	scanner := bufio.NewScanner(r)
	for scanner.Scan() {
		var rec map[string]any
		if json.Unmarshal(scanner.Bytes(), &rec) != nil {
			t.Fatalf("log line is not JSON: %s", scanner.Text())
		}
		if rec["msg"] == msg {
			addr, _ := rec["address"].(string)
			go func() { // keep draining so the agent never blocks on stderr
				for scanner.Scan() {
				}
			}()
			return addr
		}
	}
	t.Fatalf("agent exited before logging %q", msg)
	return ""
}
