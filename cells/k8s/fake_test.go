package k8s

import (
	"io"
	"testing"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	"github.com/stretchr/testify/require"
)

func TestFakeCommands(t *testing.T) {
	th := newTestHive(t, hiveOpts{k8s: true})
	cmds, err := th.h.ScriptCommands(th.log)
	require.NoError(t, err)
	for _, name := range []string{"k8s/add", "k8s/update", "k8s/delete"} {
		require.Contains(t, cmds, name)
	}
	engine := &script.Engine{Cmds: cmds}
	work := t.TempDir()
	state, err := script.NewState(t.Context(), work, nil)
	require.NoError(t, err)
	run := func(line string) error { return engine.ExecuteLine(state, line, io.Discard) }

	writeFile(t, work, "svc.yaml", docs(
		svcYAML("default", "a", "1"),
		svcYAML("ns", "b", "1"),
		"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ns\n",
	))
	writeFile(t, work, "svc-v2.yaml", svcYAML("default", "a", "2"))
	writeFile(t, work, "new.yaml", svcYAML("default", "new", "1"))
	writeFile(t, work, "bad.yaml", "apiVersion: v1\nkind: Service\nmetadata:\n  name: [x\n")
	writeFile(t, work, "widget.yaml", "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n")

	services, namespaces := subscribe(t, th.services), subscribe(t, th.nss)
	expect(t, services, "Sync")
	expect(t, namespaces, "Sync")

	require.NoError(t, run("k8s/add svc.yaml"))
	expect(t, services, "Upsert default/a v=1", "Upsert ns/b v=1")
	expect(t, namespaces, "Upsert ns")

	require.NoError(t, run("k8s/update svc-v2.yaml new.yaml"))
	expect(t, services, "Upsert default/a v=2", "Upsert default/new v=1")

	require.ErrorContains(t, run("k8s/add new.yaml"), `new.yaml:1: Service default/new: services "new" already exists`)

	require.NoError(t, run("k8s/delete svc.yaml new.yaml"))
	expect(t, services, "Delete default/a v=2", "Delete ns/b v=1", "Delete default/new v=1")
	expect(t, namespaces, "Delete ns")

	require.ErrorContains(t, run("k8s/add bad.yaml"), "bad.yaml:4: did not find expected ',' or ']'")
	require.ErrorContains(t, run("k8s/add widget.yaml"), "widget.yaml:1: kind example.com/v1, Kind=Widget is not registered")
	require.ErrorContains(t, run("k8s/add missing.yaml"), "read missing.yaml")
	require.Error(t, run("k8s/add"))
}

func TestFakeCommandsCustomKind(t *testing.T) {
	// A kind added by another cell through NewResource decodes in the
	// commands too (the fake clientset's tracker stores any object).
	var widgets Resource[*widget]
	th := newTestHive(t, hiveOpts{k8s: true, extra: []cell.Cell{
		cell.Invoke(func(p ResourceParams) { widgets = NewResource(p, widgetKind) }),
	}})
	require.NotNil(t, widgets)
	cmds, err := th.h.ScriptCommands(th.log)
	require.NoError(t, err)
	work := t.TempDir()
	writeFile(t, work, "widget.yaml", "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\nspec:\n  size: 2\n")
	state, err := script.NewState(t.Context(), work, nil)
	require.NoError(t, err)
	require.NoError(t, (&script.Engine{Cmds: cmds}).ExecuteLine(state, "k8s/add widget.yaml", io.Discard))
	obj, err := th.fake.Tracker().Get(widgetKind.GVR(), "default", "w")
	require.NoError(t, err)
	require.Equal(t, 2, obj.(*widget).Spec.Size)
}
