// Package testenv decides what a test may assume about the machine it runs on.
//
// Tests that need a privilege or an outside program call Skip (or one of the
// Require helpers). Normally that skips the test with the reason; with
// APIARY_STRICT=1 in the environment (as CI sets it) it fails the test instead,
// so that nothing is silently skipped in CI.
package testenv

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
)

// StrictEnv is the environment variable that turns skips into failures.
const StrictEnv = "APIARY_STRICT"

// Strict reports whether skips are to be treated as failures.
func Strict() bool {
	return os.Getenv(StrictEnv) == "1"
}

// Skip skips the test with the given reason, or fails it under APIARY_STRICT=1.
func Skip(tb testing.TB, reason string) {
	tb.Helper()
	if Strict() {
		tb.Fatalf("%s=1 forbids skipping: %s", StrictEnv, reason)
	}
	tb.Skip(reason)
}

// RequireRoot skips (or fails under APIARY_STRICT=1) unless the test runs as root.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		Skip(tb, "needs root (BPF maps, bpffs, namespaces)")
	}
}

// RequireProgram returns the path of an outside program, looking in PATH and
// then in the extra directories given; it skips (or fails under
// APIARY_STRICT=1) when the program is nowhere to be found.
func RequireProgram(tb testing.TB, name string, extraDirs ...string) string {
	tb.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, dir := range extraDirs {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p
		}
	}
	Skip(tb, "needs the program "+name+" (run scripts/install-deps.sh)")
	return ""
}

// BPFPinDir returns a fresh directory on bpffs for the test's pinned maps and
// removes it when the test ends. bpffs is mounted at /sys/fs/bpf when needed.
func BPFPinDir(tb testing.TB) string {
	tb.Helper()
	RequireRoot(tb)
	if err := bpf.EnsureFS(bpf.DefaultFSRoot); err != nil {
		Skip(tb, "bpffs unavailable: "+err.Error())
	}
	dir, err := os.MkdirTemp(bpf.DefaultFSRoot, "apiary-test-")
	if err != nil {
		Skip(tb, "cannot create a directory on bpffs: "+err.Error())
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// Cgroup returns a fresh cgroup v2 directory for the test and removes it
// when the test ends, once the processes the test put in it have exited.
func Cgroup(tb testing.TB) string {
	tb.Helper()
	RequireRoot(tb)
	root, err := Cgroup2Mount()
	if err != nil {
		Skip(tb, "no cgroup v2 mount: "+err.Error())
	}
	dir, err := os.MkdirTemp(root, "apiary-test-")
	if err != nil {
		Skip(tb, "cannot create a cgroup: "+err.Error())
	}
	tb.Cleanup(func() {
		// A process that has just exited may still be counted in it.
		deadline := time.Now().Add(2 * time.Second)
		for {
			err := os.Remove(dir)
			if err == nil || errors.Is(err, os.ErrNotExist) {
				return
			}
			if time.Now().After(deadline) {
				tb.Errorf("remove cgroup %s: %s", dir, err)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	return dir
}

// EnterCgroup moves the whole process into the cgroup v2 directory dir (a
// socket belongs to the cgroup of the process that creates it), and back
// to the cgroup it was in when the test ends. The way back is registered
// now, so it runs before the removal of a dir made earlier by Cgroup.
// Tests that use it must not run in parallel.
func EnterCgroup(tb testing.TB, dir string) {
	tb.Helper()
	mount, err := Cgroup2Mount()
	if err != nil {
		Skip(tb, "no cgroup v2 mount: "+err.Error())
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		tb.Fatal(err)
	}
	var orig string
	for line := range strings.SplitSeq(strings.TrimSpace(string(self)), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			orig = filepath.Join(mount, p)
		}
	}
	if orig == "" {
		tb.Fatal("the process's cgroup v2 path is unknown")
	}
	pid := []byte(strconv.Itoa(os.Getpid()))
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), pid, 0); err != nil {
		tb.Fatalf("move the process to cgroup %s: %s", dir, err)
	}
	tb.Cleanup(func() {
		if err := os.WriteFile(filepath.Join(orig, "cgroup.procs"), pid, 0); err != nil {
			tb.Errorf("move the process back from cgroup %s to %s: %s", dir, orig, err)
		}
	})
}

// Cgroup2Mount returns where cgroup v2 is mounted.
func Cgroup2Mount() (string, error) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		// ... mount-point ... - fstype source options
		pre, post, ok := strings.Cut(line, " - ")
		if !ok || !strings.HasPrefix(post, "cgroup2 ") {
			continue
		}
		if f := strings.Fields(pre); len(f) >= 5 {
			return f[4], nil
		}
	}
	return "", errors.New("cgroup2 is not mounted")
}

// LogBuffer keeps the output of a process a test started, safe for the
// process's writes and the test's reads at once: for waiting on log lines,
// and for showing the end of it when the test fails.
type LogBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write implements io.Writer.
func (b *LogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns everything written so far.
func (b *LogBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Tail returns the last n lines, saying how many came before.
func (b *LogBuffer) Tail(n int) string {
	lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	if len(lines) > n {
		lines = append([]string{fmt.Sprintf("... (%d lines before)", len(lines)-n)}, lines[len(lines)-n:]...)
	}
	return strings.Join(lines, "\n")
}

// Eventually polls cond every 50 ms until it holds; after timeout the test
// fails with what it waited for and what cond last said.
func Eventually(tb testing.TB, timeout time.Duration, what string, cond func() (ok bool, state string)) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %s waiting for %s; last:\n%s", timeout, what, state)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// IgnoringEINTR calls f until it returns an error other than EINTR. A
// test that makes raw system calls needs it: the Go runtime's preemption
// and GC signals interrupt a blocking read, recvfrom or accept, which
// net.Conn would retry but golang.org/x/sys/unix does not.
func IgnoringEINTR[T any](f func() (T, error)) (T, error) {
	for {
		v, err := f()
		if !errors.Is(err, unix.EINTR) {
			return v, err
		}
	}
}
