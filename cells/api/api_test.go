package api

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/metrics"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testObj is the object of the test table "test".
type testObj struct {
	Name string `json:"name"`
	Tag  string `json:"tag"`
}

func (*testObj) TableHeader() []string { return []string{"Name", "Tag"} }
func (o *testObj) TableRow() []string  { return []string{o.Name, o.Tag} }

var (
	testNameIndex = statedb.Index[*testObj, string]{
		Name:       "name",
		FromObject: func(o *testObj) index.KeySet { return index.NewKeySet(index.String(o.Name)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	testTagIndex = statedb.Index[*testObj, string]{
		Name:       "tag",
		FromObject: func(o *testObj) index.KeySet { return index.NewKeySet(index.String(o.Tag)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     false,
	}
)

// fixture is a hive with the API and everything it serves: health, jobs,
// statedb with the test table, metrics.
type fixture struct {
	t        *testing.T
	hive     *hive.Hive
	log      *slog.Logger
	db       *statedb.DB
	table    statedb.RWTable[*testObj]
	server   *Server
	probe    cell.Health // the health scope of module "probe"
	client   *http.Client
	stopOnce sync.Once
}

// newFixture builds a hive parsing args as its command line. The hive is
// stopped when the test ends.
func newFixture(t *testing.T, args []string, extra ...cell.Cell) *fixture {
	t.Helper()
	f := &fixture{t: t, log: hivetest.Logger(t, hivetest.LogLevel(slog.LevelInfo))}

	opts := hive.DefaultOptions()
	opts.EnvPrefix = "APIARY_"
	opts.ModuleDecorators = cell.ModuleDecorators{health.ModuleDecorator}
	opts.LogThreshold = time.Second
	cells := []cell.Cell{
		health.Cell,
		job.Cell,
		statedb.Cell,
		metrics.Cell,
		Cell,
		cell.Module("test", "Test table",
			cell.Invoke(func(db *statedb.DB, s *Server) (err error) {
				f.db, f.server = db, s
				f.table, err = statedb.NewTable(db, "test", testNameIndex, testTagIndex)
				return err
			}),
		),
		cell.Module("probe", "Health probe",
			cell.Invoke(func(h cell.Health) { f.probe = h }),
		),
	}
	f.hive = hive.NewWithOptions(opts, append(cells, extra...)...)

	fs := pflag.NewFlagSet(t.Name(), pflag.ContinueOnError)
	f.hive.RegisterFlags(fs)
	require.NoError(t, fs.Parse(args))

	transport := &http.Transport{DisableKeepAlives: true}
	f.client = &http.Client{Transport: transport}
	t.Cleanup(func() {
		f.stop()
		transport.CloseIdleConnections()
	})
	return f
}

// startFixture builds and starts a hive listening on a free port.
func startFixture(t *testing.T, extra ...cell.Cell) *fixture {
	t.Helper()
	f := newFixture(t, []string{"--api-addr=127.0.0.1:0"}, extra...)
	require.NoError(t, f.hive.Start(f.log, t.Context()))
	return f
}

// stop stops the hive once and returns how long that took.
func (f *fixture) stop() (took time.Duration) {
	f.stopOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		start := time.Now()
		assert.NoError(f.t, f.hive.Stop(f.log, ctx))
		took = time.Since(start)
	})
	return took
}

func (f *fixture) url(path string) string {
	return "http://" + f.server.Addr().String() + path
}

// insert adds objects to the test table.
func (f *fixture) insert(objs ...*testObj) {
	f.t.Helper()
	wtxn := f.db.WriteTxn(f.table)
	defer wtxn.Abort()
	for _, o := range objs {
		_, _, err := f.table.Insert(wtxn, o)
		require.NoError(f.t, err)
	}
	wtxn.Commit()
}

// response is what a test checks of an HTTP answer.
type response struct {
	code        int
	contentType string
	body        string
}

// do sends a request and reads the whole answer.
func (f *fixture) do(method, path, body string) response {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(f.t.Context(), 10*time.Second)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, f.url(path), rd)
	require.NoError(f.t, err)
	resp, err := f.client.Do(req)
	require.NoError(f.t, err, "%s %s", method, path)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(f.t, err, "%s %s: reading the body", method, path)
	return response{code: resp.StatusCode, contentType: resp.Header.Get("Content-Type"), body: string(b)}
}

// requireJSONError checks that r is a JSON error with the code and a message
// containing every one of parts.
func requireJSONError(t *testing.T, r response, code int, parts ...string) {
	t.Helper()
	require.Equal(t, code, r.code, "body: %s", r.body)
	require.Equal(t, "application/json", r.contentType)
	var e map[string]string
	require.NoError(t, json.Unmarshal([]byte(r.body), &e), "body: %s", r.body)
	require.Len(t, e, 1, "only an error field: %s", r.body)
	for _, p := range parts {
		require.Contains(t, e["error"], p)
	}
}
