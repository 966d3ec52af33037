package podnet

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// startIn starts sleep in the cgroup dir, in the network namespace ns
// (none: the test's), until the test ends.
func startIn(t *testing.T, dir, ns string) {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	args := []string{"sleep", "infinity"}
	if ns != "" {
		args = append([]string{"ip", "netns", "exec", ns}, args...)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd()), Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if ns == "" {
		return
	}
	// ip enters the namespace, then becomes sleep.
	self, err := nsInode("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "the process in its namespace", func() (bool, string) {
		ino, err := nsInode(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid))
		return err == nil && ino != self, fmt.Sprint(err)
	})
}

func mkdir(t *testing.T, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(dir) })
	return dir
}

func ip(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %v: %v: %s", args, err, out)
	}
}

// TestFind: a pod's host-side veth is found through the namespace of a
// process in the pod's cgroup (or a container's cgroup below it), eth0
// first among several veths; a pod in the host's namespace, one without a
// process and one without a veth say so.
func TestFind(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	root := testenv.Cgroup(t)
	f, err := NewFinder()
	if err != nil {
		t.Fatal(err)
	}
	suffix := fmt.Sprintf("%d", os.Getpid()%100000)

	ns := "apiary-podnet-" + suffix
	ip(t, "netns", "add", ns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	ip(t, "link", "add", "pnx"+suffix, "type", "veth", "peer", "name", "net1", "netns", ns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", "pnx"+suffix).Run() })
	ip(t, "link", "add", "pne"+suffix, "type", "veth", "peer", "name", "eth0", "netns", ns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", "pne"+suffix).Run() })
	pod := mkdir(t, filepath.Join(root, "pod"))
	startIn(t, mkdir(t, filepath.Join(pod, "ctr")), ns)

	emptyNS := "apiary-podnet-empty-" + suffix
	ip(t, "netns", "add", emptyNS)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", emptyNS).Run() })
	noVeth := mkdir(t, filepath.Join(root, "noveth"))
	startIn(t, noVeth, emptyNS)

	host := mkdir(t, filepath.Join(root, "host"))
	startIn(t, host, "")
	idle := mkdir(t, filepath.Join(root, "idle"))

	got, err := f.Find(pod)
	if err != nil {
		t.Fatalf("Find(pod): %v", err)
	}
	if got.Name != "pne"+suffix || got.Ifindex == 0 || got.Netns == 0 {
		t.Errorf("Find(pod) = %+v, want the host side of eth0 (pne%s)", got, suffix)
	}
	for _, tc := range []struct {
		dir  string
		want error
	}{
		{host, ErrHostNetwork},
		{idle, ErrNoProcess},
		{noVeth, ErrNoVeth},
	} {
		if _, err := f.Find(tc.dir); !errors.Is(err, tc.want) {
			t.Errorf("Find(%s): %v, want %v", filepath.Base(tc.dir), err, tc.want)
		}
	}
}
