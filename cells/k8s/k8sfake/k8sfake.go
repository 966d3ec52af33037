// Package k8sfake is the Kubernetes client of tests: client-go's fake
// clientset behind the agent's *k8s.Clientset, so that the real informers
// run against it, with script commands that apply YAML files to it. Only
// tests import it, so the agent binary does not link the fake clientset.
package k8sfake

import (
	"context"
	"fmt"
	"os"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	k8serrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/apiary-net/apiary/cells/k8s"
)

// Cell replaces k8s.ClientCell in tests: it provides a *k8s.Clientset backed
// by client-go's fake clientset and fake dynamic client (so that real
// informers run against them), the *Clients themselves, and the script
// commands k8s/add, k8s/update and k8s/delete, which apply YAML files to
// them. Each hive gets new, empty clients.
var Cell = module(func() *Clients { return New() })

// NewCell is Cell over the given clients. A test that restarts its hive
// hands the same clients to every new hive, so the objects added before the
// restart are still there, as they would be in a real API server.
func NewCell(c *Clients) cell.Cell {
	return module(func() *Clients { return c })
}

// Clients are the fake Kubernetes clients of a test: client-go's fake
// clientset for Kubernetes' own kinds and its fake dynamic client for the
// custom resources apiary defines, as a real API server serves them.
type Clients struct {
	*fake.Clientset
	Dynamic *Dynamic
}

// New returns empty clients whose dynamic client serves the custom kinds of
// kinds (and those of every hive they are given to through NewCell).
func New(kinds ...*k8s.Kinds) *Clients {
	// The simple tracker, unlike NewClientset's field-managed one, stores
	// objects of any type, so the commands work for kinds that other cells
	// register too.
	f := fake.NewSimpleClientset() //nolint:staticcheck // see above
	copyWatches(f)
	return &Clients{Clientset: f, Dynamic: NewDynamic(kinds...)}
}

// Create creates obj, of resource gvr, in namespace ns (empty for a
// cluster-scoped one), in the fake that serves gvr.
func (c *Clients) Create(gvr schema.GroupVersionResource, obj runtime.Object, ns string) error {
	if !isCustom(gvr) {
		return c.Tracker().Create(gvr, obj, ns)
	}
	u, err := c.unstructured(gvr, obj)
	if err != nil {
		return err
	}
	return c.Dynamic.Fake().Tracker().Create(gvr, u, ns)
}

// Update replaces obj, of resource gvr, in namespace ns.
func (c *Clients) Update(gvr schema.GroupVersionResource, obj runtime.Object, ns string) error {
	if !isCustom(gvr) {
		return c.Tracker().Update(gvr, obj, ns)
	}
	u, err := c.unstructured(gvr, obj)
	if err != nil {
		return err
	}
	return c.Dynamic.Fake().Tracker().Update(gvr, u, ns)
}

// Delete deletes the object name of resource gvr in namespace ns.
func (c *Clients) Delete(gvr schema.GroupVersionResource, ns, name string) error {
	if !isCustom(gvr) {
		return c.Tracker().Delete(gvr, ns, name)
	}
	return c.Dynamic.Fake().Tracker().Delete(gvr, ns, name)
}

// K8s is the agent's client over the fakes.
func (c *Clients) K8s() *k8s.Clientset {
	return &k8s.Clientset{Interface: c.Clientset, Dynamic: c.Dynamic}
}

// ListCustom lists the custom resource gvr in namespace ns (empty: all)
// into out, a typed list.
func (c *Clients) ListCustom(gvr schema.GroupVersionResource, ns string, out runtime.Object) error {
	ul, err := c.Dynamic.Resource(gvr).Namespace(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		return err
	}
	return k8s.FromUnstructured(ul.UnstructuredContent(), out)
}

// unstructured is a custom resource's object as the dynamic client
// carries it, with its registered kind (or the one it says it has).
func (c *Clients) unstructured(gvr schema.GroupVersionResource, obj runtime.Object) (runtime.Object, error) {
	if _, ok := obj.(*unstructured.Unstructured); ok {
		return obj, nil
	}
	gvk, ok := c.Dynamic.kindOf(gvr)
	if !ok {
		gvk = obj.GetObjectKind().GroupVersionKind()
	}
	if gvk.Kind == "" {
		return nil, fmt.Errorf("%s: kind not registered", gvr)
	}
	return k8s.ToUnstructured(obj, gvk)
}

type clientsParams struct {
	cell.In

	// Kinds comes from SourcesCell: the dynamic client serves its custom
	// kinds.
	Kinds *k8s.Kinds `optional:"true"`
}

func module(newClients func() *Clients) cell.Cell {
	return cell.Module(
		"k8s-client",
		"Fake Kubernetes client for tests",

		cell.Provide(
			func(p clientsParams) (*k8s.Clientset, *Clients) {
				c := newClients()
				c.Dynamic.addKinds(p.Kinds)
				return c.K8s(), c
			},
			fakeScriptCommands,
		),
	)
}

type fakeCmdParams struct {
	cell.In

	Fake *Clients
	// Kinds comes from SourcesCell; without it only the core kinds decode.
	Kinds *k8s.Kinds `optional:"true"`
}

func fakeScriptCommands(p fakeCmdParams) hive.ScriptCmdsOut {
	kinds := p.Kinds
	if kinds == nil {
		kinds = k8s.NewKinds()
	}
	return hive.NewScriptCmds(map[string]script.Cmd{
		"k8s/add":    fakeApplyCmd(p.Fake, kinds, fakeAdd),
		"k8s/update": fakeApplyCmd(p.Fake, kinds, fakeUpdate),
		"k8s/delete": fakeApplyCmd(p.Fake, kinds, fakeDelete),
	})
}

type fakeOp int

const (
	fakeAdd fakeOp = iota
	fakeUpdate
	fakeDelete
)

var fakeOpSummaries = map[fakeOp]string{
	fakeAdd:    "Create the Kubernetes objects of YAML files in the fake clientset",
	fakeUpdate: "Update (or create) the Kubernetes objects of YAML files in the fake clientset",
	fakeDelete: "Delete the Kubernetes objects of YAML files from the fake clientset",
}

// fakeApplyCmd decodes the files with the same decoder as --config-dir and
// applies them through the fakes' object trackers, which informers watch.
func fakeApplyCmd(f *Clients, kinds *k8s.Kinds, op fakeOp) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: fakeOpSummaries[op],
			Args:    "file...",
			Detail: []string{
				"Files hold YAML documents (several per file, separated by ---) of registered kinds.",
				"Paths are relative to the script's work directory.",
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) == 0 {
				return nil, script.ErrUsage
			}
			for _, file := range args {
				data, err := os.ReadFile(s.Path(file))
				if err != nil {
					return nil, fmt.Errorf("read %s: %w", file, err)
				}
				objs, err := k8s.DecodeFile(file, data, kinds)
				if err != nil {
					return nil, err
				}
				for _, o := range objs {
					if err := applyFake(f, kinds, op, file, o); err != nil {
						return nil, err
					}
				}
			}
			return nil, nil
		},
	)
}

func applyFake(f *Clients, kinds *k8s.Kinds, op fakeOp, file string, o k8s.Decoded) error {
	gvr, ok := kinds.Resource(o.GVK)
	if o.Object == nil || !ok {
		return fmt.Errorf("%s:%d: kind %s is not registered", file, o.Line, o.GVK)
	}
	ns := o.Key.Namespace
	var err error
	switch op {
	case fakeAdd:
		err = f.Create(gvr, o.Object, ns)
	case fakeUpdate:
		err = f.Update(gvr, o.Object, ns)
		if k8serrors.IsNotFound(err) {
			err = f.Create(gvr, o.Object, ns)
		}
	case fakeDelete:
		err = f.Delete(gvr, ns, o.Key.Name)
	}
	if err != nil {
		return fmt.Errorf("%s:%d: %s %s: %w", file, o.Line, o.GVK.Kind, o.Key, err)
	}
	return nil
}
