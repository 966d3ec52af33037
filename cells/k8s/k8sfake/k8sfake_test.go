package k8sfake

import (
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/hive/script"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/apiary-net/apiary/cells/k8s"
)

// widget is a kind of its own, as later features add (CRDs).
type widget struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Size int `json:"size"`
	} `json:"spec"`
}

func (w *widget) DeepCopyObject() runtime.Object {
	c := *w
	w.ObjectMeta.DeepCopyInto(&c.ObjectMeta)
	return &c
}

var widgetKind = k8s.Kind[*widget]{
	GVK:        schema.GroupVersionKind{Group: "example.com", Version: "v1", Kind: "Widget"},
	Resource:   "widgets",
	Namespaced: true,
}

func svcYAML(ns, name, version string) string {
	return "apiVersion: v1\nkind: Service\nmetadata:\n  namespace: " + ns + "\n  name: " + name +
		"\n  labels:\n    v: \"" + version + "\"\nspec:\n  clusterIP: 10.96.0.1\n"
}

func TestCommands(t *testing.T) {
	kinds := k8s.NewKinds()
	require.NoError(t, k8s.RegisterKind(kinds, widgetKind))
	f := New()
	f.Dynamic.addKinds(kinds)
	cmds := fakeScriptCommands(fakeCmdParams{Fake: f, Kinds: kinds}).ScriptCmds
	work := t.TempDir()
	for name, data := range map[string]string{
		"svc.yaml":    svcYAML("default", "a", "1") + "---\n" + svcYAML("ns", "b", "1") + "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: ns\n",
		"svc-v2.yaml": svcYAML("default", "a", "2"),
		"new.yaml":    svcYAML("default", "new", "1"),
		"bad.yaml":    "apiVersion: v1\nkind: Service\nmetadata:\n  name: [x\n",
		"gadget.yaml": "apiVersion: example.com/v1\nkind: Gadget\nmetadata:\n  name: g\n",
		"widget.yaml": "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\nspec:\n  size: 2\n",
	} {
		require.NoError(t, os.WriteFile(filepath.Join(work, name), []byte(data), 0o644))
	}
	state, err := script.NewState(t.Context(), work, nil)
	require.NoError(t, err)
	engine := &script.Engine{Cmds: map[string]script.Cmd{}}
	for _, c := range cmds {
		engine.Cmds[c.Name] = c.Cmd
	}
	run := func(line string) error { return engine.ExecuteLine(state, line, io.Discard) }
	services := schema.GroupVersionResource{Version: "v1", Resource: "services"}
	version := func(ns, name string) string {
		t.Helper()
		obj, err := f.Tracker().Get(services, ns, name)
		if err != nil {
			return err.Error()
		}
		return obj.(*corev1.Service).Labels["v"]
	}

	require.NoError(t, run("k8s/add svc.yaml"))
	require.Equal(t, "1", version("default", "a"))
	require.Equal(t, "1", version("ns", "b"))
	_, err = f.Tracker().Get(schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}, "", "ns")
	require.NoError(t, err)

	require.NoError(t, run("k8s/update svc-v2.yaml new.yaml"), "update creates what is missing")
	require.Equal(t, "2", version("default", "a"))
	require.Equal(t, "1", version("default", "new"))
	require.ErrorContains(t, run("k8s/add new.yaml"), `new.yaml:1: Service default/new: services "new" already exists`)

	require.NoError(t, run("k8s/delete svc.yaml new.yaml"))
	require.Equal(t, `services "a" not found`, version("default", "a"))

	require.NoError(t, run("k8s/add widget.yaml"), "a registered kind of another cell, a custom resource")
	u, err := f.Dynamic.Resource(widgetKind.GVR()).Namespace("default").Get(t.Context(), "w", metav1.GetOptions{})
	require.NoError(t, err)
	var w widget
	require.NoError(t, k8s.FromUnstructured(u.Object, &w))
	require.Equal(t, 2, w.Spec.Size)
	require.Equal(t, "Widget", u.GetKind())

	require.ErrorContains(t, run("k8s/add bad.yaml"), "bad.yaml:4: did not find expected ',' or ']'")
	require.ErrorContains(t, run("k8s/add gadget.yaml"), "gadget.yaml:1: kind example.com/v1, Kind=Gadget is not registered")
	require.ErrorContains(t, run("k8s/add missing.yaml"), "read missing.yaml")
	require.Error(t, run("k8s/add"))
}
