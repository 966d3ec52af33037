package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

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
		}{
			{"--api-addr=nonsense", "--api-addr"},
			{"--api-addr=127.0.0.1:99999", "--api-addr"},
			{"--state-dir=/etc/hostname/sub", "--state-dir"},
			{"--log-level=loud", "--log-level"},
			{"--log-format=xml", "--log-format"},
			{"--bpf-pin-dir=" + t.TempDir(), "not on a bpffs mount"},
			{"--no-such-flag", "unknown flag"},
		} {
			t.Run(tc.flag, func(t *testing.T) {
				cmd := exec.Command(bin, "agent", "--state-dir="+t.TempDir(), "--api-addr=127.0.0.1:0", tc.flag)
				out, err := cmd.CombinedOutput()
				var exitErr *exec.ExitError
				if err == nil || !errors.As(err, &exitErr) || exitErr.ExitCode() == 0 {
					t.Fatalf("want a non-zero exit, got %v:\n%s", err, out)
				}
				lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
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
