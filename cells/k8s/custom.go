package k8s

import (
	"context"
	"fmt"
	"reflect"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
)

// CustomResourceListWatch lists and watches the custom resource gvr (a
// CRD's, whose Go types apiary defines) through the clientset's dynamic
// client: lists arrive as L, watched objects as T. Decoding goes through
// the objects' JSON form, so a type's own UnmarshalJSON applies as it does
// for --config-dir.
func CustomResourceListWatch[T, L runtime.Object](c *Clientset, gvr schema.GroupVersionResource) cache.ListerWatcher {
	if c == nil || c.Dynamic == nil {
		return &failingListWatch{err: fmt.Errorf("no dynamic client for %s", gvr)}
	}
	res := c.Dynamic.Resource(gvr)
	return NewListWatch(c.Dynamic,
		func(ctx context.Context, opts metav1.ListOptions) (L, error) {
			out := newOf[L]()
			ul, err := res.List(ctx, opts)
			if err != nil {
				return out, err
			}
			if err := FromUnstructured(ul.UnstructuredContent(), out); err != nil {
				return out, fmt.Errorf("decode %s list: %w", gvr.Resource, err)
			}
			return out, nil
		},
		func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			w, err := res.Watch(ctx, opts)
			if err != nil {
				return nil, err
			}
			return watch.Filter(w, func(ev watch.Event) (watch.Event, bool) {
				u, ok := ev.Object.(*unstructured.Unstructured)
				if !ok || ev.Type == watch.Error {
					return ev, true
				}
				obj := newOf[T]()
				if err := FromUnstructured(u.Object, obj); err != nil {
					// The reflector ends the watch on an error event
					// and lists again: the list reports the object.
					return watch.Event{Type: watch.Error, Object: &metav1.Status{
						Status: metav1.StatusFailure, Reason: metav1.StatusReasonInvalid,
						Message: fmt.Sprintf("decode %s %s: %v", gvr.Resource, u.GetName(), err),
					}}, true
				}
				ev.Object = obj
				return ev, true
			}), nil
		})
}

// FromUnstructured decodes an object's unstructured content into out (a
// pointer to a typed object or list).
func FromUnstructured(content map[string]any, out any) error {
	return runtime.DefaultUnstructuredConverter.FromUnstructured(content, out)
}

// ToUnstructured is the unstructured form of obj, with the apiVersion and
// kind of gvk, as the dynamic client sends it.
func ToUnstructured(obj runtime.Object, gvk schema.GroupVersionKind) (*unstructured.Unstructured, error) {
	content, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{Object: content}
	u.SetGroupVersionKind(gvk)
	return u, nil
}

// newOf returns a new T, a pointer type.
func newOf[T any]() T {
	var zero T
	return reflect.New(reflect.TypeOf(zero).Elem()).Interface().(T)
}

// failingListWatch reports, on every call, the error of a client that could
// not be built, so that the informer retries and logs it instead of the
// process crashing.
type failingListWatch struct{ err error }

// List implements cache.Lister.
func (f *failingListWatch) List(metav1.ListOptions) (runtime.Object, error) { return nil, f.err }

// Watch implements cache.Watcher.
func (f *failingListWatch) Watch(metav1.ListOptions) (watch.Interface, error) { return nil, f.err }
