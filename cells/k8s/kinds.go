// Package k8s delivers Kubernetes objects to feature cells as typed event
// streams. Objects come from the API server through client-go informers
// (when a kubeconfig or in-cluster config is available) and/or from a watched
// directory of YAML files (--config-dir); both sources feed the same
// Resource[T], so feature cells don't care where an object came from.
package k8s

import (
	"cmp"
	"context"
	"fmt"
	"reflect"
	"slices"
	"sync"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
)

// Object is what a Resource delivers: a typed Kubernetes object such as
// *corev1.Service. Objects handed out by this package are shared between
// subscribers and must be treated as read-only.
type Object interface {
	runtime.Object
	metav1.Object
}

// Key identifies an object of one kind: its namespace (empty for cluster-scoped
// kinds) and name.
type Key struct {
	Namespace string
	Name      string
}

// KeyOf returns the key of obj.
func KeyOf(obj metav1.Object) Key {
	return Key{Namespace: obj.GetNamespace(), Name: obj.GetName()}
}

// String returns "namespace/name", or "name" for cluster-scoped objects.
func (k Key) String() string {
	if k.Namespace == "" {
		return k.Name
	}
	return k.Namespace + "/" + k.Name
}

// Kind describes one object type the sources deliver. Kinds are immutable
// descriptors: declare them as package variables and never modify them.
type Kind[T Object] struct {
	// GVK is the apiVersion and kind that documents in --config-dir use.
	GVK schema.GroupVersionKind
	// Resource is the plural resource name, e.g. "services".
	Resource string
	// Namespaced is true for namespaced kinds; objects of such kinds without a
	// namespace get "default".
	Namespaced bool
	// Optional marks a kind whose resource the API server may legitimately
	// not serve: a CRD of another project (Cilium's policies) that the
	// cluster may not have installed. While the API server answers its list
	// with 404, the informer source counts as synced with no objects (so
	// subscribers get Sync), one warning is logged, health says so without
	// degrading, and the resource is checked again with backoff (up to once
	// a minute) so that its objects arrive once the CRD is installed; if the
	// CRD is deleted, its objects are delivered as Deletes. A 404 for a kind
	// that is not optional is an error, retried and reported in health.
	Optional bool
	// ListWatch builds the informer's ListerWatcher. It is built from the typed
	// clientset so that it works with the fake one too. Nil means the kind
	// only comes from --config-dir.
	ListWatch func(*Clientset) cache.ListerWatcher
}

// GVR returns the group, version and resource of the kind.
func (k Kind[T]) GVR() schema.GroupVersionResource {
	return k.GVK.GroupVersion().WithResource(k.Resource)
}

// NewListWatch builds a ListerWatcher from a typed client's List and Watch
// methods. client is the clientset the functions use: a fake clientset says
// through it that it can't do watch-list streaming, so the reflector falls
// back to list+watch.
func NewListWatch[L runtime.Object](
	client any,
	list func(context.Context, metav1.ListOptions) (L, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error),
) cache.ListerWatcher {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			return list(ctx, opts)
		},
		WatchFuncWithContext: watchFn,
	}
	return cache.ToListWatcherWithWatchListSemantics(lw, client)
}

// ServiceKind is v1 Service.
var ServiceKind = Kind[*corev1.Service]{
	GVK:        corev1.SchemeGroupVersion.WithKind("Service"),
	Resource:   "services",
	Namespaced: true,
	ListWatch: func(c *Clientset) cache.ListerWatcher {
		return NewListWatch(c.Interface, c.CoreV1().Services("").List, c.CoreV1().Services("").Watch)
	},
}

// EndpointSliceKind is discovery.k8s.io/v1 EndpointSlice.
var EndpointSliceKind = Kind[*discoveryv1.EndpointSlice]{
	GVK:        discoveryv1.SchemeGroupVersion.WithKind("EndpointSlice"),
	Resource:   "endpointslices",
	Namespaced: true,
	ListWatch: func(c *Clientset) cache.ListerWatcher {
		return NewListWatch(c.Interface, c.DiscoveryV1().EndpointSlices("").List, c.DiscoveryV1().EndpointSlices("").Watch)
	},
}

// PodKind is v1 Pod.
var PodKind = Kind[*corev1.Pod]{
	GVK:        corev1.SchemeGroupVersion.WithKind("Pod"),
	Resource:   "pods",
	Namespaced: true,
	ListWatch: func(c *Clientset) cache.ListerWatcher {
		return NewListWatch(c.Interface, c.CoreV1().Pods("").List, c.CoreV1().Pods("").Watch)
	},
}

// NamespaceKind is v1 Namespace.
var NamespaceKind = Kind[*corev1.Namespace]{
	GVK:        corev1.SchemeGroupVersion.WithKind("Namespace"),
	Resource:   "namespaces",
	Namespaced: false,
	ListWatch: func(c *Clientset) cache.ListerWatcher {
		return NewListWatch(c.Interface, c.CoreV1().Namespaces().List, c.CoreV1().Namespaces().Watch)
	},
}

// NodeKind is v1 Node: the cluster's nodes, whose addresses the agent
// gives the remote-node identity (cells/clusternodes).
var NodeKind = Kind[*corev1.Node]{
	GVK:        corev1.SchemeGroupVersion.WithKind("Node"),
	Resource:   "nodes",
	Namespaced: false,
	ListWatch: func(c *Clientset) cache.ListerWatcher {
		return NewListWatch(c.Interface, c.CoreV1().Nodes().List, c.CoreV1().Nodes().Watch)
	},
}

// kindDesc is the untyped view of a Kind that the decoders work with.
type kindDesc struct {
	gvk        schema.GroupVersionKind
	resource   string
	namespaced bool
	typ        reflect.Type // the pointer type T
}

func describe[T Object](kind Kind[T]) (kindDesc, error) {
	typ := reflect.TypeFor[T]()
	if typ.Kind() != reflect.Pointer || typ.Elem().Kind() != reflect.Struct {
		return kindDesc{}, fmt.Errorf("kind %s: type %s is not a pointer to a struct", kind.GVK, typ)
	}
	if kind.GVK.Kind == "" || kind.GVK.Version == "" {
		return kindDesc{}, fmt.Errorf("kind %s (%s): GVK needs a version and a kind", kind.GVK, typ)
	}
	return kindDesc{gvk: kind.GVK, resource: kind.Resource, namespaced: kind.Namespaced, typ: typ}, nil
}

func (d *kindDesc) newObject() Object {
	return reflect.New(d.typ.Elem()).Interface().(Object)
}

func (d *kindDesc) gvr() schema.GroupVersionResource {
	return d.gvk.GroupVersion().WithResource(d.resource)
}

// Kinds is the set of kinds the YAML decoder knows: the directory source and
// the fake clientset's script commands decode documents with it. The core
// kinds are always known; NewResource registers any other kind it is given.
type Kinds struct {
	mu    sync.RWMutex
	byGVK map[schema.GroupVersionKind]kindDesc
	// generation counts registrations so that the directory source can tell
	// that files it skipped may now decode to something.
	generation uint64
}

// NewKinds returns a registry holding the core kinds (Service,
// EndpointSlice, Pod, Namespace).
func NewKinds() *Kinds {
	k := &Kinds{byGVK: map[schema.GroupVersionKind]kindDesc{}}
	for _, err := range []error{
		RegisterKind(k, ServiceKind),
		RegisterKind(k, EndpointSliceKind),
		RegisterKind(k, PodKind),
		RegisterKind(k, NamespaceKind),
	} {
		if err != nil {
			panic(err) // the core kinds are static and known to be valid
		}
	}
	return k
}

// RegisterKind makes documents of kind.GVK decode into T. Registering the same
// kind again is a no-op; registering another Go type for a known GVK is an
// error.
func RegisterKind[T Object](k *Kinds, kind Kind[T]) error {
	d, err := describe(kind)
	if err != nil {
		return err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if old, ok := k.byGVK[d.gvk]; ok {
		if old.typ != d.typ {
			return fmt.Errorf("kind %s is already registered with type %s, cannot register %s", d.gvk, old.typ, d.typ)
		}
		return nil
	}
	k.byGVK[d.gvk] = d
	k.generation++
	return nil
}

// GVKs returns the registered kinds, sorted.
func (k *Kinds) GVKs() []schema.GroupVersionKind {
	k.mu.RLock()
	defer k.mu.RUnlock()
	out := make([]schema.GroupVersionKind, 0, len(k.byGVK))
	for gvk := range k.byGVK {
		out = append(out, gvk)
	}
	slices.SortFunc(out, func(a, b schema.GroupVersionKind) int {
		return cmp.Compare(a.String(), b.String())
	})
	return out
}

func (k *Kinds) lookup(gvk schema.GroupVersionKind) (kindDesc, bool) {
	if k == nil {
		return kindDesc{}, false
	}
	k.mu.RLock()
	defer k.mu.RUnlock()
	d, ok := k.byGVK[gvk]
	return d, ok
}

func (k *Kinds) gen() uint64 {
	k.mu.RLock()
	defer k.mu.RUnlock()
	return k.generation
}

// Resource returns the API resource of a registered kind, for clients that
// address objects by resource (the fake clientset's tracker).
func (k *Kinds) Resource(gvk schema.GroupVersionKind) (schema.GroupVersionResource, bool) {
	d, ok := k.lookup(gvk)
	if !ok {
		return schema.GroupVersionResource{}, false
	}
	return d.gvr(), true
}

// Resources returns the registered kinds by API resource.
func (k *Kinds) Resources() map[schema.GroupVersionResource]schema.GroupVersionKind {
	k.mu.RLock()
	defer k.mu.RUnlock()
	out := make(map[schema.GroupVersionResource]schema.GroupVersionKind, len(k.byGVK))
	for gvk, d := range k.byGVK {
		out[d.gvr()] = gvk
	}
	return out
}
