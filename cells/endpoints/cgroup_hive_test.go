package endpoints_test

import (
	"context"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// TestCgroupRows runs the endpoints cell on a real cgroup as --cgroup-root,
// with kubelet-like cgroups made below it, and pods added through the fake
// clientset: a pod's endpoint gets the pod's UID, named ports, cgroup and
// cgroup ID (its inode number), for both kubelet drivers, also when the
// cgroup comes after the pod or is made anew; a pod without a cgroup
// keeps an empty one.
func TestCgroupRows(t *testing.T) {
	t.Parallel()
	root := testenv.Cgroup(t)
	t.Cleanup(func() { removeCgroups(t, root) })
	a := startAgent(t, "--cgroup-root="+root)

	const (
		webUID   = "11111111-2222-4333-8444-555555555555"
		lateUID  = "66666666-7777-4888-9999-aaaaaaaaaaaa"
		otherUID = "bbbbbbbb-cccc-4ddd-8eee-ffffffffffff"
	)
	webCgroup := "kubepods/burstable/pod" + webUID
	lateCgroup := "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + strings.ReplaceAll(lateUID, "-", "_") + ".slice"
	// The container cgroups below the pod's are not the endpoint's.
	mkdirs(t, root, webCgroup+"/cri-containerd-0123.scope")

	web := pod("web", webUID, "10.0.1.5",
		corev1.ContainerPort{Name: "http", ContainerPort: 8080},
		corev1.ContainerPort{Name: "dns", ContainerPort: 53, Protocol: corev1.ProtocolUDP},
		corev1.ContainerPort{ContainerPort: 9999})
	late := pod("late", lateUID, "10.0.1.6")
	other := pod("other", otherUID, "10.0.1.7")
	for _, p := range []*corev1.Pod{web, late, other} {
		a.addPod(t, p)
	}

	want := map[string]string{
		"default/web":   rowOf(webUID, "dns:53/UDP,http:8080/TCP", webCgroup, inode(t, filepath.Join(root, webCgroup))),
		"default/late":  rowOf(lateUID, "", "", 0),
		"default/other": rowOf(otherUID, "", "", 0),
	}
	a.waitRows(t, want, 10*time.Second)

	// The late pod's cgroup appears (systemd layout): found within about
	// a second.
	mkdirs(t, root, lateCgroup)
	want["default/late"] = rowOf(lateUID, "", lateCgroup, inode(t, filepath.Join(root, lateCgroup)))
	a.waitRows(t, want, 5*time.Second)
	a.waitHealth(t, "3 pods, 3 on this node, 2 in a cgroup")

	// The web pod's cgroup is made anew, with a new ID: noticed at the next
	// recheck of the known cgroups, within about ten seconds.
	old := inode(t, filepath.Join(root, webCgroup))
	removeCgroups(t, filepath.Join(root, webCgroup))
	if err := os.Remove(filepath.Join(root, webCgroup)); err != nil {
		t.Fatal(err)
	}
	mkdirs(t, root, webCgroup)
	if id := inode(t, filepath.Join(root, webCgroup)); id == old {
		t.Fatalf("the re-made cgroup has the same ID %d", id)
	}
	want["default/web"] = rowOf(webUID, "dns:53/UDP,http:8080/TCP", webCgroup, inode(t, filepath.Join(root, webCgroup)))
	a.waitRows(t, want, 20*time.Second)
}

// TestCgroupRootUnusable: with a --cgroup-root that is not a cgroup v2
// directory the endpoints are written all the same, without cgroups, and
// the health says why without being degraded.
func TestCgroupRootUnusable(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a := startAgent(t, "--cgroup-root="+dir)
	const uid = "11111111-2222-4333-8444-555555555555"
	mkdirs(t, dir, "kubepods/pod"+uid) // a look-alike, not a cgroup
	p := pod("web", uid, "10.0.1.5", corev1.ContainerPort{Name: "http", ContainerPort: 80})
	a.addPod(t, p)
	a.waitRows(t, map[string]string{"default/web": rowOf(uid, "http:80/TCP", "", 0)}, 10*time.Second)
	a.waitHealth(t, "1 pods, 1 on this node; pods' cgroups unknown: --cgroup-root "+dir+" is not a cgroup v2 directory")
	for s := range a.health.All(a.db.ReadTxn()) {
		if strings.HasPrefix(s.Scope, "endpoints") && !s.Healthy() {
			t.Errorf("%s is not healthy: %s %s", s.Scope, s.Message, s.Error)
		}
	}
}

// agent is a hive of the endpoints cell and what it needs, on a fake
// clientset.
type agent struct {
	db     *statedb.DB
	eps    statedb.Table[*tables.Endpoint]
	health statedb.Table[*tables.HealthStatus]
	fake   *k8sfake.Clients
}

// startAgent starts an agent with flags, until the test ends.
func startAgent(t *testing.T, flags ...string) *agent {
	t.Helper()
	a := &agent{fake: k8sfake.New()} //nolint:staticcheck // stores any kind, as apiarytest's
	h := hive.NewWithOptions(core.HiveOptions(),
		infra.Cell, k8sfake.NewCell(a.fake),
		identity.Cell, ipcache.Cell, selectors.Cell, endpoints.Cell,
		cell.Invoke(func(db *statedb.DB, eps statedb.Table[*tables.Endpoint], health statedb.Table[*tables.HealthStatus]) {
			a.db, a.eps, a.health = db, eps, health
		}),
	)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	args := append([]string{
		"--api-addr=127.0.0.1:0",
		"--bpf-pin-dir=" + testenv.BPFPinDir(t),
		"--state-dir=" + t.TempDir(),
		"--node-name=test-node",
		"--node-ips=192.168.1.10",
	}, flags...)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelInfo))
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := h.Stop(log, context.Background()); err != nil {
			t.Error(err)
		}
	})
	return a
}

func (a *agent) addPod(t *testing.T, p *corev1.Pod) {
	t.Helper()
	if _, err := a.fake.CoreV1().Pods(p.Namespace).Create(t.Context(), p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func pod(name, uid, ip string, ports ...corev1.ContainerPort) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID(uid), Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			NodeName:   "test-node",
			Containers: []corev1.Container{{Name: name, Image: name, Ports: ports}},
		},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip},
	}
}

// rowOf is how rows shows an endpoint's UID, named ports and cgroup.
func rowOf(uid, ports, cgroup string, id uint64) string {
	return fmt.Sprintf("uid=%s ports=%s cgroup=%s id=%d", uid, ports, cgroup, id)
}

// rows returns the agent's endpoints as rowOf shows them, by name.
func (a *agent) rows() map[string]string {
	out := map[string]string{}
	for e := range a.eps.All(a.db.ReadTxn()) {
		var ports []string
		for _, p := range e.NamedPorts {
			ports = append(ports, fmt.Sprintf("%s:%d/%s", p.Name, p.Port, p.Protocol))
		}
		out[e.Name] = rowOf(e.UID, strings.Join(ports, ","), e.Cgroup, e.CgroupID)
	}
	return out
}

// waitRows waits until the agent's endpoints are want.
func (a *agent) waitRows(t *testing.T, want map[string]string, timeout time.Duration) {
	t.Helper()
	testenv.Eventually(t, timeout, "the endpoints", func() (bool, string) {
		got := a.rows()
		var b strings.Builder
		for _, name := range slices.Sorted(maps.Keys(got)) {
			fmt.Fprintf(&b, "%s %s (want %s)\n", name, got[name], want[name])
		}
		return maps.Equal(got, want), b.String()
	})
}

// waitHealth waits until the endpoints' health message is want.
func (a *agent) waitHealth(t *testing.T, want string) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, "the endpoints' health", func() (bool, string) {
		var b strings.Builder
		for s := range a.health.All(a.db.ReadTxn()) {
			if strings.HasPrefix(s.Scope, "endpoints") {
				if s.Message == want {
					return true, ""
				}
				fmt.Fprintf(&b, "%s: %s\n", s.Scope, s.Message)
			}
		}
		return false, b.String()
	})
}

// mkdirs makes the directories rel (cgroups, on a cgroup v2 root) and
// their parents below root.
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
