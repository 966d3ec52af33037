package k8s

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	k8stesting "k8s.io/client-go/testing"
)

func meta(ns, name, v string) metav1.ObjectMeta {
	return metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"v": v}}
}

func TestInformerKinds(t *testing.T) {
	t.Run("Service", func(t *testing.T) {
		testInformerKind(t, ServiceKind, func(th *testHive) Resource[*corev1.Service] { return th.services },
			func(ns, name, v string) *corev1.Service { return &corev1.Service{ObjectMeta: meta(ns, name, v)} })
	})
	t.Run("EndpointSlice", func(t *testing.T) {
		testInformerKind(t, EndpointSliceKind, func(th *testHive) Resource[*discoveryv1.EndpointSlice] { return th.slices },
			func(ns, name, v string) *discoveryv1.EndpointSlice {
				return &discoveryv1.EndpointSlice{ObjectMeta: meta(ns, name, v), AddressType: discoveryv1.AddressTypeIPv4}
			})
	})
	t.Run("Pod", func(t *testing.T) {
		testInformerKind(t, PodKind, func(th *testHive) Resource[*corev1.Pod] { return th.pods },
			func(ns, name, v string) *corev1.Pod { return &corev1.Pod{ObjectMeta: meta(ns, name, v)} })
	})
	t.Run("Namespace", func(t *testing.T) {
		testInformerKind(t, NamespaceKind, func(th *testHive) Resource[*corev1.Namespace] { return th.nss },
			func(_, name, v string) *corev1.Namespace { return &corev1.Namespace{ObjectMeta: meta("", name, v)} })
	})
}

// testInformerKind drives one kind through the fake clientset's tracker (what
// the typed fake clients use too) and checks the events.
func testInformerKind[T Object](t *testing.T, kind Kind[T], res func(*testHive) Resource[T], mk func(ns, name, v string) T) {
	ns := ""
	if kind.Namespaced {
		ns = "ns"
	}
	key := func(name string) string { return Key{ns, name}.String() }
	gvr := kind.GVR()
	th := newTestHive(t, hiveOpts{k8s: true, before: func(th *testHive) {
		require.NoError(t, th.fake.Tracker().Create(gvr, mk(ns, "pre", "1"), ns))
	}})
	tracker := th.fake.Tracker()

	ev := subscribe(t, res(th))
	expect(t, ev, "Upsert "+key("pre")+" v=1", "Sync")

	require.NoError(t, tracker.Create(gvr, mk(ns, "a", "1"), ns))
	expect(t, ev, "Upsert "+key("a")+" v=1")
	require.NoError(t, tracker.Update(gvr, mk(ns, "a", "2"), ns))
	expect(t, ev, "Upsert "+key("a")+" v=2")
	require.NoError(t, tracker.Delete(gvr, ns, "a"))
	expect(t, ev, "Delete "+key("a")+" v=2")
	require.NoError(t, tracker.Delete(gvr, ns, "pre"))
	expect(t, ev, "Delete "+key("pre")+" v=1")
}

func TestInformerSubscribers(t *testing.T) {
	ctx := context.Background()
	// The fake tracker does not replay what changed between the informer's
	// list and its watch: the test changes objects only once the watch is
	// in place.
	watching := make(chan struct{})
	var once sync.Once
	th := newTestHive(t, hiveOpts{k8s: true, before: func(th *testHive) {
		for _, name := range []string{"b", "a"} {
			_, err := th.fake.CoreV1().Services("ns").Create(ctx, svc("ns", name, "1"), metav1.CreateOptions{})
			require.NoError(t, err)
		}
		th.fake.PrependWatchReactor("services", func(action k8stesting.Action) (bool, watch.Interface, error) {
			w, err := th.fake.Tracker().Watch(action.GetResource(), action.GetNamespace())
			if err == nil {
				once.Do(func() { close(watching) })
			}
			return true, w, err
		})
	}})
	services := th.fake.CoreV1().Services("ns")

	// Two subscribers, each gets the full replay; Sync comes after the
	// initial listing.
	ev1, ev2 := subscribe(t, th.services), subscribe(t, th.services)
	for _, ev := range []<-chan Event[*corev1.Service]{ev1, ev2} {
		expect(t, ev, "Upsert ns/a v=1", "Upsert ns/b v=1", "Sync")
	}
	obj := <-subscribe(t, th.services)
	require.Equal(t, ServiceKind.GVK, obj.Object.GroupVersionKind(), "type meta is set")
	select {
	case <-watching:
	case <-time.After(timeout):
		t.Fatal("the informer never started its watch")
	}

	_, err := services.Update(ctx, svc("ns", "a", "2"), metav1.UpdateOptions{})
	require.NoError(t, err)
	require.NoError(t, services.Delete(ctx, "b", metav1.DeleteOptions{}))
	_, err = services.Create(ctx, svc("ns", "c", "1"), metav1.CreateOptions{})
	require.NoError(t, err)
	for _, ev := range []<-chan Event[*corev1.Service]{ev1, ev2} {
		expect(t, ev, "Upsert ns/a v=2", "Delete ns/b v=1", "Upsert ns/c v=1")
	}

	// A late subscriber gets the current state only.
	expect(t, subscribe(t, th.services), "Upsert ns/a v=2", "Upsert ns/c v=1", "Sync")
}
