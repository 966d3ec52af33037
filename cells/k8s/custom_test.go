package k8s

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	dynamicfake "k8s.io/client-go/dynamic/fake"
)

// gadget is a custom resource's type, as apiary defines CRDs' types.
type gadget struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Size int `json:"size"`
	} `json:"spec"`
}

func (g *gadget) DeepCopyObject() runtime.Object {
	c := *g
	g.ObjectMeta.DeepCopyInto(&c.ObjectMeta)
	return &c
}

type gadgetList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata"`
	Items           []gadget `json:"items"`
}

func (l *gadgetList) DeepCopyObject() runtime.Object {
	c := *l
	c.Items = append([]gadget(nil), l.Items...)
	return &c
}

var gadgetGVR = schema.GroupVersionResource{Group: "example.com", Version: "v1", Resource: "gadgets"}

func gadgetObject(name string, size any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "example.com/v1", "kind": "Gadget",
		"metadata": map[string]any{"name": name, "namespace": "ns"},
		"spec":     map[string]any{"size": size},
	}}
}

// A custom resource comes through the dynamic client as the agent's own
// type, in lists and watches; an object that does not decode ends the
// watch with an error naming it (the reflector then lists again) rather
// than reaching the informer half-decoded.
func TestCustomResourceListWatch(t *testing.T) {
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{gadgetGVR: "GadgetList"}, gadgetObject("a", int64(1)))
	lw := CustomResourceListWatch[*gadget, *gadgetList](&Clientset{Dynamic: dyn}, gadgetGVR)

	obj, err := lw.List(metav1.ListOptions{})
	require.NoError(t, err)
	l := obj.(*gadgetList)
	require.Len(t, l.Items, 1)
	require.Equal(t, "a", l.Items[0].Name)
	require.Equal(t, 1, l.Items[0].Spec.Size)

	w, err := lw.Watch(metav1.ListOptions{ResourceVersion: l.ResourceVersion})
	require.NoError(t, err)
	defer w.Stop()
	ctx := context.Background()
	_, err = dyn.Resource(gadgetGVR).Namespace("ns").Create(ctx, gadgetObject("b", int64(2)), metav1.CreateOptions{})
	require.NoError(t, err)
	ev := <-w.ResultChan()
	require.Equal(t, watch.Added, ev.Type)
	g, ok := ev.Object.(*gadget)
	require.True(t, ok, "event object %T", ev.Object)
	require.Equal(t, "b", g.Name)
	require.Equal(t, 2, g.Spec.Size)

	_, err = dyn.Resource(gadgetGVR).Namespace("ns").Create(ctx, gadgetObject("c", "big"), metav1.CreateOptions{})
	require.NoError(t, err)
	ev = <-w.ResultChan()
	require.Equal(t, watch.Error, ev.Type)
	require.Contains(t, ev.Object.(*metav1.Status).Message, "decode gadgets c")

	none := CustomResourceListWatch[*gadget, *gadgetList](&Clientset{}, gadgetGVR)
	_, err = none.List(metav1.ListOptions{})
	require.ErrorContains(t, err, "no dynamic client for example.com/v1, Resource=gadgets")
}
