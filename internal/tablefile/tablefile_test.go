package tablefile

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
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
