package k8sfake

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// An object a watch delivers is the watcher's to change (informers set its
// type meta and drop its managed fields): the tracker's copy stays as it was.
// Without copyWatches the tracker hands a watch started after a list (with a
// resource version) the very objects it stores, for those that changed since.
func TestWatchObjectsAreTheWatchers(t *testing.T) {
	f := fake.NewSimpleClientset() //nolint:staticcheck // as Cell
	copyWatches(f)
	ctx := t.Context()
	pods := f.CoreV1().Pods("ns")
	if _, err := pods.Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "a"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w, err := pods.Watch(ctx, metav1.ListOptions{ResourceVersion: "1"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	// Then an event the tracker sends as it stores the object.
	if _, err := pods.Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "b"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"a", "b"} {
		var pod *corev1.Pod
		select {
		case ev := <-w.ResultChan():
			pod = ev.Object.(*corev1.Pod)
		case <-time.After(10 * time.Second):
			t.Fatalf("no watch event for %s", name)
		}
		if pod.Name != name {
			t.Fatalf("watch delivered %s, want %s", pod.Name, name)
		}
		pod.Labels = map[string]string{"changed": "by the watcher"}
		got, err := pods.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got.Labels["changed"] != "" {
			t.Fatalf("%s: the watcher's change reached the tracker: %v", name, got.Labels)
		}
	}
}
