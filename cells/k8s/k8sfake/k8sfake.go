// Package k8sfake is the Kubernetes client of tests: client-go's fake
// clientset behind the agent's *k8s.Clientset, so that the real informers
// run against it, with script commands that apply YAML files to it. Only
// tests import it, so the agent binary does not link the fake clientset.
package k8sfake

import (
	"fmt"
	"os"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	k8serrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/apiary-net/apiary/cells/k8s"
)

// Cell replaces k8s.ClientCell in tests: it provides a *k8s.Clientset backed
// by client-go's fake clientset (so that real informers run against it), the
// *fake.Clientset itself, and the script commands k8s/add, k8s/update and
// k8s/delete, which apply YAML files to it. Each hive gets a new, empty
// clientset.
var Cell = module(func() *fake.Clientset {
	// The simple tracker, unlike NewClientset's field-managed one, stores
	// objects of any type, so the commands work for kinds that other cells
	// register too.
	return fake.NewSimpleClientset() //nolint:staticcheck // see above
})

// NewCell is Cell over the given fake clientset. A test that restarts its
// hive hands the same clientset to every new hive, so the objects added
// before the restart are still there, as they would be in a real API server.
func NewCell(f *fake.Clientset) cell.Cell {
	return module(func() *fake.Clientset { return f })
}

func module(newFake func() *fake.Clientset) cell.Cell {
	return cell.Module(
		"k8s-client",
		"Fake Kubernetes client for tests",

		cell.Provide(
			func() (*k8s.Clientset, *fake.Clientset) {
				f := newFake()
				copyWatches(f)
				return &k8s.Clientset{Interface: f}, f
			},
			fakeScriptCommands,
		),
	)
}

type fakeCmdParams struct {
	cell.In

	Fake *fake.Clientset
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
// applies them through the fake clientset's object tracker, which informers
// watch.
func fakeApplyCmd(f *fake.Clientset, kinds *k8s.Kinds, op fakeOp) script.Cmd {
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

func applyFake(f *fake.Clientset, kinds *k8s.Kinds, op fakeOp, file string, o k8s.Decoded) error {
	gvr, ok := kinds.Resource(o.GVK)
	if o.Object == nil || !ok {
		return fmt.Errorf("%s:%d: kind %s is not registered", file, o.Line, o.GVK)
	}
	ns := o.Key.Namespace
	tracker := f.Tracker()
	var err error
	switch op {
	case fakeAdd:
		err = tracker.Create(gvr, o.Object, ns)
	case fakeUpdate:
		err = tracker.Update(gvr, o.Object, ns)
		if k8serrors.IsNotFound(err) {
			err = tracker.Create(gvr, o.Object, ns)
		}
	case fakeDelete:
		err = tracker.Delete(gvr, ns, o.Key.Name)
	}
	if err != nil {
		return fmt.Errorf("%s:%d: %s %s: %w", file, o.Line, o.GVK.Kind, o.Key, err)
	}
	return nil
}
