package api

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cilium/statedb/index"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var testObjs = []*testObj{{Name: "a", Tag: "x"}, {Name: "b", Tag: "x"}, {Name: "c", Tag: "y"}}

func b64(k index.Key) string { return base64.StdEncoding.EncodeToString(k) }

func TestStateDBDump(t *testing.T) {
	f := startFixture(t)
	f.insert(testObjs...)

	tests := []struct {
		name, method, path string
		code               int
		// wantTables are the tables the dump must contain; nil for errors.
		wantTables []string
		wantError  []string
	}{
		{name: "all", path: "/statedb/dump", code: 200, wantTables: []string{"test", "health"}},
		{name: "one", path: "/statedb/dump/test", code: 200, wantTables: []string{"test"}},
		{name: "unknown table", path: "/statedb/dump/nope", code: 404, wantError: []string{`table "nope" not found`}},
		{name: "changes of unknown table", path: "/statedb/changes/nope", code: 404, wantError: []string{`table "nope" not found`}},
		{name: "unknown statedb path", path: "/statedb/nope", code: 404, wantError: []string{"/nope"}},
		{name: "too deep", path: "/statedb/dump/test/x", code: 404, wantError: []string{"no such path"}},
		{name: "statedb root", path: "/statedb/", code: 404, wantError: []string{"no such path"}},
		{name: "POST", method: http.MethodPost, path: "/statedb/dump", code: 405, wantError: []string{"POST", "use GET"}},
		{name: "HEAD", method: http.MethodHead, path: "/statedb/dump/test", code: 405},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := f.do(cmpOr(tt.method, http.MethodGet), tt.path, "")
			switch {
			case tt.wantTables != nil:
				require.Equal(t, tt.code, r.code, r.body)
				require.Equal(t, "application/json", r.contentType)
				var dump map[string][]json.RawMessage
				require.NoError(t, json.Unmarshal([]byte(r.body), &dump), r.body)
				for _, name := range tt.wantTables {
					assert.Contains(t, dump, name)
				}
				if !strings.HasSuffix(tt.path, "/dump") {
					assert.Len(t, dump, len(tt.wantTables))
				}
				if _, ok := dump["test"]; ok {
					assert.Len(t, dump["test"], len(testObjs))
				}
			case tt.method == http.MethodHead:
				require.Equal(t, tt.code, r.code)
			default:
				requireJSONError(t, r, tt.code, tt.wantError...)
			}
		})
	}
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

func TestStateDBQuery(t *testing.T) {
	f := startFixture(t)
	f.insert(testObjs...)

	query := func(table, idx string, key string, lowerbound bool) string {
		b, err := json.Marshal(map[string]any{"table": table, "index": idx, "key": key, "lowerbound": lowerbound})
		require.NoError(t, err)
		return string(b)
	}
	const validIndexes = "name, tag, __revision__"

	tests := []struct {
		name, method, body string
		code               int
		wantNames          []string // objects answered, in order
		wantError          []string
	}{
		{name: "primary", body: query("test", "name", b64(index.String("b")), false), code: 200, wantNames: []string{"b"}},
		{name: "primary miss", body: query("test", "name", b64(index.String("zz")), false), code: 200, wantNames: nil},
		{name: "secondary", body: query("test", "tag", b64(index.String("x")), false), code: 200, wantNames: []string{"a", "b"}},
		{name: "lowerbound", body: query("test", "name", b64(index.String("b")), true), code: 200, wantNames: []string{"b", "c"}},
		{name: "by revision", body: query("test", "__revision__", b64(index.Uint64(0)), true), code: 200, wantNames: []string{"a", "b", "c"}},
		{name: "unknown table", body: query("nope", "name", "", false), code: 404, wantError: []string{`table "nope" not found`}},
		{name: "no table", body: `{"index":"name","key":""}`, code: 400, wantError: []string{`no "table"`}},
		{name: "unknown index", body: query("test", "nope", "", false), code: 400, wantError: []string{`no index "nope"`, validIndexes}},
		{name: "internal index", body: query("test", "__graveyard__", "", false), code: 400, wantError: []string{`no index "__graveyard__"`, validIndexes}},
		{name: "empty index", body: query("test", "", "", false), code: 400, wantError: []string{`no "index"`, validIndexes}},
		{name: "garbage", body: "{not json", code: 400, wantError: []string{"malformed query"}},
		{name: "empty body", body: "", code: 400, wantError: []string{"malformed query"}},
		{name: "bad base64", body: query("test", "name", "!!!not base64", false), code: 400, wantError: []string{"base64"}},
		{name: "too large", body: `{"table":"` + strings.Repeat("x", maxQueryBody) + `"}`, code: 413, wantError: []string{"larger than"}},
		{name: "POST", method: http.MethodPost, body: query("test", "name", "", true), code: 405, wantError: []string{"POST"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := f.do(cmpOr(tt.method, http.MethodGet), "/statedb/query", tt.body)
			if tt.wantError != nil {
				requireJSONError(t, r, tt.code, tt.wantError...)
				return
			}
			require.Equal(t, tt.code, r.code, r.body)
			var names []string
			for line := range strings.Lines(r.body) {
				var resp struct {
					Rev uint64   `json:"rev"`
					Obj *testObj `json:"obj"`
					Err string   `json:"err"`
				}
				require.NoError(t, json.Unmarshal([]byte(line), &resp), "line %q", line)
				require.Empty(t, resp.Err)
				require.NotNil(t, resp.Obj, "line %q", line)
				assert.NotZero(t, resp.Rev)
				names = append(names, resp.Obj.Name)
			}
			assert.Equal(t, tt.wantNames, names)
		})
	}
}

// TestStateDBChanges follows a table, then stops the hive with the stream
// still open: the stop must not wait for the client.
func TestStateDBChanges(t *testing.T) {
	f := startFixture(t)
	f.insert(testObjs...)

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, f.url("/statedb/changes/test"), nil)
	require.NoError(t, err)
	resp, err := f.client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)

	lines := make(chan string)
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		defer close(lines)
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			case <-ctx.Done():
				return
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-readerDone })

	next := func() (name string, deleted bool) {
		t.Helper()
		for {
			select {
			case line, ok := <-lines:
				require.True(t, ok, "stream ended early")
				var ch struct {
					Obj     *testObj `json:"obj"`
					Rev     uint64   `json:"rev"`
					Deleted bool     `json:"deleted"`
				}
				require.NoError(t, json.Unmarshal([]byte(line), &ch), "line %q", line)
				if ch.Obj == nil {
					continue // keep-alive
				}
				return ch.Obj.Name, ch.Deleted
			case <-time.After(5 * time.Second):
				t.Fatal("no change within 5s")
			}
		}
	}

	for _, want := range []string{"a", "b", "c"} {
		name, deleted := next()
		require.Equal(t, want, name)
		require.False(t, deleted)
	}
	f.insert(&testObj{Name: "d", Tag: "z"})
	name, deleted := next()
	require.Equal(t, "d", name)
	require.False(t, deleted)

	took := f.stop()
	assert.Less(t, took, 5*time.Second, "stop waited for the stream")
	select {
	case _, ok := <-lines:
		assert.False(t, ok, "no more changes after stop")
	case <-time.After(5 * time.Second):
		t.Fatal("stream still open after stop")
	}
	t.Logf("stop took %s with a stream open", took)
}
