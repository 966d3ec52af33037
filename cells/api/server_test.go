package api

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"regexp"
	"sync"
	"syscall"
	"testing"

	"github.com/cilium/hive/cell"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestMetrics(t *testing.T) {
	f := startFixture(t)
	f.insert(testObjs...)

	r := f.do(http.MethodGet, "/metrics", "")
	require.Equal(t, http.StatusOK, r.code, r.body)
	assert.Contains(t, r.contentType, "text/plain")
	for _, re := range []string{
		`(?m)^go_goroutines \d+`,
		`(?m)^process_open_fds \d+`,
		`(?m)^apiary_statedb_table_objects\{table="test"\} 3$`,
		`(?m)^apiary_statedb_write_txn_duration_seconds_count\{handle="DB",tables="test"\} \d+`,
		`(?m)^promhttp_metric_handler_requests_total\{code="200"\} \d+`,
	} {
		assert.Regexp(t, regexp.MustCompile(re), r.body)
	}

	requireJSONError(t, f.do(http.MethodPost, "/metrics", ""), http.StatusMethodNotAllowed, "POST")
}

func TestIndexAndUnknownPaths(t *testing.T) {
	f := startFixture(t)

	r := f.do(http.MethodGet, "/", "")
	require.Equal(t, http.StatusOK, r.code)
	assert.Equal(t, "text/plain; charset=utf-8", r.contentType)
	for _, route := range []string{"/statedb/dump/{table}", "/statedb/query", "/statedb/changes/{table}", "/healthz", "/metrics"} {
		assert.Contains(t, r.body, route)
	}

	for _, path := range []string{"/nope", "/healthz/x", "/metricsx"} {
		requireJSONError(t, f.do(http.MethodGet, path, ""), http.StatusNotFound, path)
	}
}

// TestAddrTaken checks that a taken port fails the start of the hive with
// an error that names the flag.
func TestAddrTaken(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	addr := ln.Addr().String()

	f := newFixture(t, []string{"--api-addr=" + addr})
	err = f.hive.Start(f.log, t.Context())
	require.Error(t, err)
	assert.Equal(t, fmt.Sprintf("listen on %s (--api-addr): address already in use", addr), err.Error())
	assert.ErrorIs(t, err, syscall.EADDRINUSE)
}

// TestInvalidAddr checks that a bad address fails populate, before
// anything starts, whether it comes from a flag or the environment.
func TestInvalidAddr(t *testing.T) {
	tests := []struct {
		name, flag, env string
		want            string
	}{
		{name: "no port", flag: "127.0.0.1", want: `invalid --api-addr "127.0.0.1": missing port in address`},
		{name: "empty", flag: "", want: `invalid --api-addr "": missing port in address`},
		{name: "port too large", flag: "127.0.0.1:99999", want: `port "99999" is not a number from 0 to 65535`},
		{name: "negative port", flag: "127.0.0.1:-1", want: `port "-1"`},
		{name: "service name", flag: "127.0.0.1:http", want: `port "http"`},
		{name: "space in host", flag: "local host:80", want: `host "local host"`},
		{name: "from environment", env: "bogus", want: `invalid --api-addr "bogus": missing port in address`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var args []string
			if tt.env != "" {
				t.Setenv("APIARY_API_ADDR", tt.env)
			} else {
				args = []string{"--api-addr=" + tt.flag}
			}
			f := newFixture(t, args)
			err := f.hive.Populate(f.log)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tt.want)
		})
	}
}

// TestHandlers checks routes added through the api-handlers group, and that
// a panicking handler is answered rather than dropped.
func TestHandlers(t *testing.T) {
	add := func(path string, h http.HandlerFunc) cell.Cell {
		return cell.Provide(func() HandlerOut { return HandlerOut{Handler: Handler{Path: path, Handler: h}} })
	}
	f := startFixture(t,
		cell.Module("extra", "Extra handlers",
			add("/hello", func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "hello") }),
			add("/panic", func(http.ResponseWriter, *http.Request) { panic("boom") }),
			add("/panic-late", func(w http.ResponseWriter, r *http.Request) {
				fmt.Fprint(w, "partial")
				http.NewResponseController(w).Flush()
				panic("late boom")
			}),
		),
	)

	r := f.do(http.MethodGet, "/hello", "")
	assert.Equal(t, http.StatusOK, r.code)
	assert.Equal(t, "hello", r.body)

	assert.Contains(t, f.do(http.MethodGet, "/", "").body, "/hello")

	requireJSONError(t, f.do(http.MethodGet, "/panic", ""), http.StatusInternalServerError, "internal error serving /panic: boom")

	// The status is out before the panic: the client gets what was sent
	// and a cleanly ended response, not a dropped connection.
	r = f.do(http.MethodGet, "/panic-late", "")
	assert.Equal(t, http.StatusOK, r.code)
	assert.Equal(t, "partial", r.body)
}

func TestHandlerErrors(t *testing.T) {
	tests := []struct {
		name string
		h    Handler
		want string
	}{
		{"clash", Handler{Path: "/healthz", Handler: http.NotFoundHandler()}, `api handler "/healthz": `},
		{"bad pattern", Handler{Path: "nope", Handler: http.NotFoundHandler()}, `api handler "nope": `},
		{"no handler", Handler{Path: "/x"}, `api handler "/x": needs both a path and a handler`},
		{"no path", Handler{Handler: http.NotFoundHandler()}, `api handler "": needs both a path and a handler`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, []string{"--api-addr=127.0.0.1:0"},
				cell.Provide(func() HandlerOut { return HandlerOut{Handler: tt.h} }))
			err := f.hive.Populate(f.log)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tt.want)
		})
	}
}

// TestAddrBeforeStart documents that Addr is nil until the hive starts.
func TestAddrBeforeStart(t *testing.T) {
	f := newFixture(t, []string{"--api-addr=127.0.0.1:0"})
	require.NoError(t, f.hive.Populate(f.log))
	assert.Nil(t, f.server.Addr())
	require.NoError(t, f.hive.Start(f.log, t.Context()))
	addr, ok := f.server.Addr().(*net.TCPAddr)
	require.True(t, ok)
	assert.True(t, addr.IP.IsLoopback())
	assert.NotZero(t, addr.Port)
}

// records keeps the log records of a hive.
type records struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *records) WithGroup(string) slog.Handler            { return r }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, rec.Clone())
	return nil
}

// warnings returns the messages of the Warn records.
func (r *records) warnings() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, rec := range r.recs {
		if rec.Level == slog.LevelWarn {
			out = append(out, rec.Message)
		}
	}
	return out
}

// TestNonLoopbackWarns checks that listening where other hosts can connect
// warns, naming the address, that the API is not authenticated, and that
// loopback does not.
func TestNonLoopbackWarns(t *testing.T) {
	for _, tc := range []struct {
		addr string
		warn bool
	}{
		{"127.0.0.1:0", false},
		{"127.0.0.2:0", false},
		{"localhost:0", false},
		{"0.0.0.0:0", true},
		{":0", true},
	} {
		t.Run(tc.addr, func(t *testing.T) {
			f := newFixture(t, []string{"--api-addr=" + tc.addr})
			logs := &records{}
			f.log = slog.New(logs)
			require.NoError(t, f.hive.Start(f.log, t.Context()))
			addr := f.server.Addr().String()
			warnings := logs.warnings()
			if !tc.warn {
				assert.Empty(t, warnings)
				return
			}
			require.Len(t, warnings, 1)
			assert.Equal(t, "HTTP API listens on a non-loopback address without authentication: whoever reaches "+
				addr+" reads the agent's state", warnings[0])
		})
	}
}
