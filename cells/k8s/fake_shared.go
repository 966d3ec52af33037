package k8s

import (
	"github.com/cilium/hive/cell"
	"k8s.io/client-go/kubernetes/fake"
)

// NewFakeClientCell is FakeClientCell over the given fake clientset. A test
// that restarts its hive hands the same clientset to every new hive, so the
// objects added before the restart are still there, as they would be in a
// real API server.
func NewFakeClientCell(f *fake.Clientset) cell.Cell {
	return cell.Module(
		"k8s-client",
		"Fake Kubernetes client for tests",

		cell.Provide(
			func() (*Clientset, *fake.Clientset) { return &Clientset{Interface: f}, f },
			fakeScriptCommands,
		),
	)
}
