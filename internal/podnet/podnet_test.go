package podnet

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
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

	got, err := f.Find(pod, nil)
	if err != nil {
		t.Fatalf("Find(pod): %v", err)
	}
	if len(got) != 2 || got[0].Name != "pne"+suffix || got[0].Ifindex == 0 || got[0].Netns == 0 || got[1].Name != "pnx"+suffix {
		t.Errorf("Find(pod) = %+v, want the host side of eth0 (pne%s), then pnx%s", got, suffix, suffix)
	}
	for _, tc := range []struct {
		dir  string
		want error
	}{
		{host, ErrHostNetwork},
		{idle, ErrNoProcess},
		{noVeth, ErrNoVeth},
	} {
		if _, err := f.Find(tc.dir, nil); !errors.Is(err, tc.want) {
			t.Errorf("Find(%s): %v, want %v", filepath.Base(tc.dir), err, tc.want)
		}
	}
}

// veth makes a veth pair host (in the host's namespace) and eth0 in ns,
// with addr routed to host, and returns host's index and eth0's index in
// ns.
func veth(t *testing.T, host, ns, addr string) (hostIdx, peerIdx int) {
	t.Helper()
	ip(t, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", host).Run() })
	ip(t, "link", "set", host, "up")
	if addr != "" {
		ip(t, "route", "add", addr+"/32", "dev", host)
	}
	l, err := net.InterfaceByName(host)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("ip", "-n", ns, "-o", "link", "show", "eth0").Output()
	if err != nil {
		t.Fatal(err)
	}
	idx, _, _ := strings.Cut(string(out), ":")
	peer, err := strconv.Atoi(idx)
	if err != nil {
		t.Fatalf("eth0 in %s: %q", ns, out)
	}
	return l.Index, peer
}

// TestFindNotFooled: what a pod does in namespaces it makes itself does
// not decide its interface. A container of the pod whose cgroup sorts
// first runs in a namespace it made (unshare -n): the pod's veth is still
// found. A namespace of the pod with a veth pair crafted to look, from
// inside, like another pod's (its peer index that pod's host ifindex) is
// no candidate: the host says no veth of it has its peer there. Of two
// veths into the pod's namespace, the one the host routes the pod's
// address through comes first, whatever the names inside.
func TestFindNotFooled(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	root := testenv.Cgroup(t)
	f, err := NewFinder()
	if err != nil {
		t.Fatal(err)
	}
	suffix := fmt.Sprintf("%d", os.Getpid()%100000)
	addNS := func(name string) string {
		ns := "apiary-podnet-" + name + "-" + suffix
		ip(t, "netns", "add", ns)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
		return ns
	}
	const podAddr, otherAddr = "10.239.0.11", "10.239.0.12"

	// Another pod, whose interface the crafted namespace mimics.
	otherNS := addNS("other")
	otherHost, otherPeer := veth(t, "pno"+suffix, otherNS, otherAddr)
	other := mkdir(t, filepath.Join(root, "other"))
	startIn(t, other, otherNS)

	podNS := addNS("pod")
	podHost, _ := veth(t, "pnp"+suffix, podNS, podAddr)
	// A second veth into the pod's namespace, eth1 inside, and no route.
	ip(t, "link", "add", "pnq"+suffix, "type", "veth", "peer", "name", "eth1", "netns", podNS)
	t.Cleanup(func() { exec.Command("ip", "link", "del", "pnq"+suffix).Run() })

	// The pod's containers: "a" sorts before "sandbox".
	pod := mkdir(t, filepath.Join(root, "pod"))
	unshared := addNS("unshared")
	startIn(t, mkdir(t, filepath.Join(pod, "a")), unshared)
	crafted := addNS("crafted")
	ip(t, "-n", crafted, "link", "add", "name", "eth0", "index", strconv.Itoa(otherPeer),
		"type", "veth", "peer", "name", "x", "index", strconv.Itoa(otherHost))
	startIn(t, mkdir(t, filepath.Join(pod, "b")), crafted)
	startIn(t, mkdir(t, filepath.Join(pod, "sandbox")), podNS)

	got, err := f.Find(pod, []netip.Addr{netip.MustParseAddr(podAddr)})
	if err != nil {
		t.Fatalf("Find(pod): %v", err)
	}
	if len(got) != 2 || got[0].Ifindex != podHost || !got[0].CarriesAddr || got[1].Name != "pnq"+suffix || got[1].CarriesAddr {
		t.Errorf("Find(pod) = %+v, want pnp%s (index %d, carrying %s), then pnq%s", got, suffix, podHost, podAddr, suffix)
	}

	// Only the namespaces the pod made: no veth, never the other pod's.
	alone := mkdir(t, filepath.Join(root, "alone"))
	startIn(t, mkdir(t, filepath.Join(alone, "a")), crafted)
	startIn(t, mkdir(t, filepath.Join(alone, "b")), unshared)
	if got, err := f.Find(alone, nil); !errors.Is(err, ErrNoVeth) {
		t.Errorf("Find(alone) = %+v, %v; want %v (the other pod's is %d)", got, err, ErrNoVeth, otherHost)
	}
}
