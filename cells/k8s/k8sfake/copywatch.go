package k8sfake

import (
	"sync"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// copyWatches makes every watch of f deliver objects of its own. client-go's
// object tracker (v0.36) sends a watch started with list options the objects
// it stores, not copies, for those that changed since the list (its other
// events are copies). The informers' transform then writes to them (managed
// fields, type meta) while the tracker reads them for a List or a Get: a data
// race that the race detector reports. This reactor, prepended to the
// tracker's own, starts the same watch and copies each event's object.
func copyWatches(f *fake.Clientset) {
	f.PrependWatchReactor("*", func(action k8stesting.Action) (bool, watch.Interface, error) {
		var opts metav1.ListOptions
		if a, ok := action.(k8stesting.WatchActionImpl); ok {
			opts = a.ListOptions
		}
		w, err := f.Tracker().Watch(action.GetResource(), action.GetNamespace(), opts)
		if err != nil {
			return false, nil, err
		}
		return true, newCopyingWatch(w), nil
	})
}

// copyingWatch relays the events of a watch with their objects copied.
type copyingWatch struct {
	w        watch.Interface
	ch       chan watch.Event
	stop     chan struct{}
	stopOnce sync.Once
}

func newCopyingWatch(w watch.Interface) *copyingWatch {
	c := &copyingWatch{w: w, ch: make(chan watch.Event), stop: make(chan struct{})}
	go func() {
		defer close(c.ch)
		for ev := range w.ResultChan() {
			if ev.Object != nil {
				ev.Object = ev.Object.DeepCopyObject()
			}
			select {
			case c.ch <- ev:
			case <-c.stop:
				return
			}
		}
	}()
	return c
}

func (c *copyingWatch) ResultChan() <-chan watch.Event { return c.ch }

func (c *copyingWatch) Stop() {
	c.stopOnce.Do(func() {
		close(c.stop)
		c.w.Stop()
	})
}
