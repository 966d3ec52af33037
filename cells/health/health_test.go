package health

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// clock is the registry's clock in tests: it stands still unless advanced.
// The flush timer reads it too, hence the lock.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func newTestRegistry(t *testing.T) (*Registry, *clock) {
	t.Helper()
	db := statedb.New()
	r, err := NewRegistry(hivetest.Logger(t), db)
	if err != nil {
		t.Fatal(err)
	}
	c := &clock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	r.now = c.Now
	return r, c
}

func get(t *testing.T, r *Registry, scope string) *tables.HealthStatus {
	t.Helper()
	s, _, ok := r.table.Get(r.db.ReadTxn(), tables.HealthScopeIndex.Query(scope))
	if !ok {
		return nil
	}
	return s
}

func TestScopesAndLevels(t *testing.T) {
	r, clock := newTestRegistry(t)
	lb := ModuleDecorator(r.Root(), "lb")
	job := lb.NewScope("job-reconcile")

	if s := get(t, r, "lb.job-reconcile"); s == nil || s.Level != cell.StatusUnknown || !s.Healthy() {
		t.Fatalf("new scope: got %+v, want Unknown and healthy", s)
	}

	steps := []struct {
		report    func()
		level     cell.Level
		message   string
		err       string
		sinceMove bool
		unhealthy int
	}{
		{func() { job.OK("OK, 3 objects") }, cell.StatusOK, "OK, 3 objects", "", true, 0},
		{func() { job.OK("OK, 4 objects") }, cell.StatusOK, "OK, 4 objects", "", false, 0},
		{func() { job.Degraded("1 error", errors.New("map full")) }, cell.StatusDegraded, "1 error", "map full", true, 1},
		{func() { job.Degraded("2 errors", errors.New("map full")) }, cell.StatusDegraded, "2 errors", "map full", false, 1},
		{func() { job.OK("OK, 4 objects") }, cell.StatusOK, "OK, 4 objects", "", true, 0},
		{func() { job.Stopped("done") }, cell.StatusStopped, "done", "", true, 1},
	}
	for i, step := range steps {
		before := get(t, r, "lb.job-reconcile").Since
		clock.Advance(time.Second)
		step.report()
		s := get(t, r, "lb.job-reconcile")
		if s.Level != step.level || s.Message != step.message || s.Error != step.err {
			t.Fatalf("step %d: got %+v", i, s)
		}
		if moved := !s.Since.Equal(before); moved != step.sinceMove {
			t.Fatalf("step %d: since moved=%v, want %v", i, moved, step.sinceMove)
		}
		if n := len(r.Unhealthy()); n != step.unhealthy {
			t.Fatalf("step %d: %d unhealthy scopes, want %d", i, n, step.unhealthy)
		}
	}

	job.Close()
	if s := get(t, r, "lb.job-reconcile"); s != nil {
		t.Fatalf("closed scope still present: %+v", s)
	}
	job.Degraded("late", errors.New("after close"))
	if s := get(t, r, "lb.job-reconcile"); s != nil {
		t.Fatalf("report after close resurrected the scope: %+v", s)
	}

	var names []string
	for _, s := range r.All() {
		names = append(names, s.Scope)
	}
	if len(names) != 2 || names[0] != "agent" || names[1] != "lb" {
		t.Fatalf("All() = %v, want [agent lb] in order", names)
	}
}

// waitMessage waits until scope's message is want.
func waitMessage(t *testing.T, r *Registry, scope, want string) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		s, _, watch, ok := r.table.GetWatch(r.db.ReadTxn(), tables.HealthScopeIndex.Query(scope))
		if ok && s.Message == want {
			return
		}
		select {
		case <-watch:
		case <-deadline:
			t.Fatalf("%s: message %q, want %q within 5s", scope, s.Message, want)
		}
	}
}

// The registry's clock stands still, so every message-only change is
// within the coalescing interval of the last write, however slow the
// machine; only the flush timer runs on real time.
func TestMessageOnlyChangesAreCoalesced(t *testing.T) {
	r, _ := newTestRegistry(t)
	r.coalesce = 200 * time.Millisecond
	job := r.Root().NewScope("resolver")
	message := func() string { return get(t, r, "resolver").Message }

	job.OK("1 prefixes resolved")
	if got := message(); got != "1 prefixes resolved" {
		t.Fatalf("a level change is written at once: got %q", got)
	}
	rev := r.table.Revision(r.db.ReadTxn())
	for i := 2; i <= 100; i++ {
		job.OK(fmt.Sprintf("%d prefixes resolved", i))
	}
	if got := message(); got != "1 prefixes resolved" {
		t.Fatalf("message-only changes within the interval are held back: got %q", got)
	}
	// The flush timer writes the latest one.
	waitMessage(t, r, "resolver", "100 prefixes resolved")
	if writes := r.table.Revision(r.db.ReadTxn()) - rev; writes != 1 {
		t.Fatalf("100 reports in one interval wrote the table %d times, want 1", writes)
	}

	// A held-back message gives way to a change of level, which is at once.
	job.OK("101 prefixes resolved")
	job.Degraded("1 prefixes without identity", errors.New("exhausted"))
	if s := get(t, r, "resolver"); s.Level != cell.StatusDegraded || s.Message != "1 prefixes without identity" {
		t.Fatalf("a level change is written at once: got %+v", s)
	}
	// The held-back message is dropped, not merely overtaken: Flush writes
	// whatever is still held back, as the flush timer does.
	r.Flush()
	if got := message(); got != "1 prefixes without identity" {
		t.Fatalf("a dropped pending message was written after all: %q", got)
	}

	// Flush writes what is held back, as the agent does when it stops.
	job.Degraded("2 prefixes without identity", errors.New("exhausted"))
	if got := message(); got != "1 prefixes without identity" {
		t.Fatalf("a message-only change within the interval is held back: got %q", got)
	}
	r.Flush()
	if got := message(); got != "2 prefixes without identity" {
		t.Fatalf("after Flush: got %q", got)
	}
}
