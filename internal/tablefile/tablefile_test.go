package tablefile

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
)

// health records the last report.
type health struct {
	mu       sync.Mutex
	degraded error
	ok       string
}

func (h *health) OK(s string) { h.mu.Lock(); h.ok, h.degraded = s, nil; h.mu.Unlock() }
func (h *health) Degraded(_ string, err error) {
	h.mu.Lock()
	h.degraded = err
	h.mu.Unlock()
}
func (h *health) Stopped(string)              {}
func (h *health) NewScope(string) cell.Health { return h }
func (h *health) Close()                      {}
func (h *health) last() (string, error)       { h.mu.Lock(); defer h.mu.Unlock(); return h.ok, h.degraded }

// table stands in for a statedb table: contents and a watch channel.
type table struct {
	mu      sync.Mutex
	data    string
	changed chan struct{}
	fail    bool
}

func newTable(data string) *table { return &table{data: data, changed: make(chan struct{})} }

func (t *table) set(data string) {
	t.mu.Lock()
	t.data = data
	close(t.changed)
	t.changed = make(chan struct{})
	t.mu.Unlock()
}

func (t *table) watch() <-chan struct{} { t.mu.Lock(); defer t.mu.Unlock(); return t.changed }

func (t *table) encode() ([]byte, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.fail {
		return nil, errors.New("boom")
	}
	return []byte(t.data), nil
}

func waitFile(t *testing.T, path, want string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, _ := os.ReadFile(path)
		if string(got) == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s holds %q, want %q", path, got, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestRunFollowsTheTable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	tbl := newTable("a")
	h := &health{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	w := Writer{What: "test", Path: path, Interval: 10 * time.Millisecond, Watch: tbl.watch, Encode: tbl.encode}
	go func() { done <- w.Run(ctx, h, slog.New(slog.DiscardHandler)) }()

	waitFile(t, path, "a")
	tbl.set("b")
	waitFile(t, path, "b")

	// A change on stop is written before Run returns.
	tbl.set("c")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waitFile(t, path, "c")
	if ok, err := h.last(); ok != "Checkpoint up to date" || err != nil {
		t.Errorf("health %q, %v", ok, err)
	}
}

func TestRunKeepsAnUnchangedFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	if err := os.WriteFile(path, []byte("same"), 0o600); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(path, old, old); err != nil {
		t.Fatal(err)
	}
	tbl := newTable("same")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w := Writer{What: "test", Path: path, Interval: time.Millisecond, Watch: tbl.watch, Encode: tbl.encode}
	if err := w.Run(ctx, &health{}, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if !st.ModTime().Equal(old) {
		t.Error("a restart with unchanged contents rewrote the file")
	}
}

func TestRunReportsFailures(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	tbl := newTable("x")
	tbl.fail = true
	h := &health{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := Writer{What: "test", Path: path, Interval: time.Millisecond, Watch: tbl.watch, Encode: tbl.encode}
	go w.Run(ctx, h, slog.New(slog.DiscardHandler))
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := h.last(); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no degraded health after a failed encode")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// Fixed, the next change is written.
	tbl.mu.Lock()
	tbl.fail = false
	tbl.mu.Unlock()
	tbl.set("y")
	waitFile(t, path, "y")
}

// failingWrites is a writeFile that fails (as a full disk does) until
// fixed, counting attempts.
type failingWrites struct {
	mu       sync.Mutex
	broken   bool
	attempts int
}

func (f *failingWrites) write(path string, data []byte, perm os.FileMode) error {
	f.mu.Lock()
	f.attempts++
	broken := f.broken
	f.mu.Unlock()
	if broken {
		return syscall.ENOSPC
	}
	return os.WriteFile(path, data, perm)
}

func (f *failingWrites) set(broken bool) (attempts int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.broken = broken
	return f.attempts
}

// retryDelays records the retryIn of every "not written" log record.
type retryDelays struct {
	mu     sync.Mutex
	delays []time.Duration
	warns  int
}

func (r *retryDelays) Enabled(context.Context, slog.Level) bool { return true }
func (r *retryDelays) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *retryDelays) WithGroup(string) slog.Handler            { return r }
func (r *retryDelays) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if rec.Level == slog.LevelWarn {
		r.warns++
	}
	rec.Attrs(func(a slog.Attr) bool {
		if a.Key == "retryIn" {
			r.delays = append(r.delays, a.Value.Duration())
		}
		return true
	})
	return nil
}

func (r *retryDelays) get() ([]time.Duration, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.delays), r.warns
}

// TestRunRecoversWithoutChange is the full-disk case: the write fails, the
// table does not change again, and the checkpoint is written and health OK
// once space is back, by the retries alone, which back off.
func TestRunRecoversWithoutChange(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	tbl := newTable("a")
	h := &health{}
	disk := &failingWrites{broken: true}
	logs := &retryDelays{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := Writer{What: "test", Path: path, Interval: time.Hour, Watch: tbl.watch, Encode: tbl.encode,
		writeFile: disk.write, retryMin: time.Millisecond, retryMax: 4 * time.Millisecond}
	done := make(chan error)
	go func() { done <- w.Run(ctx, h, slog.New(logs)) }()

	// Degraded, and retrying: wait for a few attempts with the disk full.
	deadline := time.Now().Add(10 * time.Second)
	for {
		delays, _ := logs.get()
		if _, err := h.last(); err != nil && len(delays) >= 5 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no retries of a failed write: delays %v", delays)
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := h.last(); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("health error %v, want ENOSPC", err)
	}

	// Space is back; the table stays as it was.
	disk.set(false)
	waitFile(t, path, "a")
	deadline = time.Now().Add(10 * time.Second)
	for {
		if ok, err := h.last(); ok == "Checkpoint up to date" && err == nil {
			break
		}
		if time.Now().After(deadline) {
			ok, err := h.last()
			t.Fatalf("health did not recover: %q, %v", ok, err)
		}
		time.Sleep(time.Millisecond)
	}

	delays, warns := logs.get()
	want := []time.Duration{1, 2, 4, 4, 4}
	for i := range want {
		if delays[i] != want[i]*time.Millisecond {
			t.Errorf("retry delays %v, want them to start %v ms", delays, want)
			break
		}
	}
	if warns != 1 {
		t.Errorf("%d warnings for one unchanged failure, want 1", warns)
	}

	// Once written, nothing is retried.
	attempts := disk.set(false)
	time.Sleep(50 * time.Millisecond)
	if again := disk.set(false); again != attempts {
		t.Errorf("%d writes after the checkpoint was written, want none", again-attempts)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestRunDefaultRetry checks the delays of the agent: a first retry after a
// second.
func TestRunDefaultRetry(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	tbl := newTable("a")
	h := &health{}
	disk := &failingWrites{broken: true}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := Writer{What: "test", Path: path, Interval: time.Hour, Watch: tbl.watch, Encode: tbl.encode, writeFile: disk.write}
	go w.Run(ctx, h, slog.New(slog.DiscardHandler))
	for disk.set(true) == 0 {
		time.Sleep(time.Millisecond)
	}
	disk.set(false)
	// Written by the retry 1 s later, with no change of the table.
	waitFile(t, path, "a")
}
