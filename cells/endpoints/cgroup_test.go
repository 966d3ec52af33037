package endpoints

import (
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

const testUID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"

func TestCgroupCandidates(t *testing.T) {
	got := cgroupCandidates(testUID)
	for _, tc := range []struct {
		driver, qos, want string
	}{
		{"cgroupfs", "guaranteed", "kubepods/pod1b4e28ba-2fa1-11d2-883f-0016d3cca427"},
		{"cgroupfs", "burstable", "kubepods/burstable/pod1b4e28ba-2fa1-11d2-883f-0016d3cca427"},
		{"cgroupfs", "besteffort", "kubepods/besteffort/pod1b4e28ba-2fa1-11d2-883f-0016d3cca427"},
		{"systemd", "guaranteed", "kubepods.slice/kubepods-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice"},
		{"systemd", "burstable", "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice"},
		{"systemd", "besteffort", "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice"},
	} {
		t.Run(tc.driver+"/"+tc.qos, func(t *testing.T) {
			if !slices.Contains(got, tc.want) {
				t.Errorf("cgroupCandidates(%s) lacks %s:\n%s", testUID, tc.want, strings.Join(got, "\n"))
			}
		})
	}
	if len(got) != 6 {
		t.Errorf("%d candidates, want 6:\n%s", len(got), strings.Join(got, "\n"))
	}
}

func TestValidUID(t *testing.T) {
	for _, tc := range []struct {
		uid string
		ok  bool
	}{
		{testUID, true},
		{"web-1", true},
		{"", false},
		{"../../system.slice", false},
		{"a/b", false},
		{"a.b", false},
		{"a_b", false}, // would be read back as a dash in a systemd name
		{strings.Repeat("a", 65), false},
	} {
		if got := validUID(tc.uid); got != tc.ok {
			t.Errorf("validUID(%q) = %v, want %v", tc.uid, got, tc.ok)
		}
	}
}

func TestNamedPorts(t *testing.T) {
	port := func(name string, n int32, proto corev1.Protocol) corev1.ContainerPort {
		return corev1.ContainerPort{Name: name, ContainerPort: n, Protocol: proto}
	}
	for _, tc := range []struct {
		name       string
		containers [][]corev1.ContainerPort
		want       []tables.NamedPort
	}{
		{name: "none"},
		{name: "unnamed ports left out", containers: [][]corev1.ContainerPort{{port("", 80, "TCP")}}},
		{
			name:       "protocol defaults to TCP",
			containers: [][]corev1.ContainerPort{{port("http", 8080, "")}},
			want:       []tables.NamedPort{{Name: "http", Port: 8080, Protocol: "TCP"}},
		},
		{
			name: "every container, sorted, no duplicates",
			containers: [][]corev1.ContainerPort{
				{port("metrics", 9090, "TCP"), port("dns", 53, "UDP"), port("dns-tcp", 53, "TCP")},
				{port("admin", 9901, "TCP"), port("metrics", 9090, "")},
			},
			want: []tables.NamedPort{
				{Name: "admin", Port: 9901, Protocol: "TCP"},
				{Name: "dns", Port: 53, Protocol: "UDP"},
				{Name: "dns-tcp", Port: 53, Protocol: "TCP"},
				{Name: "metrics", Port: 9090, Protocol: "TCP"},
			},
		},
		{
			name:       "lower-case protocol from a file",
			containers: [][]corev1.ContainerPort{{port("sctp", 9, "sctp")}},
			want:       []tables.NamedPort{{Name: "sctp", Port: 9, Protocol: "SCTP"}},
		},
		{
			name:       "out of range ports left out",
			containers: [][]corev1.ContainerPort{{port("zero", 0, "TCP"), port("big", 70000, "TCP")}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := &corev1.Pod{}
			for i, ports := range tc.containers {
				pod.Spec.Containers = append(pod.Spec.Containers, corev1.Container{Name: string(rune('a' + i)), Ports: ports})
			}
			if got := namedPorts(pod); !slices.Equal(got, tc.want) {
				t.Errorf("namedPorts = %v, want %v", got, tc.want)
			}
		})
	}
}

// mkdirs creates the directories rel under root.
func mkdirs(t *testing.T, root string, rel ...string) {
	t.Helper()
	for _, r := range rel {
		if err := os.MkdirAll(filepath.Join(root, r), 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestFindCgroup(t *testing.T) {
	cands := cgroupCandidates(testUID)
	for _, tc := range []struct {
		name  string
		dirs  []string
		uid   string
		want  string // relative path, "" for none
		files []string
	}{
		{name: "nothing", uid: testUID},
		{name: "kubelet dirs without the pod", dirs: []string{"kubepods/burstable", "kubepods.slice/kubepods-besteffort.slice"}, uid: testUID},
		{name: "cgroupfs guaranteed", dirs: cands[0:1], uid: testUID, want: cands[0]},
		{name: "cgroupfs burstable", dirs: cands[1:2], uid: testUID, want: cands[1]},
		{name: "cgroupfs besteffort", dirs: cands[2:3], uid: testUID, want: cands[2]},
		{name: "systemd guaranteed", dirs: cands[3:4], uid: testUID, want: cands[3]},
		{name: "systemd burstable", dirs: cands[4:5], uid: testUID, want: cands[4]},
		{name: "systemd besteffort", dirs: cands[5:6], uid: testUID, want: cands[5]},
		{name: "container cgroups below", dirs: []string{cands[1] + "/cri-containerd-abc.scope"}, uid: testUID, want: cands[1]},
		{name: "another pod's", dirs: cgroupCandidates("0e7a2b5c-0000-4000-8000-000000000000"), uid: testUID},
		{name: "no UID", dirs: []string{"kubepods/pod"}, uid: ""},
		{name: "UID leaving the root", dirs: []string{"kubepods/pod/system.slice"}, uid: "/../x"},
		{name: "a file is no cgroup", files: []string{"kubepods/burstable/pod" + testUID}, uid: testUID},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			mkdirs(t, root, tc.dirs...)
			for _, f := range tc.files {
				mkdirs(t, root, filepath.Dir(f))
				if err := os.WriteFile(filepath.Join(root, f), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			got, _ := findCgroup(root, tc.uid, cgroupRef{})
			var want cgroupRef
			if tc.want != "" {
				want = cgroupRef{path: tc.want, id: inode(t, filepath.Join(root, tc.want))}
			}
			if got != want {
				t.Errorf("findCgroup = %+v, want %+v", got, want)
			}
		})
	}
}

// TestFindCgroupKnown: a known cgroup still there is kept; one made anew
// (another inode) or moved is found again; one gone is no more.
func TestFindCgroupKnown(t *testing.T) {
	root := t.TempDir()
	cands := cgroupCandidates(testUID)
	mkdirs(t, root, cands[1])
	first, _ := findCgroup(root, testUID, cgroupRef{})
	if first.path != cands[1] || first.id == 0 {
		t.Fatalf("findCgroup = %+v", first)
	}
	if got, _ := findCgroup(root, testUID, first); got != first {
		t.Fatalf("unchanged: findCgroup = %+v, want %+v", got, first)
	}
	// Moved aside rather than removed, so that the new one cannot reuse
	// the inode.
	if err := os.Rename(filepath.Join(root, cands[1]), filepath.Join(root, "old")); err != nil {
		t.Fatal(err)
	}
	mkdirs(t, root, cands[1])
	again, _ := findCgroup(root, testUID, first)
	if again.path != cands[1] || again.id == first.id || again.id != inode(t, filepath.Join(root, cands[1])) {
		t.Fatalf("made anew: findCgroup = %+v (was %+v)", again, first)
	}
	if err := os.Remove(filepath.Join(root, cands[1])); err != nil {
		t.Fatal(err)
	}
	mkdirs(t, root, cands[4])
	if got, _ := findCgroup(root, testUID, again); got.path != cands[4] {
		t.Fatalf("moved to the systemd layout: findCgroup = %+v", got)
	}
	if err := os.Remove(filepath.Join(root, cands[4])); err != nil {
		t.Fatal(err)
	}
	if got, _ := findCgroup(root, testUID, again); got != (cgroupRef{}) {
		t.Fatalf("gone: findCgroup = %+v", got)
	}
}

// testClock is a clock the test moves.
type testClock struct{ t time.Time }

func (c *testClock) now() time.Time                    { return c.t }
func (c *testClock) set(t0 time.Time, d time.Duration) { c.t = t0.Add(d) }

func testPod(name, node, uid string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID(uid)},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c"}}},
	}
}

// TestRecheck follows the cgroup rechecks on a clock of the test's: pods
// looked up when they come, unresolved ones every second, resolved ones
// every ten, and a pod marked dirty only when its cgroup changed.
func TestRecheck(t *testing.T) {
	root := t.TempDir()
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := &testClock{t: t0}
	c := newController(controllerParams{Log: hivetest.Logger(t), Node: node.Config{NodeName: "here"}})
	c.now = clock.now
	c.cg.dir = root // a usable root; TestCgroupRows has a real one

	const uidA, uidB = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"
	candsA, candsB := cgroupCandidates(uidA), cgroupCandidates(uidB)
	mkdirs(t, root, candsA[1])
	upsert := func(p *corev1.Pod) {
		c.podChanged(k8s.Event[*corev1.Pod]{Kind: k8s.Upsert, Key: k8s.KeyOf(p), Object: p})
	}
	a, b := testPod("a", "here", uidA), testPod("b", "here", uidB)
	upsert(a)
	upsert(b)
	upsert(testPod("remote", "elsewhere", "dddddddd-0000-4000-8000-000000000004"))

	keyA, keyB := k8s.KeyOf(a), k8s.KeyOf(b)
	check := func(step string, wantDirty []k8s.Key, wantCgroups map[k8s.Key]string, wantNext time.Duration, wantTimer bool) {
		t.Helper()
		dirty := slices.SortedFunc(maps.Keys(c.dirty), func(x, y k8s.Key) int { return strings.Compare(x.String(), y.String()) })
		if !slices.Equal(dirty, wantDirty) {
			t.Errorf("%s: dirty %v, want %v", step, dirty, wantDirty)
		}
		clear(c.dirty)
		got := map[k8s.Key]string{}
		for key := range maps.Keys(c.cg.resolved) {
			got[key] = c.pods[key].cgroup.path
		}
		for key := range maps.Keys(c.cg.unresolved) {
			got[key] = ""
		}
		if !maps.Equal(got, wantCgroups) {
			t.Errorf("%s: cgroups %v, want %v", step, got, wantCgroups)
		}
		next, ok := c.nextRecheck()
		if ok != wantTimer || ok && next.Sub(t0) != wantNext {
			t.Errorf("%s: next recheck at t0+%s (%v), want t0+%s (%v)", step, next.Sub(t0), ok, wantNext, wantTimer)
		}
	}
	check("pods added", keyList{keyA, keyB}.sorted(), map[k8s.Key]string{keyA: candsA[1], keyB: ""}, time.Second, true)

	// B's cgroup appears; it is found at the next second, not before.
	mkdirs(t, root, candsB[5])
	clock.set(t0, 500*time.Millisecond)
	c.recheckCgroups(clock.now())
	check("before the second", nil, map[k8s.Key]string{keyA: candsA[1], keyB: ""}, time.Second, true)
	clock.set(t0, time.Second)
	c.recheckCgroups(clock.now())
	check("a second later", []k8s.Key{keyB}, map[k8s.Key]string{keyA: candsA[1], keyB: candsB[5]}, 10*time.Second, true)

	// A's cgroup is made anew: noticed at the ten seconds' recheck, which
	// leaves B, unchanged, alone.
	if err := os.Rename(filepath.Join(root, candsA[1]), filepath.Join(root, "old")); err != nil {
		t.Fatal(err)
	}
	mkdirs(t, root, candsA[1])
	clock.set(t0, 5*time.Second)
	c.recheckCgroups(clock.now())
	check("before ten seconds", nil, map[k8s.Key]string{keyA: candsA[1], keyB: candsB[5]}, 10*time.Second, true)
	oldID := c.pods[keyA].cgroup.id
	clock.set(t0, 10*time.Second)
	c.recheckCgroups(clock.now())
	check("ten seconds", []k8s.Key{keyA}, map[k8s.Key]string{keyA: candsA[1], keyB: candsB[5]}, 20*time.Second, true)
	if id := c.pods[keyA].cgroup.id; id == oldID || id != inode(t, filepath.Join(root, candsA[1])) {
		t.Errorf("A's cgroup id %d, was %d, want the new inode", id, oldID)
	}

	// An update of a resolved pod keeps its cgroup without a look.
	upsert(a)
	check("A updated", []k8s.Key{keyA}, map[k8s.Key]string{keyA: candsA[1], keyB: candsB[5]}, 20*time.Second, true)

	// A's cgroup goes: A waits for it again, every second.
	if err := os.Remove(filepath.Join(root, candsA[1])); err != nil {
		t.Fatal(err)
	}
	clock.set(t0, 20*time.Second)
	c.recheckCgroups(clock.now())
	check("A's cgroup gone", []k8s.Key{keyA}, map[k8s.Key]string{keyA: "", keyB: candsB[5]}, 21*time.Second, true)
	if s := c.pods[keyA]; s.cgroup != (cgroupRef{}) {
		t.Errorf("A's cgroup %+v after it went", s.cgroup)
	}

	// Without local pods the timer is off.
	for _, p := range []*corev1.Pod{a, b} {
		c.podChanged(k8s.Event[*corev1.Pod]{Kind: k8s.Delete, Key: k8s.KeyOf(p), Object: p})
	}
	check("pods deleted", []k8s.Key{keyA, keyB}, map[k8s.Key]string{}, 0, false)
}

// keyList sorts keys as check does.
type keyList []k8s.Key

func (l keyList) sorted() []k8s.Key {
	return slices.SortedFunc(slices.Values(l), func(x, y k8s.Key) int { return strings.Compare(x.String(), y.String()) })
}

// TestRecheckRoot: while the root is unusable the pods wait without a
// look; the root is looked at again every second while pods wait and every
// ten seconds otherwise, and once it is usable the pods are found. The
// health message says which.
func TestRecheckRoot(t *testing.T) {
	cg := testenv.Cgroup(t)
	t.Cleanup(func() { removeCgroups(t, cg) })
	dir := filepath.Join(cg, "root") // not there yet
	root, err := cgroups.NewRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := &testClock{t: t0}
	c := newController(controllerParams{Log: hivetest.Logger(t), Node: node.Config{NodeName: "here"}, Root: root})
	c.now = clock.now

	wantNext := func(step string, want time.Duration) {
		t.Helper()
		if next, ok := c.nextRecheck(); !ok || next.Sub(t0) != want {
			t.Errorf("%s: next recheck at t0+%s (%v), want t0+%s", step, next.Sub(t0), ok, want)
		}
	}
	wantHealth := func(step, want string) {
		t.Helper()
		if got := c.cgroupHealth(); !strings.Contains(got, want) {
			t.Errorf("%s: health %q, want it to contain %q", step, got, want)
		}
	}
	if c.ensureRoot(clock.now()) {
		t.Fatal("a missing root is usable")
	}
	wantHealth("start", "pods' cgroups unknown: --cgroup-root "+dir)
	wantNext("start, no pods", 10*time.Second)

	clock.set(t0, 10*time.Second)
	c.recheckCgroups(clock.now())
	if !c.cg.rootChecked.Equal(clock.now()) {
		t.Errorf("the root was last looked at t0+%s, want t0+10s", c.cg.rootChecked.Sub(t0))
	}
	wantNext("no pods", 20*time.Second)

	const uid = "aaaaaaaa-0000-4000-8000-000000000001"
	clock.set(t0, 10200*time.Millisecond)
	pod := testPod("a", "here", uid)
	c.podChanged(k8s.Event[*corev1.Pod]{Kind: k8s.Upsert, Key: k8s.KeyOf(pod), Object: pod})
	if len(c.cg.unresolved) != 1 {
		t.Fatalf("unresolved %v, want the pod", c.cg.unresolved)
	}
	wantNext("a pod waits", 11200*time.Millisecond)

	// The root becomes usable (as when policy enforcement mounts it), with
	// the pod's cgroup in it.
	mkdirs(t, dir, cgroupCandidates(uid)[0])
	clock.set(t0, 11200*time.Millisecond)
	c.recheckCgroups(clock.now())
	if c.cg.dir != dir || len(c.cg.resolved) != 1 {
		t.Fatalf("root %q, resolved %v; want %s and the pod", c.cg.dir, c.cg.resolved, dir)
	}
	if s := c.pods[k8s.KeyOf(pod)]; s.cgroup.path != cgroupCandidates(uid)[0] {
		t.Errorf("the pod's cgroup is %+v", s.cgroup)
	}
	wantHealth("usable", ", 1 in a cgroup")
	wantNext("resolved", 21200*time.Millisecond)
}

// removeCgroups removes the cgroups below dir, deepest first (a cgroup
// goes with rmdir only, once it has no children).
func removeCgroups(t *testing.T, dir string) {
	t.Helper()
	var dirs []string
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() && path != dir {
			dirs = append(dirs, path)
		}
		return nil
	})
	for _, d := range slices.Backward(dirs) {
		if err := os.Remove(d); err != nil {
			t.Errorf("remove cgroup %s: %v", d, err)
		}
	}
}

// BenchmarkRecheck measures one recheck pass over 100 local pods: what the
// controller spends once a second while their cgroups are missing
// (unresolved, six stats each), and once every ten seconds when they are
// all known (resolved, one stat each).
func BenchmarkRecheck(b *testing.B) {
	for _, resolved := range []bool{false, true} {
		name := "unresolved"
		if resolved {
			name = "resolved"
		}
		b.Run(name, func(b *testing.B) {
			root := b.TempDir()
			c := newController(controllerParams{Log: hivetest.Logger(b), Node: node.Config{NodeName: "here"}})
			c.cg.dir = root
			t0 := time.Now()
			c.now = func() time.Time { return t0 }
			for i := range 100 {
				uid := fmt.Sprintf("%08x-0000-4000-8000-000000000000", i)
				if resolved {
					if err := os.MkdirAll(filepath.Join(root, cgroupCandidates(uid)[1]), 0o755); err != nil {
						b.Fatal(err)
					}
				}
				p := testPod(fmt.Sprintf("pod-%d", i), "here", uid)
				c.podChanged(k8s.Event[*corev1.Pod]{Kind: k8s.Upsert, Key: k8s.KeyOf(p), Object: p})
			}
			if got := len(c.cg.resolved); resolved && got != 100 || !resolved && got != 0 {
				b.Fatalf("%d resolved", got)
			}
			now := t0
			for b.Loop() {
				now = now.Add(recheckResolved)
				c.recheckCgroups(now)
			}
			if len(c.dirty) != 100 { // from the adds only: a recheck dirties nothing unchanged
				b.Fatalf("%d dirty", len(c.dirty))
			}
		})
	}
}
