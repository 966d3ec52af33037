package k8s

import (
	"github.com/cilium/hive/cell"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDirInitialThenSync(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.yaml", docs(svcYAML("default", "a1", "1"), svcYAML("default", "a2", "1")))
	writeFile(t, dir, "b.yml", "---\n"+svcYAML("other", "b", "1"))
	writeFile(t, dir, "c.json", `{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}}`)
	// Files the source must ignore.
	writeFile(t, dir, "a.yaml~", svcYAML("default", "backup", "1"))
	writeFile(t, dir, "notes.txt", svcYAML("default", "txt", "1"))
	require.NoError(t, os.Mkdir(filepath.Join(dir, "sub.yaml"), 0o755))
	writeFile(t, filepath.Join(dir, "sub.yaml"), "x.yaml", svcYAML("default", "nested", "1"))

	th := newTestHive(t, hiveOpts{configDir: dir})
	expect(t, subscribe(t, th.services), "Upsert default/a1 v=1", "Upsert default/a2 v=1", "Upsert other/b v=1", "Sync")
	expect(t, subscribe(t, th.nss), "Upsert other", "Sync")
	expect(t, subscribe(t, th.pods), "Sync")
	th.waitHealth(`level=OK message=4 objects from 3 files`)
}

func TestDirChanges(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.yaml", docs(svcYAML("default", "a1", "1"), svcYAML("default", "a2", "1")))
	th := newTestHive(t, hiveOpts{configDir: dir})
	ev := subscribe(t, th.services)
	expect(t, ev, "Upsert default/a1 v=1", "Upsert default/a2 v=1", "Sync")

	// Add a file.
	writeFile(t, dir, "b.yaml", svcYAML("default", "b", "1"))
	expect(t, ev, "Upsert default/b v=1")

	// Change one of two objects in a file: only that one is news. The next
	// event proving it is the marker that comes after.
	writeFile(t, dir, "a.yaml", docs(svcYAML("default", "a1", "1"), svcYAML("default", "a2", "2")))
	expect(t, ev, "Upsert default/a2 v=2")
	writeFile(t, dir, "marker.yaml", svcYAML("default", "marker", "1"))
	expect(t, ev, "Upsert default/marker")

	// Rewriting a file with the same content, or with the same objects
	// written differently, changes nothing.
	writeFile(t, dir, "a.yaml", docs(svcYAML("default", "a1", "1"), svcYAML("default", "a2", "2")))
	writeFile(t, dir, "b.yaml", "# same object, other layout\n"+`{"apiVersion":"v1","kind":"Service","metadata":{"name":"b","labels":{"v":"1"}},"spec":{"ports":[{"port":80}]}}`)
	os.Remove(filepath.Join(dir, "marker.yaml"))
	expect(t, ev, "Delete default/marker")

	// Remove a file: its objects are deleted.
	require.NoError(t, os.Remove(filepath.Join(dir, "a.yaml")))
	expect(t, ev, "Delete default/a1", "Delete default/a2")

	// Write in place (not atomically): whatever intermediate states a scan
	// sees, the object converges.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "b.yaml"), []byte(svcYAML("default", "b", "3")), 0o644))
	waitFor(t, ev, "Upsert default/b v=3")

	// Moving a file in from elsewhere is a create.
	other := t.TempDir()
	writeFile(t, other, "c.yaml", svcYAML("default", "c", "1"))
	require.NoError(t, os.Rename(filepath.Join(other, "c.yaml"), filepath.Join(dir, "c.yaml")))
	expect(t, ev, "Upsert default/c v=1")

	// Moving it out is a remove.
	require.NoError(t, os.Rename(filepath.Join(dir, "c.yaml"), filepath.Join(other, "c.yaml")))
	expect(t, ev, "Delete default/c")
	th.waitHealth(`level=OK message=1 objects from 1 files`)
}

// waitFor skips events until one matches want.
func waitFor[T Object](t testing.TB, ch <-chan Event[T], want string) {
	t.Helper()
	for {
		got := describeEvent(next(t, ch))
		if got == want {
			return
		}
		t.Logf("skipping %s while waiting for %s", got, want)
	}
}

func TestDirRenameOver(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.yaml", svcYAML("default", "a", "1"))
	th := newTestHive(t, hiveOpts{configDir: dir})
	ev := subscribe(t, th.services)
	expect(t, ev, "Upsert default/a v=1", "Sync")

	// What vim and most editors do: write a temporary file, rename it over.
	tmp := filepath.Join(dir, "a.yaml.tmp~")
	require.NoError(t, os.WriteFile(tmp, []byte(svcYAML("default", "a", "2")), 0o644))
	require.NoError(t, os.Rename(tmp, filepath.Join(dir, "a.yaml")))
	expect(t, ev, "Upsert default/a v=2")

	// A ConfigMap volume: the file is a symlink through ..data, which is
	// swapped.
	for _, v := range []string{"3", "4"} {
		data := filepath.Join(dir, "..v"+v)
		require.NoError(t, os.Mkdir(data, 0o755))
		writeFile(t, data, "cm.yaml", svcYAML("default", "cm", v))
		require.NoError(t, os.Symlink("..v"+v, filepath.Join(dir, "..data_tmp")))
		require.NoError(t, os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")))
		if v == "3" {
			require.NoError(t, os.Symlink("..data/cm.yaml", filepath.Join(dir, "cm.yaml")))
		}
		expect(t, ev, "Upsert default/cm v="+v)
	}
}

func TestDirBadFile(t *testing.T) {
	dir := t.TempDir()
	good := docs(svcYAML("default", "a1", "1"), svcYAML("default", "a2", "1"))
	writeFile(t, dir, "a.yaml", good)
	writeFile(t, dir, "bad.yaml", svcYAML("default", "b", "1"))
	th := newTestHive(t, hiveOpts{configDir: dir})
	ev := subscribe(t, th.services)
	expect(t, ev, "Upsert default/a1", "Upsert default/a2", "Upsert default/b v=1", "Sync")
	th.waitHealth(`level=OK message=3 objects from 2 files`)

	// Break bad.yaml in its second document, and change its first: nothing of
	// the file is applied, its objects stay, the problem is reported with its
	// line.
	broken := docs(svcYAML("default", "b", "2"), "apiVersion: v1\nkind: Service\nmetadata:\n  name: b2\nspec:\n  ports:\n  - port: eighty\n")
	writeFile(t, dir, "bad.yaml", broken)
	th.waitHealth(`level=Degraded message=bad files: bad.yaml error=bad.yaml:18: Service default/b2: json: cannot unmarshal string`)

	// Other files still work meanwhile.
	writeFile(t, dir, "c.yaml", svcYAML("default", "c", "1"))
	expect(t, ev, "Upsert default/c v=1")
	th.waitHealth(`level=Degraded message=bad files: bad.yaml`)

	// A syntax error, also with its line.
	writeFile(t, dir, "bad.yaml", "apiVersion: v1\nkind: Service\nmetadata:\n  name: [b\n")
	th.waitHealth(`error=bad.yaml:4: did not find expected`)
	// Rescans (triggered by other changes) don't log it again.
	writeFile(t, dir, "d.yaml", svcYAML("default", "d", "1"))
	expect(t, ev, "Upsert default/d v=1")
	require.Equal(t, 1, th.records.count("bad.yaml:4: did not find expected"), "logged once")

	// Fixed: applied, health OK again.
	writeFile(t, dir, "bad.yaml", broken[:len(svcYAML("default", "b", "2"))])
	expect(t, ev, "Upsert default/b v=2")
	th.waitHealth(`level=OK message=5 objects from 4 files`)

	// Broken again and then removed: the error clears, the objects go.
	writeFile(t, dir, "bad.yaml", "kind: Service\n")
	th.waitHealth(`error=bad.yaml:1: document needs apiVersion and kind`)
	require.NoError(t, os.Remove(filepath.Join(dir, "bad.yaml")))
	expect(t, ev, "Delete default/b")
	th.waitHealth(`level=OK message=4 objects from 3 files`)
}

func TestDirNewBadFile(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "bad.yaml", svcYAML("default", "b", "1")+"  - port: x\n")
	writeFile(t, dir, "good.yaml", svcYAML("default", "g", "1")+"---\napiVersion: example.com/v1\nkind: Unknown\nmetadata:\n  name: u\n")
	th := newTestHive(t, hiveOpts{configDir: dir})
	// The bad file never contributed anything; the unknown kind is skipped.
	expect(t, subscribe(t, th.services), "Upsert default/g v=1", "Sync")
	th.waitHealth(`level=Degraded message=bad files: bad.yaml error=bad.yaml:11: Service default/b: json: cannot unmarshal string`)
}

func TestDirConflict(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.yaml", svcYAML("default", "x", "a"))
	writeFile(t, dir, "b.yaml", docs(svcYAML("default", "x", "b"), svcYAML("default", "y", "b")))
	th := newTestHive(t, hiveOpts{configDir: dir})
	ev := subscribe(t, th.services)
	// a.yaml sorts first and wins; b.yaml's other object still applies.
	expect(t, ev, "Upsert default/x v=a", "Upsert default/y v=b", "Sync")
	// The file that lost is blamed, naming the file and line that keep it;
	// a.yaml is not reported.
	th.waitHealth(`level=Degraded message=bad files: b.yaml error=b.yaml:1: Service default/x ignored: a.yaml:1 defines it too and is used, as it comes first by name$`)
	require.Equal(t, 1, th.records.count("Ignoring objects that an earlier config file defines dir="+dir+" file=b.yaml problems=1"))
	require.Zero(t, th.records.count("file=a.yaml"))

	// A file that sorts before both takes the object over, whenever it
	// comes: now a.yaml and b.yaml lost it, and each is blamed.
	writeFile(t, dir, "0.yaml", "# first\n"+svcYAML("default", "x", "0"))
	expect(t, ev, "Upsert default/x v=0")
	th.waitHealth(`level=Degraded message=bad files: a.yaml, b.yaml error=a.yaml:1: Service default/x ignored: 0.yaml:2 defines it too and is used, as it comes first by name\n` +
		`b.yaml:1: Service default/x ignored: 0.yaml:2 defines it too and is used, as it comes first by name$`)
	require.NoError(t, os.Remove(filepath.Join(dir, "0.yaml")))
	expect(t, ev, "Upsert default/x v=a")
	th.waitHealth(`level=Degraded message=bad files: b.yaml error=b.yaml:1: Service default/x ignored: a.yaml:1 `)

	// Without a.yaml, b.yaml's copy takes over and all is well.
	require.NoError(t, os.Remove(filepath.Join(dir, "a.yaml")))
	expect(t, ev, "Upsert default/x v=b")
	th.waitHealth(`level=OK message=2 objects from 1 files`)
}

func TestDirMissingThenCreated(t *testing.T) {
	parent := t.TempDir()
	dir := filepath.Join(parent, "conf")
	th := newTestHive(t, hiveOpts{configDir: dir})
	ev := subscribe(t, th.services)
	// A missing directory is an empty, synced source.
	expect(t, ev, "Sync")
	th.waitHealth(`level=Degraded message=config dir .*/conf does not exist`)

	// Created with a file in it in one go, as a rename.
	staging := filepath.Join(parent, "staging")
	require.NoError(t, os.Mkdir(staging, 0o755))
	writeFile(t, staging, "a.yaml", svcYAML("default", "a", "1"))
	require.NoError(t, os.Rename(staging, dir))
	expect(t, ev, "Upsert default/a v=1")
	th.waitHealth(`level=OK message=1 objects from 1 files`)

	// Files added afterwards are seen: the directory itself is watched now.
	writeFile(t, dir, "b.yaml", svcYAML("default", "b", "1"))
	expect(t, ev, "Upsert default/b v=1")

	// Removed: its objects go, and it is waited for again.
	require.NoError(t, os.RemoveAll(dir))
	expect(t, ev, "Delete default/a", "Delete default/b")
	th.waitHealth(`level=Degraded message=config dir .*/conf does not exist`)
	require.NoError(t, os.Mkdir(dir, 0o755))
	writeFile(t, dir, "c.yaml", svcYAML("default", "c", "1"))
	expect(t, ev, "Upsert default/c v=1")
}

func TestDirDisabled(t *testing.T) {
	th := newTestHive(t, hiveOpts{})
	// No source at all: Sync at once, so that pruning can start.
	expect(t, subscribe(t, th.services), "Sync")
	expect(t, subscribe(t, th.nss), "Sync")
}

func TestDirCustomKind(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "w.yaml", "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\nspec:\n  size: 2\n")
	var widgets Resource[*widget]
	newTestHive(t, hiveOpts{configDir: dir, extra: []cell.Cell{
		// What a feature cell does to add a kind of its own.
		cell.Provide(func(p ResourceParams) Resource[*widget] { return NewResource(p, widgetKind) }),
		cell.Invoke(func(r Resource[*widget]) { widgets = r }),
	}})
	ev := subscribe(t, widgets)
	upsert := next(t, ev)
	require.Equal(t, "Upsert default/w", upsert.String())
	require.Equal(t, 2, upsert.Object.Spec.Size)
	expect(t, ev, "Sync")
}
