package k8s

import (
	"context"
	"fmt"
	"reflect"
	"sync"

	"github.com/cilium/hive/cell"
	"github.com/go-logr/logr"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// startInformer feeds r from a client-go informer that runs from hive start
// to hive stop. The informer source counts as synced once the handler has
// received the initial listing. Its lists and watches go through listWatch,
// which reports them in health (nil: not reported) and handles optional
// kinds whose resource is not served.
func startInformer[T Object](r *resource[T], lc cell.Lifecycle, cs *Clientset, health cell.Health, opts ResourceOptions) {
	var (
		cancel context.CancelFunc
		wg     sync.WaitGroup
	)
	lc.Append(cell.Hook{
		OnStart: func(cell.HookContext) error {
			lw := newListWatch(r, r.kind.ListWatch(cs), health, opts)
			inf := cache.NewSharedIndexInformer(lw, newObject[T](), 0, cache.Indexers{})
			if err := inf.SetTransform(r.transform); err != nil {
				return fmt.Errorf("informer for %s: %w", r.kind.GVK, err)
			}
			reg, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
				AddFunc:    r.onInformerAdd,
				UpdateFunc: r.onInformerUpdate,
				DeleteFunc: r.onInformerDelete,
			})
			if err != nil {
				return fmt.Errorf("informer for %s: %w", r.kind.GVK, err)
			}

			// The hook context ends with the start phase, so the informer
			// gets its own. client-go logs through klog's contextual logger:
			// route it into the module's slog logger.
			var ctx context.Context
			ctx, cancel = context.WithCancel(context.Background())
			ctx = klog.NewContext(ctx, logr.FromSlogHandler(r.log.Handler()))
			wg.Add(2)
			go func() {
				defer wg.Done()
				inf.RunWithContext(ctx)
			}()
			go func() {
				defer wg.Done()
				select {
				case <-reg.HasSyncedChecker().Done():
					r.markSynced(sourceInformer)
				case <-ctx.Done():
				}
			}()
			return nil
		},
		OnStop: func(cell.HookContext) error {
			if cancel != nil {
				cancel()
				wg.Wait()
			}
			return nil
		},
	})
}

// newObject returns a new zero object of T's element type (T is a pointer,
// which describe checks before any informer is built).
func newObject[T Object]() T {
	return reflect.New(reflect.TypeFor[T]().Elem()).Interface().(T)
}

// transform runs before the informer stores an object: it drops managed
// fields, which nobody here reads and which cost memory, and sets the type
// meta that the API server leaves out of list items, so that objects look the
// same whichever source they come from.
func (r *resource[T]) transform(obj any) (any, error) {
	if o, ok := obj.(T); ok {
		o.SetManagedFields(nil)
		o.GetObjectKind().SetGroupVersionKind(r.kind.GVK)
	}
	return obj, nil
}

func (r *resource[T]) onInformerAdd(obj any) {
	if o, ok := obj.(T); ok {
		r.upsert(sourceInformer, o)
	}
}

func (r *resource[T]) onInformerUpdate(oldObj, newObj any) {
	o, ok := newObj.(T)
	if !ok {
		return
	}
	// A relist after a watch expired replays unchanged objects; they carry
	// the same resource version and are not news.
	if old, ok := oldObj.(T); ok && old.GetResourceVersion() != "" &&
		old.GetResourceVersion() == o.GetResourceVersion() {
		return
	}
	r.upsert(sourceInformer, o)
}

func (r *resource[T]) onInformerDelete(obj any) {
	switch o := obj.(type) {
	case T:
		r.delete(sourceInformer, KeyOf(o))
	case cache.DeletedFinalStateUnknown:
		// The watch missed the delete; the informer only knows the key.
		ns, name, err := cache.SplitMetaNamespaceKey(o.Key)
		if err != nil {
			r.log.Warn("Bad key in informer delete", "key", o.Key, "error", err)
			return
		}
		r.delete(sourceInformer, Key{Namespace: ns, Name: name})
	}
}
