package e2e

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Pods of TestPodInterfaceOwner: hja and hjb with veths, as a ptp CNI
// plugin makes them; hjc in a network namespace with no veth to the host.
const (
	uidHjA  = "2a2a2a2a-0000-4000-8000-00000000002a"
	uidHjB  = "2b2b2b2b-0000-4000-8000-00000000002b"
	uidHjC  = "2c2c2c2c-0000-4000-8000-00000000002c"
	hjGw4   = "10.237.0.1"
	hjGw6   = "fd00:e7::1"
	hjA4    = "10.237.0.11"
	hjA6    = "fd00:e7::11"
	hjB4    = "10.237.0.12"
	hjB6    = "fd00:e7::12"
	hjC4    = "10.237.0.13"
	hjFake4 = "10.237.0.99"
	// hjHost is a host address hjc's connections go to.
	hjHost = "127.0.1.237:8080"
)

const hjPods = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: hja, namespace: default, uid: ` + uidHjA + `, labels: {app: hja}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + hjA4 + `, podIPs: [{ip: ` + hjA4 + `}, {ip: "` + hjA6 + `"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: hjb, namespace: default, uid: ` + uidHjB + `, labels: {app: hjb}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + hjB4 + `, podIPs: [{ip: ` + hjB4 + `}, {ip: "` + hjB6 + `"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: hjc, namespace: default, uid: ` + uidHjC + `, labels: {app: hjc}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + hjC4 + `, podIPs: [{ip: ` + hjC4 + `}]}
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: hja, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: hja}}
  egress:
  - toEntities: [host]
    toPorts: [{ports: [{port: "7002", protocol: UDP}]}]
`

// podIfRow is a row of the pod-interfaces table.
type podIfRow struct {
	Name, Interface, Error string
	Ifindex                int
	FailClosed             bool
	Status                 struct{ Kind string }
}

func (a *agent) podInterface(name string) (podIfRow, error) {
	var rows []podIfRow
	if err := a.dump("pod-interfaces", &rows); err != nil {
		return podIfRow{}, err
	}
	for _, r := range rows {
		if r.Name == name {
			return r, nil
		}
	}
	return podIfRow{}, fmt.Errorf("no pod-interfaces row %s in %+v", name, rows)
}

// containerCgroup moves the processes of the pod's cgroup into a
// container's cgroup below it named name, as a pod's sandbox is, and
// returns it.
func containerCgroup(t *testing.T, pod, name string) string {
	t.Helper()
	dir := filepath.Join(pod, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0o644)
		removeCgroup(dir)
	})
	procs, err := os.ReadFile(filepath.Join(pod, "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	for _, pid := range strings.Fields(string(procs)) {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(pid), 0o644); err != nil {
			t.Fatalf("move %s into %s: %v", pid, dir, err)
		}
	}
	return dir
}

// startInCgroup starts args in the cgroup dir (in the test's network
// namespace, unless args change it), and waits until it is in another
// network namespace than the test's. It returns a function that stops it.
func startInCgroup(t *testing.T, dir string, args ...string) func() {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(args[0], args[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd()), Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stop := func() { cmd.Process.Kill(); cmd.Wait() }
	t.Cleanup(stop)
	self, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, waitTimeout, fmt.Sprintf("%v in a namespace of its own", args), func() (bool, string) {
		ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid))
		return err == nil && ns != self, fmt.Sprint(ns, err)
	})
	return stop
}

// linkIndex returns the index of interface name in network namespace ns
// ("": the test's).
func linkIndex(t *testing.T, ns, name string) int {
	t.Helper()
	args := []string{"-o", "link", "show", name}
	if ns != "" {
		args = append([]string{"-n", ns}, args...)
	}
	out, err := exec.Command("ip", args...).Output()
	if err != nil {
		t.Fatalf("ip %v: %v", args, err)
	}
	idx, _, _ := strings.Cut(string(out), ":")
	n, err := strconv.Atoi(idx)
	if err != nil {
		t.Fatalf("ip %v: %q", args, out)
	}
	return n
}

// TestPodInterfaceOwner: nothing a pod does in network namespaces of its
// own decides which interface is enforced, on the shipped binary. A
// container of pod hja whose cgroup sorts before the sandbox's runs
// `unshare -n sleep infinity`, then a process in a namespace with a veth
// pair crafted to look, from inside, like hjb's interface: each time,
// after a full rescan, hja's and hjb's pod-interfaces rows keep their own
// veths, the pinned links of both stay, and a frame hja sends with a
// forged source is still dropped. Pod hjc, whose namespace has no veth to
// the host, fails closed: its row says why, /healthz is degraded naming
// it, its endpoint-policy row says "no pod interface" and its connections
// are denied (EPERM); once its veth comes, it is enforced at its
// interface and no longer denied.
func TestPodInterfaceOwner(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	testenv.RequireProgram(t, "unshare")
	root := testenv.Cgroup(t)
	podA := makeIfPodVia(t, root, uidHjA, "hja", hjGw4, hjGw6, hjA4, hjA6)
	podB := makeIfPodVia(t, root, uidHjB, "hjb", hjGw4, hjGw6, hjB4, hjB6)
	// The sandbox in a container's cgroup, as the kubelet has it, which
	// the attacker's sorts before.
	containerCgroup(t, podA.cgroup, "sandbox")
	attackerCg := filepath.Join(podA.cgroup, "aaa")
	if err := os.Mkdir(attackerCg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(filepath.Join(attackerCg, "cgroup.kill"), []byte("1"), 0o644)
		removeCgroup(attackerCg)
	})

	// hjc: a namespace with no veth, a process in it.
	nsC := fmt.Sprintf("apiary-e2e-hjc-%d", os.Getpid())
	ipCmd(t, "netns", "add", nsC)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", nsC).Run() })
	cgC := filepath.Join(root, "kubepods", "besteffort", "pod"+uidHjC)
	if err := os.MkdirAll(cgC, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(filepath.Join(cgC, "cgroup.kill"), []byte("1"), 0o644)
		removeCgroup(cgC)
	})
	startInCgroup(t, cgC, "ip", "netns", "exec", nsC, "sleep", "infinity")

	listen(t, hjHost)
	allowed := listenUDP(t, hjGw4+":7002")
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), hjPods)
	a := startAgent(t, agentOptions{configDir: configDir, startsDegraded: true, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--allow-localhost=policy",
		"--node-ips=" + hjGw4 + "," + hjGw6, "--enable-ipv6",
	}})
	hostA, err := net.InterfaceByName(podA.hostIf)
	if err != nil {
		t.Fatal(err)
	}
	hostB, err := net.InterfaceByName(podB.hostIf)
	if err != nil {
		t.Fatal(err)
	}

	t.Run("no interface fails closed", func(t *testing.T) {
		testenv.Eventually(t, waitTimeout, "hjc's row fails closed, /healthz names it", func() (bool, string) {
			r, err := a.podInterface("default/hjc")
			if err != nil {
				return false, err.Error()
			}
			code, body, err := httpGet(a.url("/healthz"))
			return r.FailClosed && r.Ifindex == 0 && strings.Contains(r.Error, "no veth") &&
					strings.Contains(r.Error, "denied both ways") && err == nil && code == 503 && strings.Contains(body, "default/hjc"),
				fmt.Sprintf("%+v; /healthz %d %s %v", r, code, body, err)
		})
		testenv.Eventually(t, waitTimeout, "hjc's endpoint-policy row denies it", func() (bool, string) {
			r, err := a.endpointPolicy("default/hjc")
			if err != nil {
				return false, err.Error()
			}
			return strings.HasPrefix(r.Reason, "fail closed: no pod interface") && r.Ingress == "default-deny" &&
				r.Egress == "default-deny" && r.ID != 0 && r.Status.Kind == "Done", fmt.Sprintf("%+v", r)
		})
		// Eventually: the socket-level programs may not be attached yet.
		testenv.Eventually(t, waitTimeout, "hjc's connections denied", func() (bool, string) {
			got := connectFrom(t, cgC, hjHost, "")
			return got == "EPERM", got
		})
	})

	a.waitPodInterfaces(t, map[string]string{"default/hja": podA.hostIf, "default/hjb": podB.hostIf})
	// keeps checks that hja and hjb keep their interfaces and links, and
	// that hja's forged frames are still dropped.
	keeps := func(t *testing.T) {
		t.Helper()
		for _, c := range []struct {
			name string
			host *net.Interface
		}{{"default/hja", hostA}, {"default/hjb", hostB}} {
			r, err := a.podInterface(c.name)
			if err != nil {
				t.Fatal(err)
			}
			if r.Ifindex != c.host.Index || r.Interface != c.host.Name || r.FailClosed {
				t.Errorf("%s's row %+v, want %s (%d)", c.name, r, c.host.Name, c.host.Index)
			}
			for _, pin := range []string{"_from_pod", "_to_pod"} {
				if _, err := os.Stat(filepath.Join(a.pinDir, "links", "ifaces", strconv.Itoa(c.host.Index)+pin)); err != nil {
					t.Errorf("%s's link: %v", c.name, err)
				}
			}
		}
		podA.run(t, true, pktMACEnv+"="+hostA.HardwareAddr.String(), pktSendEnv+"="+
			hjFake4+">"+hjGw4+":7002:forged;"+hjB4+">"+hjGw4+":7002:forged;"+hjA4+">"+hjGw4+":7002:own")
		if from, got := allowed.next(t); got != "own" || from.String() != hjA4 {
			t.Errorf("port 7002 first got %q from %s, want %q from %s: a forged frame passed", got, from, "own", hjA4)
		}
	}
	keeps(t)

	// hjc's veth comes: a link event, so a full rescan, which looks at
	// hja's namespaces with the attacker's there too.
	stop := startInCgroup(t, attackerCg, "unshare", "-n", "sleep", "infinity")
	hostC := fmt.Sprintf("e2ehjc%d", os.Getpid()%100000)
	ipCmd(t, "link", "add", hostC, "type", "veth", "peer", "name", "eth0", "netns", nsC)
	t.Cleanup(func() { exec.Command("ip", "link", "del", hostC).Run() })
	testenv.Eventually(t, waitTimeout, "hjc's interface found", func() (bool, string) {
		r, err := a.podInterface("default/hjc")
		return err == nil && r.Interface == hostC && !r.FailClosed && r.Status.Kind == "Done", fmt.Sprintf("%+v %v", r, err)
	})
	t.Run("unshare -n", keeps)
	t.Run("hjc no longer denied", func(t *testing.T) {
		testenv.Eventually(t, waitTimeout, "hjc connects", func() (bool, string) {
			got := connectFrom(t, cgC, hjHost, "")
			return strings.HasPrefix(got, "ok"), got
		})
	})
	stop()

	// A namespace of hja with a veth pair whose indexes are what hjb's
	// host veth and its peer have: from inside, its eth0's peer is hjb's
	// host veth. hjc's veth goes: another full rescan.
	crafted := fmt.Sprintf("apiary-e2e-hjx-%d", os.Getpid())
	ipCmd(t, "netns", "add", crafted)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", crafted).Run() })
	ipCmd(t, "-n", crafted, "link", "add", "name", "eth0", "index", strconv.Itoa(linkIndex(t, podB.netns, "eth0")),
		"type", "veth", "peer", "name", "x", "index", strconv.Itoa(hostB.Index))
	startInCgroup(t, attackerCg, "ip", "netns", "exec", crafted, "sleep", "infinity")
	ipCmd(t, "link", "del", hostC)
	var rowC podIfRow
	testenv.Eventually(t, waitTimeout, "hjc's interface gone", func() (bool, string) {
		rowC, err = a.podInterface("default/hjc")
		return err == nil && rowC.Ifindex == 0 && rowC.Error != "", fmt.Sprintf("%+v %v", rowC, err)
	})
	t.Run("crafted veth pair", keeps)
	if !rowC.FailClosed {
		t.Errorf("hjc without its interface again: %+v, want it failing closed", rowC)
	}
}
