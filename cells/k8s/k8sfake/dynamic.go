package k8sfake

import (
	"sync"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"

	"github.com/apiary-net/apiary/cells/k8s"
)

// Dynamic is the fake dynamic client of tests, which serves the custom
// resources apiary defines (k8s.CustomResourceListWatch) as a real API
// server's dynamic client does: client-go's fake dynamic client, made on
// first use. It must know each resource's list kind before its first list,
// so it is made once the hives using it have registered their kinds.
type Dynamic struct {
	mu    sync.Mutex
	kinds []*k8s.Kinds
	fake  *dynamicfake.FakeDynamicClient
}

var _ dynamic.Interface = (*Dynamic)(nil)

// NewDynamic returns a Dynamic that knows the kinds of kinds (and those of
// every hive it is given to through NewCell).
func NewDynamic(kinds ...*k8s.Kinds) *Dynamic {
	return &Dynamic{kinds: kinds}
}

func (d *Dynamic) addKinds(k *k8s.Kinds) {
	if k == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.kinds = append(d.kinds, k)
}

// Fake returns client-go's fake dynamic client, for its tracker and the
// actions it recorded.
func (d *Dynamic) Fake() *dynamicfake.FakeDynamicClient {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.fake == nil {
		listKinds := map[schema.GroupVersionResource]string{}
		for _, k := range d.kinds {
			for gvr, gvk := range k.Resources() {
				if isCustom(gvr) {
					listKinds[gvr] = gvk.Kind + "List"
				}
			}
		}
		d.fake = dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), listKinds)
	}
	return d.fake
}

// Resource implements dynamic.Interface.
func (d *Dynamic) Resource(gvr schema.GroupVersionResource) dynamic.NamespaceableResourceInterface {
	return d.Fake().Resource(gvr)
}

// IsWatchListSemanticsUnSupported says, as client-go's fakes do, that the
// fake cannot stream a list through a watch: informers list, then watch.
func (d *Dynamic) IsWatchListSemanticsUnSupported() bool { return true }

// kindOf is the registered kind of a custom resource.
func (d *Dynamic) kindOf(gvr schema.GroupVersionResource) (schema.GroupVersionKind, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, k := range d.kinds {
		if gvk, ok := k.Resources()[gvr]; ok {
			return gvk, true
		}
	}
	return schema.GroupVersionKind{}, false
}

// isCustom says whether a resource is a custom one (served through the
// dynamic client), not one of Kubernetes' built-in API groups (served
// through the clientset).
func isCustom(gvr schema.GroupVersionResource) bool {
	return !clientgoscheme.Scheme.IsGroupRegistered(gvr.Group)
}
