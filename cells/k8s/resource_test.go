package k8s

import (
	"context"
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func svc(ns, name, v string) *corev1.Service {
	return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"v": v}}}
}

// newBareResource is a resource fed by hand: both sources active, neither
// synced.
func newBareResource(t *testing.T) *resource[*corev1.Service] {
	r := newResource(ServiceKind, hivetest.Logger(t))
	r.active[sourceInformer] = true
	r.active[sourceDir] = true
	return r
}

func TestResourceReplayAndSync(t *testing.T) {
	r := newBareResource(t)
	r.upsert(sourceInformer, svc("b", "x", "1"))
	r.upsert(sourceInformer, svc("a", "y", "1"))
	r.upsert(sourceDir, svc("a", "x", "1"))

	ev := subscribe(t, Resource[*corev1.Service](r))
	// The replay is in key order; no Sync while a source is not synced.
	expect(t, ev, "Upsert a/x", "Upsert a/y", "Upsert b/x")
	r.markSynced(sourceInformer)
	r.upsert(sourceInformer, svc("c", "z", "1"))
	expect(t, ev, "Upsert c/z")
	r.markSynced(sourceDir)
	expect(t, ev, "Sync")
	r.delete(sourceInformer, Key{"c", "z"})
	expect(t, ev, "Delete c/z v=1")

	// A late subscriber gets the current state, then Sync at once.
	expect(t, subscribe(t, Resource[*corev1.Service](r)), "Upsert a/x", "Upsert a/y", "Upsert b/x", "Sync")
}

func TestResourceNoSources(t *testing.T) {
	r := newResource(ServiceKind, hivetest.Logger(t))
	expect(t, subscribe(t, Resource[*corev1.Service](r)), "Sync")
}

func TestResourceCoalescing(t *testing.T) {
	r := newBareResource(t)
	r.markSynced(sourceInformer)
	r.markSynced(sourceDir)
	r.upsert(sourceInformer, svc("ns", "a", "1"))
	r.upsert(sourceInformer, svc("ns", "gone", "1"))

	ev := subscribe(t, Resource[*corev1.Service](r))
	expect(t, ev, "Upsert ns/a v=1", "Upsert ns/gone v=1", "Sync")

	// Many changes happen while the subscriber doesn't look (the batch holds
	// the lock it needs): it then gets the latest state of each key, in order
	// of first change.
	c := svc("ns", "c", "1")
	batch(r, func(set func(*corev1.Service), del func(Key)) {
		for _, v := range []string{"2", "3", "4"} {
			set(svc("ns", "a", v))
			set(svc("ns", "b", v))
		}
		del(Key{"ns", "gone"})
		// Added and deleted before the subscriber looked: never seen, so
		// no Delete.
		set(svc("ns", "flash", "1"))
		del(Key{"ns", "flash"})
		set(c)
	})
	expect(t, ev, "Upsert ns/a v=4", "Upsert ns/b v=4", "Delete ns/gone v=1", "Upsert ns/c v=1")

	// Changed and changed back before the subscriber looked: nothing to
	// tell, as the marker after it shows.
	batch(r, func(set func(*corev1.Service), del func(Key)) {
		set(svc("ns", "c", "2"))
		set(c)
		set(svc("ns", "marker", "1"))
	})
	expect(t, ev, "Upsert ns/marker")
}

// batch changes the informer source's objects under the resource's lock, so
// that no subscriber sees anything until all are done.
func batch(r *resource[*corev1.Service], fn func(set func(*corev1.Service), del func(Key))) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fn(
		func(o *corev1.Service) { r.set(sourceInformer, KeyOf(o), o, false) },
		func(k Key) { r.set(sourceInformer, k, nil, true) },
	)
}

func TestResourcePriority(t *testing.T) {
	r := newBareResource(t)
	r.markSynced(sourceInformer)
	r.markSynced(sourceDir)
	ev := subscribe(t, Resource[*corev1.Service](r))
	expect(t, ev, "Sync")

	r.upsert(sourceInformer, svc("ns", "a", "k8s-1"))
	expect(t, ev, "Upsert ns/a v=k8s-1")
	// The directory's copy wins...
	r.upsert(sourceDir, svc("ns", "a", "dir"))
	expect(t, ev, "Upsert ns/a v=dir")
	// ...so changes of the API server's copy are not news...
	r.upsert(sourceInformer, svc("ns", "a", "k8s-2"))
	r.upsert(sourceInformer, svc("ns", "marker", "1"))
	expect(t, ev, "Upsert ns/marker")
	// ...until the directory lets go of it.
	r.delete(sourceDir, Key{"ns", "a"})
	expect(t, ev, "Upsert ns/a v=k8s-2")
	r.delete(sourceInformer, Key{"ns", "a"})
	expect(t, ev, "Delete ns/a v=k8s-2")
}

func TestResourceClosesOnCancel(t *testing.T) {
	r := newBareResource(t)
	r.upsert(sourceInformer, svc("ns", "a", "1"))
	ctx, cancel := context.WithCancel(context.Background())
	ch := r.Events(ctx)
	cancel()
	// The channel closes whether or not the pending event was taken.
	deadline := time.After(timeout)
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				r.mu.Lock()
				defer r.mu.Unlock()
				require.Empty(t, r.subs, "subscriber removed")
				return
			}
		case <-deadline:
			t.Fatal("channel not closed")
		}
	}
}

func TestEventStrings(t *testing.T) {
	require.Equal(t, "ns/a", Key{"ns", "a"}.String())
	require.Equal(t, "a", Key{Name: "a"}.String())
	require.Equal(t, "Upsert", Upsert.String())
	require.Equal(t, "Delete", Delete.String())
	require.Equal(t, "Sync", Sync.String())
	require.Equal(t, "EventKind(9)", EventKind(9).String())
	require.Equal(t, "Delete ns/a", Event[*corev1.Service]{Kind: Delete, Key: Key{"ns", "a"}}.String())
}
