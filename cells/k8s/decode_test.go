package k8s

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

func TestDecodeFile(t *testing.T) {
	svc := "apiVersion: v1\nkind: Service\nmetadata:\n  name: %s\n"
	tests := []struct {
		name string
		in   string
		// want lists "Kind key @line" per decoded object ("?" marks a
		// skipped document of an unknown kind).
		want []string
		// wantErr lists substrings the error must contain, one per line.
		wantErr []string
	}{
		{
			name: "empty",
			in:   "",
		},
		{
			name: "only separators and comments",
			in:   "---\n# nothing\n---\n\n---\n",
		},
		{
			name: "several documents, leading separator",
			in:   "---\n" + fmt.Sprintf(svc, "a") + "---\n" + fmt.Sprintf(svc, "b") + "  namespace: x\n",
			want: []string{"Service default/a @2", "Service x/b @7"},
		},
		{
			name: "separator with trailing blanks, CRLF",
			in:   strings.ReplaceAll(fmt.Sprintf(svc, "a")+"--- \n"+fmt.Sprintf(svc, "b"), "\n", "\r\n"),
			want: []string{"Service default/a @1", "Service default/b @6"},
		},
		{
			name: "separator inside a document's own stream",
			in:   fmt.Sprintf(svc, "a") + "--- # comment\n" + fmt.Sprintf(svc, "b"),
			want: []string{"Service default/a @1", "Service default/b @6"},
		},
		{
			name: "cluster-scoped kind loses its namespace",
			in:   "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ns\n  namespace: x\n",
			want: []string{"Namespace ns @1"},
		},
		{
			name: "JSON",
			in:   `{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "n"}}`,
			want: []string{"Pod n/p @1"},
		},
		{
			name: "List",
			in: "apiVersion: v1\nkind: List\nitems:\n" +
				"- apiVersion: v1\n  kind: Namespace\n  metadata: {name: a}\n" +
				"- apiVersion: discovery.k8s.io/v1\n  kind: EndpointSlice\n  addressType: IPv4\n  metadata: {name: s}\n",
			want: []string{"Namespace a @4", "EndpointSlice default/s @7"},
		},
		{
			name: "unknown kind is skipped",
			in:   "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n---\n" + fmt.Sprintf(svc, "a"),
			want: []string{"? Widget w @1", "Service default/a @6"},
		},
		{
			name:    "no apiVersion",
			in:      fmt.Sprintf(svc, "a") + "---\nkind: Service\nmetadata:\n  name: b\n",
			wantErr: []string{"f.yaml:6: document needs apiVersion and kind"},
		},
		{
			name:    "bad apiVersion",
			in:      "apiVersion: a/b/c\nkind: Service\nmetadata:\n  name: b\n",
			wantErr: []string{`f.yaml:1: unexpected GroupVersion string: a/b/c`},
		},
		{
			name:    "no name",
			in:      "apiVersion: v1\nkind: Service\nmetadata:\n  namespace: x\n",
			wantErr: []string{"f.yaml:3: Service has no metadata.name"},
		},
		{
			name: "wrong type, with the line of the value",
			in: "apiVersion: v1\nkind: Service\nmetadata:\n  name: a\nspec:\n  ports:\n  - port: 80\n  - port: http\n" +
				"---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: p\nspec: []\n",
			wantErr: []string{
				"f.yaml:8: Service default/a: json: cannot unmarshal string into Go struct field ServicePort.spec.ports.port of type int32",
				"f.yaml:14: Pod default/p: json: cannot unmarshal array",
			},
		},
		{
			name:    "syntax error in one document, others still checked",
			in:      "apiVersion: v1\nkind: Service\nmetadata:\n  name: [a\n---\nkind: x\n",
			wantErr: []string{"f.yaml:4: did not find expected ',' or ']'", "f.yaml:6: document needs apiVersion and kind"},
		},
		{
			name:    "scanner error",
			in:      fmt.Sprintf(svc, "a") + "---\napiVersion: v1\n\tkind: x\n",
			wantErr: []string{"f.yaml:7: found a tab character"},
		},
		{
			name:    "duplicate key",
			in:      "apiVersion: v1\nkind: Service\nmetadata:\n  name: a\n  name: b\n",
			wantErr: []string{`f.yaml:5: mapping key "name" already defined at line 4`},
		},
		{
			name:    "not a mapping",
			in:      fmt.Sprintf(svc, "a") + "---\n- a\n- b\n",
			wantErr: []string{"f.yaml:6: document is not a mapping"},
		},
		{
			name:    "defined twice in the file",
			in:      fmt.Sprintf(svc, "a") + "---\n" + fmt.Sprintf(svc, "a") + "  namespace: default\n",
			wantErr: []string{"f.yaml:6: Service default/a is already defined at line 1"},
		},
		{
			name:    "value JSON can't hold",
			in:      fmt.Sprintf(svc, "a") + "spec:\n  x: .nan\n",
			wantErr: []string{"f.yaml:1: Service default/a: json: unsupported value: NaN"},
		},
		{
			name:    "unknown anchor",
			in:      fmt.Sprintf(svc, "a") + "---\n" + fmt.Sprintf(svc, "b") + "spec:\n  clusterIP: *x\n",
			wantErr: []string{"f.yaml:6: unknown anchor 'x' referenced"},
		},
		{
			name:    "bad List item",
			in:      "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Namespace\n  metadata: {name: a}\n- 42\n",
			wantErr: []string{"f.yaml:7: List item is not a mapping"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := DecodeFile("f.yaml", []byte(tt.in), NewKinds())
			if len(tt.wantErr) > 0 {
				require.Error(t, err)
				require.Nil(t, got, "a bad file yields no objects")
				lines := strings.Split(err.Error(), "\n")
				require.Len(t, lines, len(tt.wantErr), "error: %s", err)
				for i, want := range tt.wantErr {
					require.Contains(t, lines[i], want)
				}
				return
			}
			require.NoError(t, err)
			var desc []string
			for _, d := range got {
				s := fmt.Sprintf("%s %s @%d", d.GVK.Kind, d.Key, d.Line)
				if d.Object == nil {
					s = "? " + s
				} else {
					require.Equal(t, d.Key, KeyOf(d.Object))
					require.Equal(t, d.GVK, d.Object.GetObjectKind().GroupVersionKind())
				}
				desc = append(desc, s)
			}
			require.Equal(t, tt.want, desc)
		})
	}
}

func TestDecodeFileContent(t *testing.T) {
	in := `apiVersion: v1
kind: Service
metadata:
  name: web
  labels: {app: web}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
`
	got, err := DecodeFile("svc.yaml", []byte(in), NewKinds())
	require.NoError(t, err)
	require.Len(t, got, 1)
	svc := got[0].Object.(*corev1.Service)
	require.Equal(t, "default", svc.Namespace)
	require.Equal(t, map[string]string{"app": "web"}, svc.Labels)
	require.Equal(t, "10.96.0.10", svc.Spec.ClusterIP)
	require.Equal(t, int32(80), svc.Spec.Ports[0].Port)
	require.Equal(t, "8080", svc.Spec.Ports[0].TargetPort.String())
}

// widget is a kind of its own, as later features add (CRDs): json tags are
// all the decoder needs.
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

var widgetKind = Kind[*widget]{
	GVK:        schema.GroupVersionKind{Group: "example.com", Version: "v1", Kind: "Widget"},
	Resource:   "widgets",
	Namespaced: true,
}

func TestDecodeCustomKind(t *testing.T) {
	kinds := NewKinds()
	in := "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\nspec:\n  size: 3\n"

	got, err := DecodeFile("w.yaml", []byte(in), kinds)
	require.NoError(t, err)
	require.Nil(t, got[0].Object, "not registered yet")

	require.NoError(t, RegisterKind(kinds, widgetKind))
	require.NoError(t, RegisterKind(kinds, widgetKind), "registering again is fine")
	got, err = DecodeFile("w.yaml", []byte(in), kinds)
	require.NoError(t, err)
	w := got[0].Object.(*widget)
	require.Equal(t, 3, w.Spec.Size)
	require.Equal(t, Key{"default", "w"}, KeyOf(w))

	// Another Go type for the same GVK is refused.
	other := Kind[*corev1.ConfigMap]{GVK: widgetKind.GVK, Resource: "widgets"}
	require.ErrorContains(t, RegisterKind(kinds, other), "already registered")
	require.Contains(t, kinds.GVKs(), widgetKind.GVK)
}

func FuzzDecode(f *testing.F) {
	for _, seed := range []string{
		"",
		"---\n---\n",
		"apiVersion: v1\nkind: Service\nmetadata:\n  name: a\nspec:\n  ports:\n  - port: 80\n",
		"apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Namespace\n  metadata: {name: a}\n",
		`{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}}`,
		"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\naddressType: IPv4\nmetadata: {name: s}\nendpoints:\n- addresses: [10.0.0.1]\n",
		"a: &x [*x]\n",
		"apiVersion: v1\nkind: Service\nmetadata: &m\n  name: a\nspec: *m\n",
		"<<: {apiVersion: v1, kind: Namespace}\nmetadata: {name: n}\n",
		"apiVersion: v1\nkind: List\nitems: [{kind: List, apiVersion: v1, items: [1]}]\n",
		"\tx",
		"apiVersion: v1\nkind: Service\nmetadata:\n  name: a\nspec: {x: .nan, 1: 2, [a]: b}\n",
	} {
		f.Add([]byte(seed))
	}
	kinds := NewKinds()
	f.Fuzz(func(t *testing.T, data []byte) {
		objs, err := DecodeFile("fuzz.yaml", data, kinds)
		if err != nil {
			require.Nil(t, objs)
			require.True(t, strings.HasPrefix(err.Error(), "fuzz.yaml:"), "error names the file: %s", err)
			return
		}
		for _, o := range objs {
			if o.Object != nil {
				require.NotEmpty(t, o.Key.Name)
				require.Positive(t, o.Line)
			}
		}
	})
}
