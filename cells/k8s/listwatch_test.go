package k8s

import (
	"fmt"
	"regexp"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
)

// configMapKind stands for a kind whose resource may not be served (a CRD):
// ConfigMaps, as no core Resource watches them, so the reactors below touch
// nothing else.
func configMapKind(optional bool) Kind[*corev1.ConfigMap] {
	return Kind[*corev1.ConfigMap]{
		GVK:        corev1.SchemeGroupVersion.WithKind("ConfigMap"),
		Resource:   "configmaps",
		Namespaced: true,
		Optional:   optional,
		ListWatch: func(c *Clientset) cache.ListerWatcher {
			return NewListWatch(c.Interface, c.CoreV1().ConfigMaps("").List, c.CoreV1().ConfigMaps("").Watch)
		},
	}
}

var configMapGVR = corev1.SchemeGroupVersion.WithResource("configmaps")

func configMap(ns, name, v string) *corev1.ConfigMap {
	return &corev1.ConfigMap{ObjectMeta: meta(ns, name, v)}
}

// apiServer puts the fake clientset's ConfigMaps behind a switch: while
// refuse is set, lists and watches fail with it, as a real API server
// answers for a CRD that is not installed (404) or a resource the client
// may not read (403). It counts lists and keeps the watches it opened, so
// that a test can end them as the API server does when a CRD is deleted.
type apiServer struct {
	refuse  atomic.Pointer[error]
	lists   atomic.Int64
	mu      sync.Mutex
	watches []watch.Interface
}

var (
	errNotServed = error(apierrors.NewNotFound(schema.GroupResource{Resource: "configmaps"}, ""))
	errForbidden = error(apierrors.NewForbidden(schema.GroupResource{Resource: "configmaps"}, "",
		fmt.Errorf("RBAC: no list verb")))
)

func (a *apiServer) install(th *testHive) {
	th.fake.PrependReactor("list", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		a.lists.Add(1)
		if err := a.refuse.Load(); err != nil {
			return true, nil, *err
		}
		return false, nil, nil // the tracker answers
	})
	th.fake.PrependWatchReactor("configmaps", func(action k8stesting.Action) (bool, watch.Interface, error) {
		if err := a.refuse.Load(); err != nil {
			return true, nil, *err
		}
		w, err := th.fake.Tracker().Watch(configMapGVR, action.GetNamespace())
		if err != nil {
			return true, nil, err
		}
		a.mu.Lock()
		a.watches = append(a.watches, w)
		a.mu.Unlock()
		return true, w, nil
	})
}

func (a *apiServer) set(err error) {
	if err == nil {
		a.refuse.Store(nil)
	} else {
		a.refuse.Store(&err)
	}
}

// watching reports whether a watch is open.
func (a *apiServer) watching() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.watches) > 0
}

// endWatches ends every open watch, as the API server does for a deleted CRD.
func (a *apiServer) endWatches() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, w := range a.watches {
		w.Stop()
	}
	a.watches = nil
}

// newRefusingHive starts a hive with a Resource of configMapKind(optional)
// in module "cms", whose API server refuses with refuse at first.
func newRefusingHive(t *testing.T, optional bool, refuse error) (*testHive, *apiServer, Resource[*corev1.ConfigMap]) {
	api := &apiServer{}
	api.set(refuse)
	var res Resource[*corev1.ConfigMap]
	th := newTestHive(t, hiveOpts{
		k8s: true,
		extra: []cell.Cell{
			cell.Provide(func() ResourceOptions {
				return ResourceOptions{NotServedRetryMin: 5 * time.Millisecond, NotServedRetryMax: 40 * time.Millisecond}
			}),
			cell.Module("cms", "Config maps for the test",
				cell.Invoke(func(p ResourceParams) { res = NewResource(p, configMapKind(optional)) })),
		},
		before: func(th *testHive) { api.install(th) },
	})
	return th, api, res
}

// waitScope waits until the health line of scope matches re.
func (th *testHive) waitScope(scope, re string) {
	th.t.Helper()
	pattern := regexp.MustCompile(re)
	deadline := time.Now().Add(timeout)
	last := "(no such scope)"
	for time.Now().Before(deadline) {
		for _, st := range th.health.All() {
			if st.Scope == scope {
				last = fmt.Sprintf("%s: level=%s message=%s error=%s", st.Scope, st.Level, st.Message, st.Error)
				if pattern.MatchString(last) {
					return
				}
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	th.t.Fatalf("health never matched %q; last: %q", re, last)
}

// expectNothing checks that no event is pending a moment after what the test
// waited for, which would have come before it.
func expectNothing[T Object](t *testing.T, ch <-chan Event[T]) {
	t.Helper()
	select {
	case ev := <-ch:
		t.Fatalf("unexpected event %s", describeEvent(ev))
	case <-time.After(100 * time.Millisecond):
	}
}

const notServedWarning = "ConfigMap (v1) is not served by the API server; treating it as empty until its CRD is installed"

// TestOptionalKindNotServed: an optional kind whose resource the API server
// does not serve syncs empty with one warning and OK health, keeps
// checking, delivers the objects once the resource is served, and deletes
// them when it is gone again.
func TestOptionalKindNotServed(t *testing.T) {
	th, api, res := newRefusingHive(t, true, errNotServed)
	const scope = "cms.informer-configmaps"
	ev := subscribe(t, res)

	// Synced, empty: subscribers can initialize their tables.
	expect(t, ev, "Sync")
	th.waitScope(scope, "level=OK message=ConfigMap not served; treated as empty error=$")
	// It keeps checking, with backoff, without logging about it.
	require.Eventually(t, func() bool { return api.lists.Load() >= 6 }, timeout, time.Millisecond)
	require.Equal(t, 1, th.records.count(notServedWarning), "warnings: %q", th.records.all())
	require.Equal(t, 1, len(th.records.all()), "warnings: %q", th.records.all())

	// The CRD is installed, with an object: it arrives without a restart.
	require.NoError(t, th.fake.Tracker().Create(configMapGVR, configMap("ns", "a", "1"), "ns"))
	api.set(nil)
	expect(t, ev, "Upsert ns/a v=1")
	th.waitScope(scope, "level=OK message=Listed and watching error=$")
	// The fake clientset's watches start at "now", whatever resource
	// version they are asked for: wait for the watch, or b could fall
	// between the list and the watch.
	require.Eventually(t, api.watching, timeout, time.Millisecond)
	_, err := th.fake.CoreV1().ConfigMaps("ns").Create(t.Context(), configMap("ns", "b", "1"), metav1.CreateOptions{})
	require.NoError(t, err)
	expect(t, ev, "Upsert ns/b v=1")

	// The CRD is deleted: its watches end and it is not served any more.
	// What was there is deleted, with a warning that says why.
	api.set(errNotServed)
	api.endWatches()
	// (A relist reports what is gone in no particular order.)
	deleted := []string{describeEvent(next(t, ev)), describeEvent(next(t, ev))}
	slices.Sort(deleted)
	require.Equal(t, []string{"Delete ns/a v=1", "Delete ns/b v=1"}, deleted)
	th.waitScope(scope, "level=OK message=ConfigMap not served; treated as empty")
	require.Equal(t, 2, th.records.count(notServedWarning), "warnings: %q", th.records.all())
	require.Equal(t, 2, len(th.records.all()), "warnings: %q", th.records.all())
	expectNothing(t, ev)
}

// TestInformerErrors: errors other than an optional kind's 404 keep the
// source unsynced and degrade health until the API server answers.
func TestInformerErrors(t *testing.T) {
	for _, tc := range []struct {
		name     string
		optional bool
		refuse   error
		want     string
	}{
		{"404 of a kind that is not optional", false, errNotServed, `level=Degraded message=list ConfigMap \(v1\) failed; retrying error=.*not found`},
		{"403 of an optional kind", true, errForbidden, `level=Degraded message=list ConfigMap \(v1\) failed; retrying error=.*forbidden`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			th, api, res := newRefusingHive(t, tc.optional, tc.refuse)
			const scope = "cms.informer-configmaps"
			require.NoError(t, th.fake.Tracker().Create(configMapGVR, configMap("ns", "a", "1"), "ns"))
			ev := subscribe(t, res)

			th.waitScope(scope, tc.want)
			expectNothing(t, ev) // no Sync: nothing may be pruned
			require.Zero(t, th.records.count("not served"), "warnings: %q", th.records.all())

			api.set(nil)
			expect(t, ev, "Upsert ns/a v=1", "Sync")
			th.waitScope(scope, "level=OK message=Listed and watching error=$")
		})
	}
}

// all returns the Warn (and worse) records so far.
func (r *recorder) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.warns)
}
