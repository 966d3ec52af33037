//go:build cluster

package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/internal/testenv"
)

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

// readManifests returns the objects of the YAML files in dir.
func (n *node) readManifests(dir string) []*unstructured.Unstructured {
	t := n.t
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in %s: %v", dir, err)
	}
	var objs []*unstructured.Unstructured
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range docSep.Split(string(data), -1) {
			js, err := yaml.YAMLToJSON([]byte(doc))
			if err != nil {
				t.Fatalf("%s, document %d: %v", file, i, err)
			}
			if string(js) == "null" {
				continue
			}
			u := &unstructured.Unstructured{}
			if err := u.UnmarshalJSON(js); err != nil {
				t.Fatalf("%s, document %d: %v", file, i, err)
			}
			objs = append(objs, u)
		}
	}
	return objs
}

// readManifestString returns the objects of a YAML document.
func (n *node) readManifestString(doc string) []*unstructured.Unstructured {
	js, err := yaml.YAMLToJSON([]byte(doc))
	if err != nil {
		n.t.Fatal(err)
	}
	u := &unstructured.Unstructured{}
	if err := u.UnmarshalJSON(js); err != nil {
		n.t.Fatal(err)
	}
	return []*unstructured.Unstructured{u}
}

// create creates objs with strict field validation, as kubectl apply
// would for a new cluster.
func (n *node) create(objs []*unstructured.Unstructured) {
	t := n.t
	t.Helper()
	dyn, err := dynamic.NewForConfig(n.admin)
	if err != nil {
		t.Fatal(err)
	}
	groups, err := restmapper.GetAPIGroupResources(n.cs.Discovery())
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDiscoveryRESTMapper(groups)
	for _, u := range objs {
		gvk := u.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			t.Fatalf("%s %s: %v", gvk.Kind, u.GetName(), err)
		}
		var r dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if m.Scope.Name() == "namespace" {
			r = dyn.Resource(m.Resource).Namespace(u.GetNamespace())
		}
		if _, err := r.Create(context.Background(), u, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
			t.Fatalf("create %s %s: %v", gvk.Kind, u.GetName(), err)
		}
	}
}

// waitCRDs waits until the CRDs among objs are served.
func (n *node) waitCRDs(objs []*unstructured.Unstructured) {
	dyn, err := dynamic.NewForConfig(n.admin)
	if err != nil {
		n.t.Fatal(err)
	}
	gvr := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	for _, o := range objs {
		testenv.Eventually(n.t, waitTimeout, "CRD "+o.GetName()+" established", func() (bool, string) {
			u, err := dyn.Resource(gvr).Get(context.Background(), o.GetName(), metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
			for _, c := range conds {
				if m, ok := c.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
					return true, ""
				}
			}
			return false, fmt.Sprint(conds)
		})
	}
}

// agentDirs are the host directories the agent's DaemonSet uses here: a
// pin directory and state directory of the test's own, so that nothing the
// cluster's agent pins or checkpoints meets another agent on this machine.
type agentDirs struct {
	pinDir, stateDir string
}

// install applies deploy/ as docs/kubernetes.md says, with the settings a
// user of this node chooses: the API server's address (pods cannot reach
// it through the kubernetes Service before apiary load-balances it) and
// the agent's directories.
func (n *node) install(dirs agentDirs) {
	var crds []*unstructured.Unstructured
	for _, dir := range []string{"deploy/crds", "deploy/cilium-crds", "deploy/network-policy-api-crds"} {
		crds = append(crds, n.readManifests(filepath.Join(repoRoot, dir))...)
	}
	n.create(crds)
	n.waitCRDs(crds)
	objs := n.readManifests(filepath.Join(repoRoot, "deploy"))
	for _, o := range objs {
		switch o.GetKind() {
		case "ConfigMap":
			if err := unstructured.SetNestedField(o.Object, n.server, "data", "k8s-api-server"); err != nil {
				n.t.Fatal(err)
			}
			for k, v := range n.agentConfig {
				if err := unstructured.SetNestedField(o.Object, v, "data", k); err != nil {
					n.t.Fatal(err)
				}
			}
		case "DaemonSet":
			var ds appsv1.DaemonSet
			n.convert(o, &ds)
			spec := &ds.Spec.Template.Spec
			for i, e := range spec.Containers[0].Env {
				switch e.Name {
				case "APIARY_BPF_PIN_DIR":
					spec.Containers[0].Env[i].Value = dirs.pinDir
				}
			}
			for _, want := range n.agentEnv {
				env := &spec.Containers[0].Env
				if i := slices.IndexFunc(*env, func(e corev1.EnvVar) bool { return e.Name == want.Name }); i >= 0 {
					(*env)[i] = want
				} else {
					*env = append(*env, want)
				}
			}
			for i, v := range spec.Volumes {
				switch v.Name {
				case "state":
					spec.Volumes[i].HostPath.Path = dirs.stateDir
				case "cni-conf":
					spec.Volumes[i].HostPath.Path = n.cniConfDir()
				case "cni-bin":
					spec.Volumes[i].HostPath.Path = n.cniBinDir()
				}
			}
			n.unconvert(&ds, o)
		}
	}
	n.create(objs)
}

func (n *node) convert(u *unstructured.Unstructured, obj any) {
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, obj); err != nil {
		n.t.Fatal(err)
	}
}

func (n *node) unconvert(obj any, u *unstructured.Unstructured) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		n.t.Fatal(err)
	}
	u.Object = m
	// Drop what the conversion adds and strict validation refuses.
	unstructured.RemoveNestedField(u.Object, "status")
	unstructured.RemoveNestedField(u.Object, "metadata", "creationTimestamp")
	unstructured.RemoveNestedField(u.Object, "spec", "template", "metadata", "creationTimestamp")
}

// waitAgentReady waits until the agent DaemonSet's pod on the node runs
// the generation asked for and is Ready, and returns its name.
func (n *node) waitAgentReady() string {
	var pod string
	testenv.Eventually(n.t, 2*waitTimeout, "the apiary-agent DaemonSet ready", func() (bool, string) {
		ds, err := n.cs.AppsV1().DaemonSets("kube-system").Get(context.Background(), "apiary-agent", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		st := ds.Status
		if st.ObservedGeneration != ds.Generation || st.UpdatedNumberScheduled != 1 || st.NumberReady != 1 || st.NumberAvailable != 1 {
			return false, fmt.Sprintf("%+v", st)
		}
		pods, err := n.cs.CoreV1().Pods("kube-system").List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=apiary-agent"})
		if err != nil || len(pods.Items) != 1 {
			return false, fmt.Sprintf("agent pods: %v %v", err, pods)
		}
		pod = pods.Items[0].Name
		return true, ""
	})
	return pod
}

// podLog is the log of a pod's container, read from the kubelet's log
// directory.
func (n *node) podLog(ns, pod, container string) string {
	files, _ := filepath.Glob(filepath.Join(n.podLogs, ns+"_"+pod+"_*", container, "*.log"))
	var b strings.Builder
	for _, f := range files {
		data, _ := os.ReadFile(f)
		b.Write(data)
	}
	return b.String()
}
