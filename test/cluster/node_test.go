//go:build cluster

package cluster

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/apiary-net/apiary/internal/imagetar"
	"github.com/apiary-net/apiary/internal/testenv"
)

const repoRoot = "../.."

// The node's network: a bridge the test makes, the pods' subnet on it and
// the Services' range, chosen away from what other tests of this
// repository use (10.96.0.0/16, 10.231.0.0/16, 127.0.0.0/8).
const (
	bridgeName  = "apcl0"
	nodeIP      = "10.253.0.1"
	podSubnet   = "10.253.0.0/24"
	serviceCIDR = "10.254.0.0/24"
	nodeName    = "apiary-node"
)

// Images the test builds and imports; imagePullPolicy Never in the test's
// pods, IfNotPresent in deploy/, so nothing is ever pulled.
const (
	pauseImage   = "apiary.test/pause:dev"
	testpodImage = "apiary.test/testpod:dev"
	apiaryImage  = "ghcr.io/apiary-net/apiary:latest"
)

// Timeouts, generous: the machine is shared.
const (
	upTimeout   = 90 * time.Second
	waitTimeout = 60 * time.Second
)

// sysctls are what the kubelet and the bridge plugin rewrite on the host;
// the test puts them back.
var sysctls = []string{
	"net/ipv4/ip_forward",
	"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
}

// proc is a process the node runs, stopped by its PID.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string // its log file
	done chan struct{}
	err  error
}

// node is the running single-node cluster.
type node struct {
	t         *testing.T
	dir       string
	procs     []*proc
	server    string // the API server, https://nodeIP:port
	admin     *rest.Config
	cs        *kubernetes.Clientset
	ctrSock   string
	apiaryBin string // the binary in apiary's image, for the host side (monitor, cleanup)
	podLogs   string
	// kubeconfigPath is the admin's kubeconfig, for the control plane's
	// components and the kubelet.
	kubeconfigPath string
	// pinDir is the agent's pin directory: whatever the test left there is
	// removed with `apiary cleanup` once every pod process has stopped.
	pinDir string
	// clusterDNS makes the kubelet give pods the node's address as their
	// DNS server, where serveClusterDNS answers (see withClusterDNS).
	clusterDNS bool
	// serviceRange is the API server's --service-cluster-ip-range
	// (serviceCIDR unless withServiceCIDR).
	serviceRange string
	// podDefaultRoute gives pods a default route through the node (see
	// withPodDefaultRoute).
	podDefaultRoute bool
	// agentEnv is set on the agent's container by install, replacing a
	// variable of the same name (see withAgentEnv).
	agentEnv []corev1.EnvVar
	// agentConfig are keys of deploy/'s apiary-config ConfigMap that
	// install sets, as a user of this cluster sets them.
	agentConfig map[string]string
}

// nodeOption changes how startNode brings the node up.
type nodeOption func(*node)

// withClusterDNS gives pods a cluster DNS (dnsPolicy ClusterFirst, search
// <namespace>.svc.cluster.local …) served by the test on the node's
// address: the Services suite reaches Services by name.
func withClusterDNS() nodeOption { return func(n *node) { n.clusterDNS = true } }

// withServiceCIDR gives the API server a larger Service range than
// serviceCIDR's 254 addresses (the kube-proxy benchmark makes 10,000
// Services).
func withServiceCIDR(cidr string) nodeOption { return func(n *node) { n.serviceRange = cidr } }

// withPodDefaultRoute gives pods a default route through the node, as a
// cluster's pods have: without one (the default here, so that nothing a
// pod sends leaves the machine) a pod answers only clients of its own
// subnet or the node's, and a NodePort client outside whose address is
// kept (apiary's local backends) gets no answer.
func withPodDefaultRoute() nodeOption { return func(n *node) { n.podDefaultRoute = true } }

// withAgentEnv sets environment variables (flags, APIARY_<FLAG>) on the
// agent's container when install applies deploy/.
func withAgentEnv(env ...corev1.EnvVar) nodeOption {
	return func(n *node) { n.agentEnv = append(n.agentEnv, env...) }
}

// requirements returns the paths of what the node runs, skipping (failing
// under APIARY_STRICT=1) when something is missing.
func requirements(t *testing.T) map[string]string {
	testenv.RequireRoot(t)
	bins := testenv.RequireKubeTestbin(t, repoRoot, "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet")
	for _, b := range []string{"containerd", "containerd-shim-runc-v2", "ctr", "runc"} {
		bins[b] = testenv.RequireProgram(t, b, "/usr/sbin", "/usr/bin")
	}
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		testenv.RequireProgram(t, p, "/usr/lib/cni")
	}
	for _, f := range []string{"bin/apiary-image.tar", "bin/image/apiary", "bin/image/apiary-cni"} {
		p := filepath.Join(repoRoot, f)
		if _, err := os.Stat(p); err != nil {
			testenv.Skip(t, fmt.Sprintf("needs %s: run make image (make test-cluster does)", f))
		}
		abs, _ := filepath.Abs(p)
		bins[f] = abs
	}
	return bins
}

// startNode brings the cluster up. Everything it starts is stopped by PID
// and everything it changes on the host is put back when the test ends;
// when the test fails, the logs of every process are shown first.
func startNode(t *testing.T, opts ...nodeOption) *node {
	bins := requirements(t)
	n := &node{t: t, dir: t.TempDir(), apiaryBin: bins["bin/image/apiary"], serviceRange: serviceCIDR}
	// This node is the machine itself: the devices of its default routes
	// are the machine's own uplink, which the north-south programs must
	// not touch (other work shares the machine). The multi-node cluster's
	// nodes, whose eth0 is their own, keep deploy/'s "true"; the
	// kube-proxy comparison sets --devices to a device of its own.
	n.agentConfig = map[string]string{"enable-nodeport": "false"}
	for _, o := range opts {
		o(n)
	}
	n.podLogs = filepath.Join(n.dir, "pod-logs")

	// One cluster per machine: containerd's shim sockets, the kubelet's
	// kubepods cgroups and the socket LB on the root cgroup are the host's.
	lock, err := os.OpenFile("/run/apiary-test-cluster.lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatalf("another test cluster runs on this machine (lock %s): %v", lock.Name(), err)
	}
	t.Cleanup(func() { lock.Close() })
	for _, addr := range []string{"127.0.0.1:9234"} {
		if ln, err := net.Listen("tcp", addr); err != nil {
			t.Fatalf("the agent's API address %s is taken: %v", addr, err)
		} else {
			ln.Close()
		}
	}

	n.saveSysctls()
	n.makeBridge()
	n.cleanupHostState()
	n.startControlPlane(bins)
	n.startContainerd(bins)
	n.importImages(bins)
	if n.clusterDNS {
		n.serveClusterDNS()
	}
	n.startKubelet(bins)
	t.Cleanup(func() {
		if t.Failed() {
			n.dumpLogs()
		}
	})
	return n
}

func (n *node) saveSysctls() {
	saved := map[string]string{}
	for _, s := range sysctls {
		data, err := os.ReadFile("/proc/sys/" + s)
		if err != nil {
			n.t.Fatal(err)
		}
		saved[s] = string(data)
	}
	n.t.Cleanup(func() {
		for _, s := range sysctls {
			if err := os.WriteFile("/proc/sys/"+s, []byte(saved[s]), 0o644); err != nil {
				n.t.Errorf("restore sysctl %s: %v", s, err)
			}
		}
	})
}

// makeBridge makes the pods' bridge with the node's address on it, so
// that the API server has its address before any pod runs.
func (n *node) makeBridge() {
	if _, err := net.InterfaceByName(bridgeName); err == nil {
		n.t.Fatalf("interface %s exists: a test cluster runs, or one left it behind (ip link del %s)", bridgeName, bridgeName)
	}
	for _, args := range [][]string{
		{"link", "add", bridgeName, "type", "bridge"},
		{"addr", "add", nodeIP + "/24", "dev", bridgeName},
		{"link", "set", bridgeName, "up"},
	} {
		n.run("ip", args...)
	}
	n.t.Cleanup(func() {
		if out, err := exec.Command("ip", "link", "del", bridgeName).CombinedOutput(); err != nil {
			n.t.Errorf("ip link del %s: %v: %s", bridgeName, err, out)
		}
	})
}

// cleanupHostState registers, to run once every process has stopped, the
// removal of what the kubelet and containerd leave on the host: processes
// in the pods' cgroups, the kubepods cgroups, mounts under the test's
// directory, network namespaces and the kubelet's log links.
func (n *node) cleanupHostState() {
	netnsBefore, _ := filepath.Glob("/run/netns/cni-*")
	// Fixed paths containerd, its shims, libcni and the kubelet write to
	// whatever their configuration says: what appears there is removed.
	var restores []func()
	for _, dir := range []string{"/run/containerd", "/var/lib/cni", "/var/lib/kubelet"} {
		restores = append(restores, n.removeNewUnder(dir))
	}
	n.t.Cleanup(func() {
		defer func() {
			for _, r := range restores {
				r()
			}
		}()
		n.killPodProcesses()
		if n.pinDir != "" {
			if out, err := exec.Command(n.apiaryBin, "cleanup", "--bpf-pin-dir", n.pinDir).CombinedOutput(); err != nil {
				n.t.Errorf("apiary cleanup: %v\n%s", err, out)
			}
		}
		n.unmountUnder(n.dir)
		after, _ := filepath.Glob("/run/netns/cni-*")
		for _, ns := range after {
			if !slices.Contains(netnsBefore, ns) {
				unix.Unmount(ns, unix.MNT_DETACH)
				os.Remove(ns)
			}
		}
		n.removeKubepods()
		links, _ := filepath.Glob("/var/log/containers/*.log")
		for _, l := range links {
			if dst, err := os.Readlink(l); err == nil && strings.HasPrefix(dst, n.dir) {
				os.Remove(l)
			}
		}
	})
}

// removeNewUnder notes what is under dir now and returns a function that
// removes what is not there then (dir itself, if it was missing).
func (n *node) removeNewUnder(dir string) func() {
	before := map[string]bool{}
	_, statErr := os.Stat(dir)
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil {
			before[p] = true
		}
		return nil
	})
	return func() {
		if statErr != nil {
			if err := os.RemoveAll(dir); err != nil {
				n.t.Errorf("remove %s: %v", dir, err)
			}
			return
		}
		var added []string
		filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err == nil && !before[p] {
				added = append(added, p)
				if d.IsDir() {
					return filepath.SkipDir
				}
			}
			return nil
		})
		for _, p := range added {
			if err := os.RemoveAll(p); err != nil {
				n.t.Errorf("remove %s: %v", p, err)
			}
		}
	}
}

// killPodProcesses kills, by PID, every process left in a kubepods cgroup
// (only this test's kubelet makes them: one cluster per machine).
func (n *node) killPodProcesses() {
	for range 20 {
		pids := n.podPIDs()
		if len(pids) == 0 {
			return
		}
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if pids := n.podPIDs(); len(pids) > 0 {
		n.t.Errorf("processes left in kubepods cgroups: %v", pids)
	}
}

// podPIDs returns the processes in the kubelet's cgroups: those whose
// cgroup, in any hierarchy, lies below the root's kubepods (other tests
// make kubepods trees of their own, below their own cgroups), zombies left
// out.
func (n *node) podPIDs() []int {
	var pids []int
	procs, _ := filepath.Glob("/proc/[0-9]*/cgroup")
	for _, p := range procs {
		data, err := os.ReadFile(p)
		if err != nil || !inKubepods(string(data)) {
			continue
		}
		stat, err := os.ReadFile(filepath.Join(filepath.Dir(p), "stat"))
		if err != nil || strings.Contains(string(stat), ") Z ") {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
		if pid != os.Getpid() {
			pids = append(pids, pid)
		}
	}
	return pids
}

// inKubepods says whether a /proc/PID/cgroup names a cgroup below the
// root's kubepods in some hierarchy.
func inKubepods(cgroups string) bool {
	for _, line := range strings.Split(cgroups, "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && (strings.HasPrefix(parts[2], "/kubepods/") || strings.HasPrefix(parts[2], "/kubepods.slice/")) {
			return true
		}
	}
	return false
}

// removeKubepods removes the kubelet's cgroups, deepest first, from every
// hierarchy.
func (n *node) removeKubepods() {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/kubepods")
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
		if err := os.Remove(d); err != nil {
			n.t.Errorf("remove cgroup %s: %v", d, err)
		}
	}
}

// unmountUnder unmounts every mount below dir, deepest first.
func (n *node) unmountUnder(dir string) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		n.t.Error(err)
		return
	}
	defer f.Close()
	var mounts []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && strings.HasPrefix(fields[4], dir+"/") {
			mounts = append(mounts, fields[4])
		}
	}
	sort.Slice(mounts, func(i, j int) bool { return len(mounts[i]) > len(mounts[j]) })
	for _, m := range mounts {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			n.t.Errorf("unmount %s: %v", m, err)
		}
	}
}

func (n *node) run(name string, args ...string) string {
	n.t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		n.t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// start runs a process of the node, its output in a log file; it is
// stopped by PID (SIGTERM, SIGKILL after 20 s) when the test ends.
func (n *node) start(name string, env []string, path string, args ...string) *proc {
	n.t.Helper()
	logDir := filepath.Join(n.dir, "logs")
	os.MkdirAll(logDir, 0o755)
	p := &proc{name: name, cmd: exec.Command(path, args...), log: filepath.Join(logDir, name+".log"), done: make(chan struct{})}
	f, err := os.Create(p.log)
	if err != nil {
		n.t.Fatal(err)
	}
	p.cmd.Stdout, p.cmd.Stderr = f, f
	p.cmd.Env = env
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		n.t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		f.Close()
		close(p.done)
	}()
	n.procs = append(n.procs, p)
	n.t.Cleanup(func() { p.stop(n.t) })
	return p
}

func (p *proc) stop(t *testing.T) {
	select {
	case <-p.done:
		return
	default:
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
		t.Logf("%s (pid %d) did not exit within 20s of SIGTERM; killed", p.name, p.cmd.Process.Pid)
	}
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// dumpLogs shows the end of every process's log and the agent pods' logs.
func (n *node) dumpLogs() {
	for _, p := range n.procs {
		n.t.Logf("==== %s (pid %d): last log lines ====\n%s", p.name, p.cmd.Process.Pid, tail(p.log, 60))
	}
	logs, _ := filepath.Glob(filepath.Join(n.podLogs, "*", "*", "*.log"))
	for _, l := range logs {
		n.t.Logf("==== pod log %s ====\n%s", strings.TrimPrefix(l, n.podLogs+"/"), tail(l, 60))
	}
}

func tail(path string, lines int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	all := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}

func freePort(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
}

// startControlPlane starts etcd, kube-apiserver (on every address, so
// that pods reach it at the node's address), kube-controller-manager and
// kube-scheduler, all with an admin token.
func (n *node) startControlPlane(bins map[string]string) {
	t := n.t
	dir := n.dir
	clientPort, peerPort := freePort(t), freePort(t)
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", clientPort)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	n.start("etcd", nil, bins["etcd"],
		"--name=node", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=node="+peerURL, "--unsafe-no-fsync=true", "--log-level=warn")

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	saKey := filepath.Join(dir, "sa.key")
	writeFile(t, saKey, string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})))
	token := rand.Text()
	tokens := filepath.Join(dir, "tokens.csv")
	writeFile(t, tokens, token+",admin,admin-uid,system:masters\n")

	port := freePort(t)
	n.server = fmt.Sprintf("https://%s:%d", nodeIP, port)
	certDir := filepath.Join(dir, "certs")
	n.start("kube-apiserver", nil, bins["kube-apiserver"],
		"--etcd-servers="+etcdURL,
		"--bind-address=0.0.0.0", "--advertise-address="+nodeIP, "--secure-port="+strconv.Itoa(port),
		"--cert-dir="+certDir,
		"--token-auth-file="+tokens, "--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+saKey, "--service-account-signing-key-file="+saKey,
		"--service-cluster-ip-range="+n.serviceRange, "--service-node-port-range=30000-30100",
		"--allow-privileged=true",
		// The kubelet is known by its InternalIP (its name resolves
		// nowhere): exec and logs go there.
		"--kubelet-preferred-address-types=InternalIP")
	probe := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	testenv.Eventually(t, upTimeout, "kube-apiserver /readyz", func() (bool, string) {
		req, _ := http.NewRequest(http.MethodGet, n.server+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := probe.Do(req)
		if err != nil {
			return false, err.Error()
		}
		defer resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})
	caFile := filepath.Join(certDir, "apiserver.crt")
	n.admin = &rest.Config{Host: n.server, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAFile: caFile}}
	n.cs, err = kubernetes.NewForConfig(n.admin)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(dir, "admin.kubeconfig")
	writeFile(t, kubeconfig, fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: node, cluster: {server: %q, certificate-authority: %q}}]
users: [{name: admin, user: {token: %q}}]
contexts: [{name: node, context: {cluster: node, user: admin}}]
current-context: node
`, n.server, caFile, token))

	n.start("kube-controller-manager", nil, bins["kube-controller-manager"],
		"--kubeconfig="+kubeconfig, "--leader-elect=false", "--secure-port=0",
		"--service-account-private-key-file="+saKey, "--root-ca-file="+caFile,
		"--use-service-account-credentials=false", "--controllers=*,-nodeipam,-cloud-node-lifecycle")
	n.start("kube-scheduler", nil, bins["kube-scheduler"],
		"--kubeconfig="+kubeconfig, "--leader-elect=false", "--secure-port=0")
	n.kubeconfigPath = kubeconfig
}

// cniConfName is the node's CNI configuration, in n.cniConfDir().
const cniConfName = "10-apiary-test.conflist"

// cniConfDir and cniBinDir are the node's CNI directories, which the
// agent's DaemonSet mounts in place of the host's /etc/cni/net.d and
// /opt/cni/bin.
func (n *node) cniConfDir() string { return filepath.Join(n.dir, "cni") }
func (n *node) cniBinDir() string  { return filepath.Join(n.dir, "cni-bin") }

// writeCNIConf writes the node's CNI configuration: the bridge plugin on
// the test's bridge, as a node's primary plugin leaves it. The agent
// chains apiary-cni after it once it runs. containerd reads the directory
// again when it changes.
func (n *node) writeCNIConf() {
	routes := ""
	if n.podDefaultRoute {
		routes = `, "routes": [{"dst": "0.0.0.0/0"}]`
	}
	writeFile(n.t, filepath.Join(n.cniConfDir(), cniConfName), fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "apiary-test",
  "plugins": [{
    "type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": false,
    "ipam": {"type": "host-local", "ranges": [[{"subnet": %q, "gateway": %q}]], "dataDir": %q%s}
  }]
}
`, bridgeName, podSubnet, nodeIP, filepath.Join(n.dir, "ipam"), routes))
}

// cniPlugins returns the plugin types of the node's CNI configuration,
// with apiary-cni's pin directory.
func (n *node) cniPlugins() ([]string, error) {
	data, err := os.ReadFile(filepath.Join(n.cniConfDir(), cniConfName))
	if err != nil {
		return nil, err
	}
	var conf struct {
		Plugins []struct {
			Type      string `json:"type"`
			BPFPinDir string `json:"bpfPinDir"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(data, &conf); err != nil {
		return nil, fmt.Errorf("%s: %w", data, err)
	}
	var out []string
	for _, p := range conf.Plugins {
		if p.BPFPinDir != "" {
			out = append(out, p.Type+"@"+p.BPFPinDir)
		} else {
			out = append(out, p.Type)
		}
	}
	return out, nil
}

// waitCNIChained waits until the agent (--cni-chaining-mode=chain, as
// deploy/ ships it) has copied apiary-cni into the node's plugin
// directory and chained it after the bridge plugin, as docs/kubernetes.md
// says it does once its interface programs are pinned: from then on every
// new pod's veth is covered at the packet level from its creation.
func (n *node) waitCNIChained() {
	want := fmt.Sprint([]string{"bridge", "apiary-cni@" + n.pinDir})
	testenv.Eventually(n.t, waitTimeout, "the agent chains apiary-cni", func() (bool, string) {
		got, err := n.cniPlugins()
		if err != nil {
			return false, err.Error()
		}
		if fmt.Sprint(got) != want {
			return false, fmt.Sprintf("plugins %v, want %s", got, want)
		}
		if _, err := os.Stat(filepath.Join(n.cniBinDir(), "apiary-cni")); err != nil {
			return false, err.Error()
		}
		return true, ""
	})
}

// symlink makes link point at target, with link's directory.
func symlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

// startContainerd starts containerd on the test's own directories and
// socket, runc from Debian, the bridge plugin on the test's bridge.
func (n *node) startContainerd(bins map[string]string) {
	t := n.t
	n.writeCNIConf()
	config := n.writeContainerdConfig(bins)
	n.start("containerd", append(os.Environ(), "PATH=/usr/sbin:/usr/bin:/sbin:/bin"), bins["containerd"], "--config", config, "--log-level", "info")
	// Shims outlive containerd: once it is stopped (cleanups run last
	// first, so this one runs after), kill the ones it started, by PID.
	n.t.Cleanup(func() { n.killShims() })
	testenv.Eventually(t, upTimeout, "containerd's socket", func() (bool, string) {
		out, err := exec.Command(bins["ctr"], "--address", n.ctrSock, "version").CombinedOutput()
		return err == nil, string(out)
	})
}

// killShims kills the containerd shims of this test's containerd (their
// command line names its socket), by PID.
func (n *node) killShims() {
	cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, c := range cmdlines {
		data, err := os.ReadFile(c)
		if err != nil || !strings.Contains(string(data), "containerd-shim") || !strings.Contains(string(data), n.ctrSock) {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(c)))
		syscall.Kill(pid, syscall.SIGKILL)
	}
}

// importImages builds the test's images (the pause process and the test
// pod's program, from this repository's Go sources) and imports them and
// apiary's own image (make image) into containerd's k8s.io namespace.
func (n *node) importImages(bins map[string]string) {
	t := n.t
	bin := filepath.Join(n.dir, "testpod")
	build := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "./test/cluster/testpod")
	build.Dir = repoRoot
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./test/cluster/testpod: %v\n%s", err, out)
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	files := []imagetar.File{{Path: "/testpod", Data: data, Mode: 0o755}}
	for _, img := range []imagetar.Image{
		{Tags: []string{pauseImage}, Files: files, Entrypoint: []string{"/testpod", "pause"}, Architecture: runtime.GOARCH},
		{Tags: []string{testpodImage}, Files: files, Entrypoint: []string{"/testpod", "serve"}, Architecture: runtime.GOARCH},
	} {
		path := filepath.Join(n.dir, strings.NewReplacer("/", "_", ":", "_").Replace(img.Tags[0])+".tar")
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := imagetar.Write(f, img); err != nil {
			t.Fatal(err)
		}
		f.Close()
		n.run(bins["ctr"], "--address", n.ctrSock, "-n", "k8s.io", "images", "import", path)
	}
	n.run(bins["ctr"], "--address", n.ctrSock, "-n", "k8s.io", "images", "import", bins["bin/apiary-image.tar"])
	out := n.run(bins["ctr"], "--address", n.ctrSock, "-n", "k8s.io", "images", "ls", "-q")
	for _, img := range []string{pauseImage, testpodImage, apiaryImage} {
		if !slices.Contains(strings.Fields(out), img) {
			t.Fatalf("image %s not in containerd after import:\n%s", img, out)
		}
	}
}

// startKubelet starts the kubelet with the quirks this kind of machine
// needs (docs/design.md, "A real node") and waits for the node to be
// Ready.
func (n *node) startKubelet(bins map[string]string) {
	t := n.t
	d := filepath.Join(n.dir, "kubelet")
	config := filepath.Join(d, "config.yaml")
	dnsConfig := ""
	if n.clusterDNS {
		dnsConfig = fmt.Sprintf("clusterDNS: [%s]\nclusterDomain: %s\n", nodeIP, clusterDomain)
	}
	writeFile(t, config, fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
oomScoreAdj: 0
containerRuntimeEndpoint: unix://%s
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
address: %s
port: %d
readOnlyPort: 0
healthzPort: 0
failSwapOn: false
resolvConf: ""
podLogsDir: %q
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", imagefs.available: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
localStorageCapacityIsolation: true
serializeImagePulls: false
maxPods: 60
`, n.ctrSock, nodeIP, freePort(t), n.podLogs)+dnsConfig)
	// Without /usr/sbin on its PATH the kubelet finds no iptables and adds
	// no chains to the host's tables.
	env := []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + d}
	n.start("kubelet", env, bins["kubelet"], "--config="+config, "--kubeconfig="+n.kubeconfigPath,
		"--root-dir="+filepath.Join(d, "root"), "--hostname-override="+nodeName, "--node-ip="+nodeIP, "--v=1")
	testenv.Eventually(t, upTimeout, "node "+nodeName+" Ready", func() (bool, string) {
		node, err := n.cs.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
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
	// The control plane's default ServiceAccount, made by the controller
	// manager, is what pods need to be admitted.
	testenv.Eventually(t, upTimeout, "ServiceAccount default/default", func() (bool, string) {
		_, err := n.cs.CoreV1().ServiceAccounts("default").Get(context.Background(), "default", metav1.GetOptions{})
		return err == nil, fmt.Sprint(err)
	})
}

// writeContainerdConfig sets up a node's containerd below n.dir: its
// socket (n.ctrSock), the node's CNI plugins (Debian's; the agent copies
// apiary-cni from its image next to them) and its configuration, whose
// path it returns. The single node and each node of the multi-node
// cluster use it alike.
func (n *node) writeContainerdConfig(bins map[string]string) string {
	t := n.t
	d := filepath.Join(n.dir, "containerd")
	n.ctrSock = filepath.Join(d, "containerd.sock")
	cniBin := n.cniBinDir()
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		symlink(t, filepath.Join("/usr/lib/cni", p), filepath.Join(cniBin, p))
	}
	config := filepath.Join(d, "config.toml")
	writeFile(t, config, fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = %q
[ttrpc]
  address = %q
[plugins."io.containerd.internal.v1.opt"]
  path = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = %q
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
`, filepath.Join(d, "root"), filepath.Join(d, "state"), n.ctrSock, n.ctrSock+".ttrpc",
		filepath.Join(d, "opt"), pauseImage, bins["runc"], cniBin, n.cniConfDir()))
	return config
}
