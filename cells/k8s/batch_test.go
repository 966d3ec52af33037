package k8s_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/apiary-net/apiary/cells/k8s"
)

// batchStreams are the channels of one ReceiveBatch/DrainBatch case, with
// the events each handler got, as "pod/NAME", "ns/NAME", "svc/NAME" or
// "pod/Sync"..., in order.
type batchStreams struct {
	pods chan k8s.Event[*corev1.Pod]
	nss  chan k8s.Event[*corev1.Namespace]
	svcs chan k8s.Event[*corev1.Service]
	wake chan struct{}
	got  []string
}

func newBatchStreams() *batchStreams {
	return &batchStreams{
		pods: make(chan k8s.Event[*corev1.Pod], 100),
		nss:  make(chan k8s.Event[*corev1.Namespace], 100),
		svcs: make(chan k8s.Event[*corev1.Service], 100),
		wake: make(chan struct{}, 1),
	}
}

func (s *batchStreams) onPod(ev k8s.Event[*corev1.Pod]) { s.got = append(s.got, "pod/"+batchName(ev)) }
func (s *batchStreams) onNS(ev k8s.Event[*corev1.Namespace]) {
	s.got = append(s.got, "ns/"+batchName(ev))
}
func (s *batchStreams) onSvc(ev k8s.Event[*corev1.Service]) {
	s.got = append(s.got, "svc/"+batchName(ev))
}

func batchName[T k8s.Object](ev k8s.Event[T]) string {
	if ev.Kind == k8s.Sync {
		return "Sync"
	}
	return ev.Key.Name
}

func podEvent(name string) k8s.Event[*corev1.Pod] {
	return k8s.Event[*corev1.Pod]{Kind: k8s.Upsert, Key: k8s.Key{Name: name},
		Object: &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}}}
}

func nsEvent(name string) k8s.Event[*corev1.Namespace] {
	return k8s.Event[*corev1.Namespace]{Kind: k8s.Upsert, Key: k8s.Key{Name: name},
		Object: &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}}
}

func svcEvent(name string) k8s.Event[*corev1.Service] {
	return k8s.Event[*corev1.Service]{Kind: k8s.Upsert, Key: k8s.Key{Name: name},
		Object: &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name}}}
}

func TestReceiveBatch(t *testing.T) {
	tests := []struct {
		name string
		// setup fills the channels (and may cancel the context) before the
		// call.
		setup   func(s *batchStreams, cancel context.CancelFunc)
		max     int
		noWake  bool // pass a nil wake channel
		streams int  // 2: pods and namespaces; 3: services too
		wantN   int
		wantOK  bool
		// want are the events handled, in order; nil: any order of wantSet.
		want    []string
		wantSet []string
	}{{
		name: "events ready are taken in one batch",
		setup: func(s *batchStreams, _ context.CancelFunc) {
			s.pods <- podEvent("a")
			s.pods <- podEvent("b")
			s.pods <- k8s.Event[*corev1.Pod]{Kind: k8s.Sync}
		},
		max: 10, streams: 2, wantN: 3, wantOK: true,
		want: []string{"pod/a", "pod/b", "pod/Sync"},
	}, {
		name: "both streams interleaved, each in its order",
		setup: func(s *batchStreams, _ context.CancelFunc) {
			s.pods <- podEvent("a")
			s.nss <- nsEvent("x")
			s.pods <- podEvent("b")
			s.nss <- nsEvent("y")
			s.nss <- k8s.Event[*corev1.Namespace]{Kind: k8s.Sync}
		},
		max: 10, streams: 2, wantN: 5, wantOK: true,
		wantSet: []string{"pod/a", "pod/b", "ns/x", "ns/y", "ns/Sync"},
	}, {
		name: "three streams",
		setup: func(s *batchStreams, _ context.CancelFunc) {
			s.pods <- podEvent("a")
			s.nss <- nsEvent("x")
			s.svcs <- svcEvent("s")
			s.svcs <- svcEvent("t")
		},
		max: 10, streams: 3, wantN: 4, wantOK: true,
		wantSet: []string{"pod/a", "ns/x", "svc/s", "svc/t"},
	}, {
		name: "max is respected",
		setup: func(s *batchStreams, _ context.CancelFunc) {
			for _, n := range []string{"a", "b", "c", "d", "e"} {
				s.pods <- podEvent(n)
			}
		},
		max: 3, streams: 2, wantN: 3, wantOK: true,
		want: []string{"pod/a", "pod/b", "pod/c"},
	}, {
		name: "max below 1 still takes the first event",
		setup: func(s *batchStreams, _ context.CancelFunc) {
			s.pods <- podEvent("a")
			s.pods <- podEvent("b")
		},
		max: 0, streams: 2, wantN: 1, wantOK: true,
		want: []string{"pod/a"},
	}, {
		name: "wake ends the wait with no event",
		setup: func(s *batchStreams, _ context.CancelFunc) {
			s.wake <- struct{}{}
		},
		max: 10, streams: 2, wantN: 0, wantOK: true,
	}, {
		name: "closed wake ends the wait",
		setup: func(s *batchStreams, _ context.CancelFunc) {
			close(s.wake)
		},
		max: 10, streams: 3, wantN: 0, wantOK: true,
	}, {
		name: "context done",
		setup: func(_ *batchStreams, cancel context.CancelFunc) {
			cancel()
		},
		max: 10, streams: 2, noWake: true, wantN: 0, wantOK: false,
	}, {
		name: "closed stream while waiting",
		setup: func(s *batchStreams, _ context.CancelFunc) {
			close(s.nss)
		},
		max: 10, streams: 2, wantN: 0, wantOK: false,
	}, {
		name: "closed third stream while waiting",
		setup: func(s *batchStreams, _ context.CancelFunc) {
			close(s.svcs)
		},
		max: 10, streams: 3, noWake: true, wantN: 0, wantOK: false,
	}, {
		name: "stream closed while draining counts what came before",
		setup: func(s *batchStreams, _ context.CancelFunc) {
			s.pods <- podEvent("a")
			s.pods <- podEvent("b")
			close(s.pods)
		},
		max: 10, streams: 2, wantN: 2, wantOK: false,
		want: []string{"pod/a", "pod/b"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			s := newBatchStreams()
			tt.setup(s, cancel)
			var wake <-chan struct{} = s.wake
			if tt.noWake {
				wake = nil
			}
			var n int
			var ok bool
			if tt.streams == 3 {
				n, ok = k8s.ReceiveBatch3(ctx, wake, tt.max, s.pods, s.onPod, s.nss, s.onNS, s.svcs, s.onSvc)
			} else {
				n, ok = k8s.ReceiveBatch2(ctx, wake, tt.max, s.pods, s.onPod, s.nss, s.onNS)
			}
			require.Equal(t, tt.wantN, n, "n")
			require.Equal(t, tt.wantOK, ok, "ok")
			require.Len(t, s.got, n, "handled events")
			if tt.wantSet != nil {
				require.ElementsMatch(t, tt.wantSet, s.got)
				// Each stream's own events keep their order.
				for _, prefix := range []string{"pod/", "ns/", "svc/"} {
					require.Equal(t, filterPrefix(tt.wantSet, prefix), filterPrefix(s.got, prefix))
				}
			} else {
				require.Equal(t, tt.want, s.got)
			}
		})
	}
}

func filterPrefix(xs []string, prefix string) []string {
	var out []string
	for _, x := range xs {
		if len(x) >= len(prefix) && x[:len(prefix)] == prefix {
			out = append(out, x)
		}
	}
	return out
}

// TestReceiveBatchBlocks checks that the wait lasts until something happens:
// an event sent later, a later wake, or the context ending later.
func TestReceiveBatchBlocks(t *testing.T) {
	tests := []struct {
		name   string
		later  func(s *batchStreams, cancel context.CancelFunc)
		wantN  int
		wantOK bool
	}{
		{"event", func(s *batchStreams, _ context.CancelFunc) { s.nss <- nsEvent("x") }, 1, true},
		{"wake", func(s *batchStreams, _ context.CancelFunc) { s.wake <- struct{}{} }, 0, true},
		{"context", func(_ *batchStreams, cancel context.CancelFunc) { cancel() }, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			s := newBatchStreams()
			type result struct {
				n  int
				ok bool
			}
			done := make(chan result)
			go func() {
				n, ok := k8s.ReceiveBatch2(ctx, s.wake, 10, s.pods, s.onPod, s.nss, s.onNS)
				done <- result{n, ok}
			}()
			select {
			case r := <-done:
				t.Fatalf("returned %+v with nothing to receive", r)
			case <-time.After(50 * time.Millisecond):
			}
			tt.later(s, cancel)
			r := <-done
			require.Equal(t, result{tt.wantN, tt.wantOK}, r)
		})
	}
}

func TestDrainBatch(t *testing.T) {
	tests := []struct {
		name   string
		pods   int
		nss    int
		close  bool // close the pods stream after its events
		max    int
		wantN  int
		wantOK bool
	}{
		{name: "nothing ready returns at once", max: 10, wantN: 0, wantOK: true},
		{name: "takes all ready", pods: 2, nss: 3, max: 10, wantN: 5, wantOK: true},
		{name: "max respected", pods: 4, nss: 4, max: 5, wantN: 5, wantOK: true},
		{name: "zero max takes none", pods: 1, max: 0, wantN: 0, wantOK: true},
		{name: "closed stream", pods: 1, close: true, max: 10, wantN: 1, wantOK: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newBatchStreams()
			for i := range tt.pods {
				s.pods <- podEvent(string(rune('a' + i)))
			}
			for i := range tt.nss {
				s.nss <- nsEvent(string(rune('a' + i)))
			}
			if tt.close {
				close(s.pods)
			}
			n, ok := k8s.DrainBatch2(tt.max, s.pods, s.onPod, s.nss, s.onNS)
			require.Equal(t, tt.wantN, n, "n")
			require.Equal(t, tt.wantOK, ok, "ok")
			require.Len(t, s.got, n)
			require.True(t, slices.IsSorted(filterPrefix(s.got, "pod/")), "pods in order: %v", s.got)
			// What was not taken is still there for the next batch.
			require.Equal(t, tt.pods+tt.nss-n, len(s.pods)+len(s.nss))
		})
	}
}

func TestTrackSync(t *testing.T) {
	synced := false
	var changed []string
	h := k8s.TrackSync(&synced, func(ev k8s.Event[*corev1.Pod]) { changed = append(changed, ev.Key.Name) })
	h(podEvent("a"))
	require.False(t, synced, "synced before Sync")
	h(k8s.Event[*corev1.Pod]{Kind: k8s.Sync})
	require.True(t, synced, "synced after Sync")
	h(k8s.Event[*corev1.Pod]{Kind: k8s.Delete, Key: k8s.Key{Name: "a"}})
	require.Equal(t, []string{"a", "a"}, changed, "Sync is not passed on")
}

// BenchmarkReceiveBatch2 measures the helper alone: a producer sends b.N
// events alternating between two streams and the consumer takes them in
// batches of up to 1000.
func BenchmarkReceiveBatch2(b *testing.B) {
	pods := make(chan k8s.Event[*corev1.Pod], 1000)
	nss := make(chan k8s.Event[*corev1.Namespace], 1000)
	pev, nev := podEvent("a"), nsEvent("x")
	go func() {
		for i := range b.N {
			if i%2 == 0 {
				pods <- pev
			} else {
				nss <- nev
			}
		}
	}()
	got := 0
	onPod := func(k8s.Event[*corev1.Pod]) { got++ }
	onNS := func(k8s.Event[*corev1.Namespace]) { got++ }
	var noWake <-chan struct{}
	b.ResetTimer()
	for got < b.N {
		if _, ok := k8s.ReceiveBatch2(b.Context(), noWake, 1000, pods, onPod, nss, onNS); !ok {
			b.Fatal("stream ended")
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
}

// ReceiveBatch4: an event on the fourth stream ends the wait as one on
// the others does; a batch takes from all four up to max; a closed fourth
// stream stops the caller; a wake takes nothing.
func TestReceiveBatch4(t *testing.T) {
	ctx := context.Background()
	eps := func() chan k8s.Event[*corev1.Endpoints] { return make(chan k8s.Event[*corev1.Endpoints], 100) }
	epEvent := func(name string) k8s.Event[*corev1.Endpoints] {
		return k8s.Event[*corev1.Endpoints]{Kind: k8s.Upsert, Key: k8s.Key{Name: name},
			Object: &corev1.Endpoints{ObjectMeta: metav1.ObjectMeta{Name: name}}}
	}
	for _, tc := range []struct {
		name   string
		max    int
		fill   func(s *batchStreams, d chan k8s.Event[*corev1.Endpoints])
		wantN  int
		wantOK bool
		want   []string
	}{
		{"fourth alone", 10, func(s *batchStreams, d chan k8s.Event[*corev1.Endpoints]) { d <- epEvent("e1") },
			1, true, []string{"ep/e1"}},
		{"all four, bounded", 3, func(s *batchStreams, d chan k8s.Event[*corev1.Endpoints]) {
			s.pods <- podEvent("p1")
			s.nss <- nsEvent("n1")
			s.svcs <- svcEvent("s1")
			d <- epEvent("e1")
			d <- epEvent("e2")
		}, 3, true, nil},
		{"all four", 10, func(s *batchStreams, d chan k8s.Event[*corev1.Endpoints]) {
			s.pods <- podEvent("p1")
			s.nss <- nsEvent("n1")
			s.svcs <- svcEvent("s1")
			d <- epEvent("e1")
			d <- epEvent("e2")
		}, 5, true, nil},
		{"fourth closed", 10, func(s *batchStreams, d chan k8s.Event[*corev1.Endpoints]) { close(d) }, 0, false, []string{}},
		{"wake", 10, func(s *batchStreams, d chan k8s.Event[*corev1.Endpoints]) { s.wake <- struct{}{} }, 0, true, []string{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, d := newBatchStreams(), eps()
			tc.fill(s, d)
			n, ok := k8s.ReceiveBatch4(ctx, s.wake, tc.max, s.pods, s.onPod, s.nss, s.onNS, s.svcs, s.onSvc, d,
				func(ev k8s.Event[*corev1.Endpoints]) { s.got = append(s.got, "ep/"+batchName(ev)) })
			if n != tc.wantN || ok != tc.wantOK || len(s.got) != n {
				t.Fatalf("n=%d ok=%v got %v, want n=%d ok=%v", n, ok, s.got, tc.wantN, tc.wantOK)
			}
			if tc.want != nil && fmt.Sprint(s.got) != fmt.Sprint(tc.want) {
				t.Errorf("got %v, want %v", s.got, tc.want)
			}
		})
	}
}
