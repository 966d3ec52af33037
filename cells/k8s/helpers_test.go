package k8s

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/health"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// timeout bounds every wait in these tests; a passing test never comes close.
const timeout = 5 * time.Second

// testHive is a started hive with the k8s cells and handles on what the tests
// poke at.
type testHive struct {
	t        testing.TB
	h        *hive.Hive
	log      *slog.Logger
	records  *recorder
	fake     *fake.Clientset // nil without Kubernetes
	health   *health.Registry
	services Resource[*corev1.Service]
	slices   Resource[*discoveryv1.EndpointSlice]
	pods     Resource[*corev1.Pod]
	nss      Resource[*corev1.Namespace]
}

type hiveOpts struct {
	k8s       bool   // a fake clientset, else Kubernetes disabled
	configDir string // --config-dir
	extra     []cell.Cell
	noStart   bool
	// before runs after populate and before start, e.g. to create objects
	// that the initial listing finds.
	before func(*testHive)
}

func newTestHive(t testing.TB, o hiveOpts) *testHive {
	t.Helper()
	th := &testHive{t: t, records: &recorder{}}
	th.log = slog.New(&recordingHandler{Handler: hivetest.Logger(t).Handler(), r: th.records})

	// The k8sfake package cannot be imported here (it imports this one).
	client := cell.Provide(func() (*Clientset, *fake.Clientset) {
		f := fake.NewSimpleClientset() //nolint:staticcheck // stores objects of any kind
		return &Clientset{Interface: f}, f
	})
	if !o.k8s {
		client = cell.Module("k8s-client", "Kubernetes disabled", cell.Provide(func() *Clientset { return &Clientset{} }))
	}
	opts := core.HiveOptions()
	opts.LogThreshold = time.Hour
	cells := []cell.Cell{
		statedb.Cell,
		health.Cell,
		job.Cell,
		client,
		SourcesCell,
		cell.Provide(func() DirOptions { return DirOptions{Debounce: 10 * time.Millisecond} }),
		cell.Invoke(func(
			r *health.Registry,
			s Resource[*corev1.Service],
			e Resource[*discoveryv1.EndpointSlice],
			p Resource[*corev1.Pod],
			n Resource[*corev1.Namespace],
		) {
			th.health, th.services, th.slices, th.pods, th.nss = r, s, e, p, n
		}),
	}
	if o.k8s {
		cells = append(cells, cell.Invoke(func(f *fake.Clientset) { th.fake = f }))
	}
	cells = append(cells, o.extra...)
	th.h = hive.NewWithOptions(opts, cells...)
	hive.AddConfigOverride(th.h, func(c *SourcesConfig) { c.ConfigDir = o.configDir })
	require.NoError(t, th.h.Populate(th.log), "populate")
	if o.before != nil {
		o.before(th)
	}
	if !o.noStart {
		th.start()
	}
	return th
}

func (th *testHive) start() {
	th.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	require.NoError(th.t, th.h.Start(th.log, ctx), "start")
	th.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		require.NoError(th.t, th.h.Stop(th.log, ctx), "stop")
	})
}

// waitHealth waits until the k8s-sources module's health line matches re.
func (th *testHive) waitHealth(re string) {
	th.t.Helper()
	th.waitHealthWithin(timeout, re)
}

// waitHealthWithin is waitHealth with its own deadline, for inputs that
// take long to read.
func (th *testHive) waitHealthWithin(d time.Duration, re string) {
	th.t.Helper()
	pattern := regexp.MustCompile(re)
	deadline := time.Now().Add(d)
	var last []string
	for time.Now().Before(deadline) {
		last = last[:0]
		for _, st := range th.health.All() {
			// Module scopes are named by module id, under the root's name
			// or not depending on the health package's version.
			if st.Scope == "k8s-sources" || strings.HasSuffix(st.Scope, ".k8s-sources") {
				line := fmt.Sprintf("%s: level=%s message=%s error=%s", st.Scope, st.Level, st.Message, st.Error)
				if pattern.MatchString(line) {
					return
				}
				last = append(last, line)
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	th.t.Fatalf("health never matched %q; last: %q", re, last)
}

// subscribe returns the events of r until the test ends.
func subscribe[T Object](t testing.TB, r Resource[T]) <-chan Event[T] {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return r.Events(ctx)
}

// next returns the next event, failing the test if none comes in time.
func next[T Object](t testing.TB, ch <-chan Event[T]) Event[T] {
	t.Helper()
	select {
	case ev, ok := <-ch:
		if !ok {
			t.Fatalf("event channel closed")
		}
		return ev
	case <-time.After(timeout):
		t.Fatalf("no event within %s", timeout)
	}
	panic("unreachable")
}

// expect reads len(want) events and compares them with want, written as
// "Upsert ns/name", "Delete ns/name" or "Sync". The object's label "v" may be
// checked too: "Upsert ns/name v=x".
func expect[T Object](t testing.TB, ch <-chan Event[T], want ...string) {
	t.Helper()
	var got []string
	for range want {
		got = append(got, describeEvent(next(t, ch)))
	}
	// Compare only as much detail as each expectation gives.
	for i := range want {
		if !strings.HasPrefix(got[i], want[i]) || (len(got[i]) > len(want[i]) && got[i][len(want[i])] != ' ') {
			t.Fatalf("events differ\nwant: %q\ngot:  %q", want, got)
		}
	}
}

// describeEvent formats an event as expect compares it.
func describeEvent[T Object](ev Event[T]) string {
	s := ev.String()
	if ev.Kind != Sync {
		if v, ok := ev.Object.GetLabels()["v"]; ok {
			s += " v=" + v
		}
	}
	return s
}

// writeFile replaces a file atomically, as editors and ConfigMap volumes do,
// so that no scan sees it half-written.
func writeFile(t testing.TB, dir, name, content string) {
	t.Helper()
	tmp := filepath.Join(dir, "."+name+".swp")
	require.NoError(t, os.WriteFile(tmp, []byte(content), 0o644))
	require.NoError(t, os.Rename(tmp, filepath.Join(dir, name)))
}

// svcYAML is a Service document with label v=version.
func svcYAML(ns, name, version string) string {
	return fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata:\n  name: %s\n  namespace: %s\n  labels:\n    v: %q\nspec:\n  ports:\n  - port: 80\n", name, ns, version)
}

func docs(ds ...string) string { return strings.Join(ds, "---\n") }

// recorder keeps the Warn records logged, to check what is logged how often.
type recorder struct {
	mu    sync.Mutex
	warns []string
}

func (r *recorder) count(substr string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, w := range r.warns {
		if strings.Contains(w, substr) {
			n++
		}
	}
	return n
}

type recordingHandler struct {
	slog.Handler
	r *recorder
}

func (h *recordingHandler) Handle(ctx context.Context, rec slog.Record) error {
	if rec.Level >= slog.LevelWarn {
		var b strings.Builder
		b.WriteString(rec.Message)
		rec.Attrs(func(a slog.Attr) bool {
			fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
			return true
		})
		h.r.mu.Lock()
		h.r.warns = append(h.r.warns, b.String())
		h.r.mu.Unlock()
	}
	return h.Handler.Handle(ctx, rec)
}

func (h *recordingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &recordingHandler{Handler: h.Handler.WithAttrs(as), r: h.r}
}

func (h *recordingHandler) WithGroup(g string) slog.Handler {
	return &recordingHandler{Handler: h.Handler.WithGroup(g), r: h.r}
}
