package k8s

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

func TestBothSources(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "local.yaml", docs(svcYAML("ns", "shared", "dir"), svcYAML("ns", "local", "dir")))
	th := newTestHive(t, hiveOpts{k8s: true, configDir: dir, before: func(th *testHive) {
		for _, o := range []*corev1.Service{svc("ns", "shared", "k8s"), svc("ns", "remote", "k8s")} {
			require.NoError(t, th.fake.Tracker().Create(ServiceKind.GVR(), o, "ns"))
		}
	}})
	tracker := th.fake.Tracker()

	// Merged per key, the directory's copy wins; Sync once both synced. The
	// sources may deliver before or after the subscriber came, so before
	// Sync it may see the API server's copy of "shared" first: what counts is
	// the state at Sync.
	ev := subscribe(t, th.services)
	require.Equal(t, map[Key]string{
		{"ns", "local"}:  "Upsert ns/local v=dir",
		{"ns", "remote"}: "Upsert ns/remote v=k8s",
		{"ns", "shared"}: "Upsert ns/shared v=dir",
	}, untilSync(t, ev))

	// A change of the API server's copy of a key the directory holds is
	// hidden; the marker after it shows nothing came before.
	require.NoError(t, tracker.Update(ServiceKind.GVR(), svc("ns", "shared", "k8s-2"), "ns"))
	require.NoError(t, tracker.Create(ServiceKind.GVR(), svc("ns", "marker", "k8s"), "ns"))
	expect(t, ev, "Upsert ns/marker v=k8s")

	// Without the file, the API server's copy shows and the directory-only
	// object goes.
	require.NoError(t, os.Remove(filepath.Join(dir, "local.yaml")))
	expect(t, ev, "Delete ns/local v=dir", "Upsert ns/shared v=k8s-2")

	// The directory takes a key over from the API server.
	writeFile(t, dir, "remote.yaml", svcYAML("ns", "remote", "dir"))
	expect(t, ev, "Upsert ns/remote v=dir")
	// Deleted in the API server, it lives on in the directory.
	require.NoError(t, tracker.Delete(ServiceKind.GVR(), "ns", "remote"))
	require.NoError(t, tracker.Delete(ServiceKind.GVR(), "ns", "marker"))
	expect(t, ev, "Delete ns/marker")
	require.NoError(t, os.Remove(filepath.Join(dir, "remote.yaml")))
	expect(t, ev, "Delete ns/remote v=dir")
}

// untilSync reads events up to Sync and returns the last event of each key.
func untilSync[T Object](t testing.TB, ch <-chan Event[T]) map[Key]string {
	t.Helper()
	state := map[Key]string{}
	for {
		ev := next(t, ch)
		switch ev.Kind {
		case Sync:
			return state
		case Delete:
			delete(state, ev.Key)
		default:
			state[ev.Key] = describeEvent(ev)
		}
	}
}
