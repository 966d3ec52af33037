//go:build cluster

package cluster

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/apiary-net/apiary/internal/testenv"
)

// The multi-node cluster's networks: the node network (a bridge of the
// host's, each node's eth0 on it) and one pod CIDR per node, routed
// between the nodes through their node addresses, as a host-gateway CNI
// (kindnet) routes them.
const (
	nodeNetBridge = "apmn0"
	nodeNetGW     = "10.252.0.1"
	nodeNetPrefix = "10.252.0."
)

// The cgroup hierarchies of this kind of machine (hybrid: v1 controllers,
// the named systemd hierarchy and cgroup2 at unified/); each node gets a
// subtree in each, which its cgroup namespace makes its root.
var cgroupHierarchies = []struct{ dir, fstype, opts string }{
	{"cpu", "cgroup", "cpu"}, {"cpuacct", "cgroup", "cpuacct"}, {"cpuset", "cgroup", "cpuset"},
	{"memory", "cgroup", "memory"}, {"devices", "cgroup", "devices"}, {"freezer", "cgroup", "freezer"},
	{"blkio", "cgroup", "blkio"}, {"pids", "cgroup", "pids"}, {"systemd", "cgroup", "none,name=systemd"},
	{"unified", "cgroup2", ""},
}

// workerNode is one node of the multi-node cluster: a network namespace
// (netns), and a holder process that made a mount, UTS and cgroup
// namespace in it (its own /sys/fs/cgroup showing its subtree as root, its
// own bpffs at /sys/fs/bpf, its hostname); the node's containerd and
// kubelet run in all four.
type workerNode struct {
	*node
	name    string
	ip      string // on the node network
	podCIDR string
	podGW   string
	netns   string
	cgroup  string // the subtree's name below each hierarchy's root
	holder  *proc
	kubelet *proc
	// stateDir is the agents' state directory, a tmpfs in each node.
	stateDir string
	// hostCNIConf and hostCNIBin are the CNI directories the agent's
	// DaemonSet mounts (one path for every node, as /etc/cni/net.d is);
	// each node binds its own directories there, as each real node has
	// its own /etc/cni/net.d.
	hostCNIConf, hostCNIBin string
}

// nodeCount is APIARY_NODES (make test-cluster NODES=…), 2 by default.
func nodeCount(t *testing.T) int {
	v := os.Getenv("APIARY_NODES")
	if v == "" {
		return 2
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > 8 {
		t.Fatalf("APIARY_NODES=%q: want 1 to 8", v)
	}
	return n
}

// startMultiNode brings up the control plane on the host and count nodes
// in namespaces. Everything is stopped by PID and every host change put
// back when the test ends.
func startMultiNode(t *testing.T, count int) (*node, []*workerNode) {
	bins := requirements(t)
	for _, p := range []string{"unshare", "nsenter"} {
		testenv.RequireProgram(t, p, "/usr/bin", "/bin")
	}
	n := &node{t: t, dir: t.TempDir(), apiaryBin: bins["bin/image/apiary"]}
	// deploy/'s enable-nodeport ("true"): apiary serves NodePorts to
	// clients off the node too (another node's host and pods), as no
	// kube-proxy runs here. Each node's device is its own eth0 on the
	// node network, so the north-south programs touch nothing of this
	// machine's (the single node, startNode, turns them off).
	n.podLogs = filepath.Join(n.dir, "pod-logs")
	lock, err := os.OpenFile("/run/apiary-test-cluster.lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatalf("another test cluster runs on this machine (lock %s): %v", lock.Name(), err)
	}
	t.Cleanup(func() { lock.Close() })
	n.saveSysctls()
	// The control plane's address: the API server's certificate names it,
	// and the nodes reach it through the node network.
	n.makeBridge()
	n.cleanupHostState()
	n.startControlPlane(bins)
	n.makeNodeNetwork()

	var workers []*workerNode
	for i := 1; i <= count; i++ {
		w := n.newWorker(i)
		workers = append(workers, w)
		w.setupNetwork(count)
		w.makeNamespaces()
		w.startContainerd(bins)
		w.importImages(bins)
		w.startKubelet(bins)
	}
	t.Cleanup(func() {
		if t.Failed() {
			n.dumpLogs()
			for _, w := range workers {
				w.dumpLogs()
			}
		}
	})
	for _, w := range workers {
		w.waitReady()
		t.Logf("node %s Ready", w.name)
	}
	testenv.Eventually(t, upTimeout, "ServiceAccount default/default", func() (bool, string) {
		_, err := n.cs.CoreV1().ServiceAccounts("default").Get(context.Background(), "default", metav1.GetOptions{})
		return err == nil, fmt.Sprint(err)
	})
	return n, workers
}

// makeNodeNetwork makes the node network's bridge, the host's address on
// it the nodes' gateway.
func (n *node) makeNodeNetwork() {
	n.run("ip", "link", "add", nodeNetBridge, "type", "bridge")
	n.t.Cleanup(func() {
		if out, err := exec.Command("ip", "link", "del", nodeNetBridge).CombinedOutput(); err != nil {
			n.t.Errorf("ip link del %s: %v: %s", nodeNetBridge, err, out)
		}
	})
	n.run("ip", "addr", "add", nodeNetGW+"/24", "dev", nodeNetBridge)
	n.run("ip", "link", "set", nodeNetBridge, "up")
}

func (n *node) newWorker(i int) *workerNode {
	name := fmt.Sprintf("apiary-node%d", i)
	dir := filepath.Join(n.dir, name)
	w := &workerNode{
		node: &node{t: n.t, dir: dir, server: n.server, admin: n.admin, cs: n.cs, apiaryBin: n.apiaryBin,
			kubeconfigPath: n.kubeconfigPath, podLogs: filepath.Join(dir, "pod-logs")},
		name:        name,
		ip:          fmt.Sprintf("%s%d", nodeNetPrefix, 10+i),
		podCIDR:     fmt.Sprintf("10.253.%d.0/24", i),
		podGW:       fmt.Sprintf("10.253.%d.1", i),
		netns:       fmt.Sprintf("apmn%d-%d", i, os.Getpid()),
		cgroup:      fmt.Sprintf("apiary-mn-%d-%s", os.Getpid(), name),
		stateDir:    filepath.Join(n.dir, "agent-state"),
		hostCNIConf: n.cniConfDir(),
		hostCNIBin:  n.cniBinDir(),
	}
	if err := os.MkdirAll(w.stateDir, 0o700); err != nil {
		n.t.Fatal(err)
	}
	return w
}

func nodeIPOf(i int) string { return fmt.Sprintf("%s%d", nodeNetPrefix, 10+i) }

// setupNetwork makes the node's network namespace, its eth0 on the node
// network, the routes to the other nodes' pod CIDRs through their node
// addresses, and the host's routes to this node's pods (the test asks pods
// over HTTP from the host).
func (w *workerNode) setupNetwork(count int) {
	t := w.t
	w.run("ip", "netns", "add", w.netns)
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", w.netns).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", w.netns, err, out)
		}
	})
	host := w.netns + "h"
	w.run("ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", w.netns)
	// Deleted here, before the namespace: the kernel frees a namespace
	// (and the veth with it) asynchronously, and the next cluster of this
	// process (make conformance-multinode runs several) uses the same
	// names.
	t.Cleanup(func() { exec.Command("ip", "link", "del", host).Run() })
	w.run("ip", "link", "set", host, "master", nodeNetBridge, "up")
	in := func(args ...string) { w.run("ip", append([]string{"netns", "exec", w.netns}, args...)...) }
	in("ip", "link", "set", "lo", "up")
	in("ip", "addr", "add", w.ip+"/24", "dev", "eth0")
	in("ip", "link", "set", "eth0", "up")
	in("ip", "route", "add", "default", "via", nodeNetGW)
	in("sysctl", "-qw", "net.ipv4.ip_forward=1")
	idx := 0
	fmt.Sscanf(w.name, "apiary-node%d", &idx)
	for j := 1; j <= count; j++ {
		if j != idx {
			in("ip", "route", "add", fmt.Sprintf("10.253.%d.0/24", j), "via", nodeIPOf(j))
		}
	}
	w.run("ip", "route", "add", w.podCIDR, "via", w.ip)
}

// makeNamespaces makes the node's cgroup subtrees and starts the holder:
// in the node's network namespace, it unshares mount, UTS and cgroup
// namespaces (the cgroup namespace rooted at the subtrees it was moved
// into), mounts the hierarchies again so that /sys/fs/cgroup shows the
// subtree as root, a bpffs of its own at /sys/fs/bpf, and sleeps.
func (w *workerNode) makeNamespaces() {
	t := w.t
	var dirs []string
	for _, h := range cgroupHierarchies {
		d := filepath.Join("/sys/fs/cgroup", h.dir, w.cgroup)
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		dirs = append(dirs, d)
		if h.dir == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				data, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/cpuset", f))
				if err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(d, f), data, 0o644); err != nil {
					t.Fatalf("%s: %v", f, err)
				}
			}
		}
	}
	// Registered before any process starts, so it runs after they stop.
	t.Cleanup(func() { w.removeCgroups(dirs) })
	var script strings.Builder
	// A sysfs of the node's network namespace (what ip netns exec does),
	// then its cgroup hierarchies and bpffs on it; the agents' state
	// directory (one path in the DaemonSet) a tmpfs of the node's own.
	fmt.Fprintf(&script, "set -e\nmount --make-rprivate /\nmount -t sysfs sysfs /sys\nmount -t tmpfs tmpfs %s\nmount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup\n", w.stateDir)
	for _, h := range cgroupHierarchies {
		fmt.Fprintf(&script, "mkdir -p /sys/fs/cgroup/%s\n", h.dir)
		if h.opts != "" {
			fmt.Fprintf(&script, "mount -t %s -o %s %s /sys/fs/cgroup/%s\n", h.fstype, h.opts, h.fstype, h.dir)
		} else {
			fmt.Fprintf(&script, "mount -t %s %s /sys/fs/cgroup/%s\n", h.fstype, h.fstype, h.dir)
		}
	}
	for _, d := range [][2]string{{w.cniConfDir(), w.hostCNIConf}, {w.cniBinDir(), w.hostCNIBin}} {
		fmt.Fprintf(&script, "mkdir -p %s %s\nmount --bind %s %s\n", d[0], d[1], d[0], d[1])
	}
	fmt.Fprintf(&script, "mount -t bpf bpf /sys/fs/bpf\nhostname %s\necho ready\nexec sleep infinity\n", w.name)
	w.holder = w.startIn("holder", nil, true, "/usr/bin/unshare", "--mount", "--uts", "--cgroup", "--propagation", "private", "/bin/sh", "-c", script.String())
	testenv.Eventually(t, upTimeout, "node "+w.name+"'s namespaces", func() (bool, string) {
		data, _ := os.ReadFile(w.holder.log)
		if w.holder.exited() {
			t.Fatalf("the holder of %s exited: %v\n%s", w.name, w.holder.err, data)
		}
		return strings.Contains(string(data), "ready"), string(data)
	})
}

// startIn starts a process of the node in its cgroup subtrees and
// namespaces (only the network namespace for the holder, which makes the
// others), stopped by PID when the test ends.
func (w *workerNode) startIn(name string, env []string, holder bool, path string, args ...string) *proc {
	var enter string
	for _, h := range cgroupHierarchies {
		enter += fmt.Sprintf("echo $$ > /sys/fs/cgroup/%s/%s/cgroup.procs\n", h.dir, w.cgroup)
	}
	ns := []string{"nsenter", "--net=/run/netns/" + w.netns}
	if !holder {
		pid := strconv.Itoa(w.holder.cmd.Process.Pid)
		ns = []string{"nsenter", "-t", pid, "-n", "-m", "-u", "-C"}
	}
	full := append(append(ns, "--", path), args...)
	quoted := make([]string, len(full))
	for i, a := range full {
		quoted[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	if env == nil {
		env = os.Environ()
	}
	return w.start(name, env, "/bin/sh", "-c", enter+"exec "+strings.Join(quoted, " "))
}

// removeCgroups kills what is left in the node's subtrees (by PID) and
// removes them, deepest first.
func (w *workerNode) removeCgroups(roots []string) {
	for range 20 {
		var pids []int
		for _, r := range roots {
			filepath.WalkDir(r, func(p string, d os.DirEntry, err error) error {
				if err != nil || d.Name() != "cgroup.procs" {
					return nil
				}
				data, _ := os.ReadFile(p)
				for _, f := range strings.Fields(string(data)) {
					if pid, err := strconv.Atoi(f); err == nil && pid != os.Getpid() {
						pids = append(pids, pid)
					}
				}
				return nil
			})
		}
		if len(pids) == 0 {
			break
		}
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(200 * time.Millisecond)
	}
	var dirs []string
	for _, r := range roots {
		filepath.WalkDir(r, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
	}
	sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
	for _, d := range dirs {
		var err error
		for range 50 {
			if err = os.Remove(d); err == nil || os.IsNotExist(err) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil && !os.IsNotExist(err) {
			w.t.Errorf("remove cgroup %s: %v", d, err)
		}
	}
}

// writeWorkerCNIConf writes the node's CNI configuration: the bridge
// plugin on the node's bridge with its pod CIDR, as kindnet leaves it; the
// node's agent chains apiary-cni after it.
func (w *workerNode) writeWorkerCNIConf() {
	writeFile(w.t, filepath.Join(w.dir, "cni", "10-apiary-test.conflist"), fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "apiary-test",
  "plugins": [{
    "type": "bridge", "bridge": "cbr0", "isGateway": true, "isDefaultGateway": true, "ipMasq": false,
    "ipam": {"type": "host-local", "ranges": [[{"subnet": %q, "gateway": %q}]], "dataDir": %q}
  }]
}
`, w.podCIDR, w.podGW, filepath.Join(w.dir, "ipam")))
}

// waitChained waits until the node's agent has chained apiary-cni after
// the bridge plugin in the node's own CNI configuration and copied the
// plugin next to the node's others (--cni-chaining-mode=chain, as deploy/
// ships it), as on the single node.
func (w *workerNode) waitChained(pinDir string) {
	w.pinDir = pinDir
	w.waitCNIChained()
}

// startContainerd starts the node's containerd, in its namespaces, on
// its own directories and socket.
func (w *workerNode) startContainerd(bins map[string]string) {
	t := w.t
	w.writeWorkerCNIConf()
	config := w.writeContainerdConfig(bins)
	w.startIn("containerd", append(os.Environ(), "PATH=/usr/sbin:/usr/bin:/sbin:/bin"), false, bins["containerd"], "--config", config, "--log-level", "info")
	t.Cleanup(func() { w.killShims() })
	testenv.Eventually(t, upTimeout, w.name+"'s containerd socket", func() (bool, string) {
		out, err := exec.Command(bins["ctr"], "--address", w.ctrSock, "version").CombinedOutput()
		return err == nil, string(out)
	})
}

// startKubelet starts the node's kubelet, in its namespaces, named after
// the node, on its node address.
func (w *workerNode) startKubelet(bins map[string]string) {
	t := w.t
	d := filepath.Join(w.dir, "kubelet")
	config := filepath.Join(d, "config.yaml")
	writeFile(t, config, fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
oomScoreAdj: 0
containerRuntimeEndpoint: unix://%s
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
address: %s
port: 10250
readOnlyPort: 0
healthzPort: 0
failSwapOn: false
resolvConf: ""
podLogsDir: %q
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", imagefs.available: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
localStorageCapacityIsolation: false
serializeImagePulls: false
maxPods: 60
`, w.ctrSock, w.ip, w.podLogs))
	env := []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + d}
	w.kubelet = w.startIn("kubelet", env, false, bins["kubelet"], "--config="+config, "--kubeconfig="+w.kubeconfigPath,
		"--root-dir="+filepath.Join(d, "root"), "--hostname-override="+w.name, "--node-ip="+w.ip, "--v=1")
}

// waitReady waits until the node is Ready.
func (w *workerNode) waitReady() {
	testenv.Eventually(w.t, upTimeout, "node "+w.name+" Ready", func() (bool, string) {
		node, err := w.cs.CoreV1().Nodes().Get(context.Background(), w.name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return c.Status == corev1.ConditionTrue, c.Reason + ": " + c.Message
			}
		}
		return false, "no Ready condition"
	})
}
