package health

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// Whatever a module reports, a scope's message and error stay a few KB, and
// so do /healthz and the log line that reports the degradation.
func TestReportTextIsBounded(t *testing.T) {
	logs := &logRecorder{}
	r, err := NewRegistry(slog.New(logs), statedb.New())
	if err != nil {
		t.Fatal(err)
	}
	s := ModuleDecorator(r.Root(), "big")

	huge := strings.Repeat("x", 5<<20)
	s.Degraded("é"+huge, errors.New(huge+"y"))
	st := scopeStatus(r, "big")
	if st == nil {
		t.Fatal("no scope")
	}
	for _, tt := range []struct{ what, got, wantSuffix string }{
		{"message", st.Message, "… (5238786 more bytes)"},
		{"error", st.Error, "… (5238785 more bytes)"},
	} {
		if len(tt.got) > MaxTextLen+64 || !strings.HasSuffix(tt.got, tt.wantSuffix) {
			t.Errorf("%s: %d bytes ending %q, want at most %d ending %q", tt.what, len(tt.got), tail(tt.got), MaxTextLen, tt.wantSuffix)
		}
	}
	if !strings.HasPrefix(st.Message, "é") {
		t.Errorf("message lost its start: %q", st.Message[:8])
	}
	if n := logs.longest(); n > 2*MaxTextLen+256 {
		t.Errorf("log record of %d bytes", n)
	}

	// The same report again is recognised as unchanged: nothing is written.
	rev := r.table.Revision(r.db.ReadTxn())
	s.Degraded("é"+huge, errors.New(huge+"y"))
	if got := r.table.Revision(r.db.ReadTxn()); got != rev {
		t.Errorf("an unchanged report was written again (revision %d -> %d)", rev, got)
	}

	// Short texts are kept as they are.
	s.OK("fine")
	if st := scopeStatus(r, "big"); st.Message != "fine" || st.Error != "" {
		t.Errorf("got %q/%q", st.Message, st.Error)
	}
}

func scopeStatus(r *Registry, scope string) *tables.HealthStatus {
	s, _, _ := r.table.Get(r.db.ReadTxn(), tables.HealthScopeIndex.Query(scope))
	return s
}

func tail(s string) string {
	if len(s) > 40 {
		return s[len(s)-40:]
	}
	return s
}

// logRecorder keeps the length of every log record's text.
type logRecorder struct {
	mu   sync.Mutex
	lens []int
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }

func (l *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	n := len(rec.Message)
	rec.Attrs(func(a slog.Attr) bool {
		n += len(a.Key) + len(a.Value.String())
		return true
	})
	l.mu.Lock()
	l.lens = append(l.lens, n)
	l.mu.Unlock()
	return nil
}

func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecorder) WithGroup(string) slog.Handler      { return l }

func (l *logRecorder) longest() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := 0
	for _, n := range l.lens {
		m = max(m, n)
	}
	return m
}
