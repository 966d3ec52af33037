package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/podiface"
	"github.com/apiary-net/apiary/internal/testenv"
)

// Pods of TestCNIPlugin, made by the real ptp plugin (host-local IPAM):
// the gateway on the host side of each veth, one fixed address per pod.
const (
	uidCNIA   = "1d1d1d1d-0000-4000-8000-00000000001d"
	cniSubnet = "10.236.0.0/24"
	cniGw4    = "10.236.0.1"
	cniA4     = "10.236.0.11" // covered by apiary-cni
	cniB4     = "10.236.0.12" // ptp alone: the control
	cniC4     = "10.236.0.13" // the agent's pins missing
	cniFake4  = "10.236.0.99"
)

const cniPods = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: cna, namespace: default, uid: ` + uidCNIA + `, labels: {app: cna}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + cniA4 + `, podIPs: [{ip: ` + cniA4 + `}]}
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: cna, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: cna}}
  egress:
  - toEntities: [host]
    toPorts: [{ports: [{port: "7002", protocol: UDP}]}]
`

// cniPod is a pod's sandbox before its network exists: a network
// namespace with only lo, and a cgroup with a process in the namespace.
type cniPod struct {
	*ifPod
	id     string // the container ID the runtime gives CNI
	hostIf string // the host side of its veth, once added
}

func makeCNIPod(t *testing.T, root, uid, name string) *cniPod {
	t.Helper()
	p := &cniPod{ifPod: &ifPod{netns: fmt.Sprintf("apiary-e2e-%s-%d", name, os.Getpid())}, id: "e2e-" + name}
	ipCmd(t, "netns", "add", p.netns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", p.netns).Run() })
	ipCmd(t, "netns", "exec", p.netns, "ip", "link", "set", "lo", "up")
	p.cgroup = filepath.Join(root, "kubepods", "besteffort", "pod"+uid)
	if err := os.MkdirAll(p.cgroup, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for d := p.cgroup; d != root; d = filepath.Dir(d) {
			removeCgroup(d)
		}
	})
	sandbox := p.command(t, true, nil, "sleep", "infinity")
	if err := sandbox.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sandbox.Process.Kill(); sandbox.Wait() })
	return p
}

// cniNet runs a conflist's chain (the real ptp and host-local from
// containernetworking-plugins, apiary-cni when listed) through libcni, as
// a container runtime does.
type cniNet struct {
	cfg  *libcni.CNIConfig
	list *libcni.NetworkConfigList
}

// newCNINet is the chain ptp (addr from host-local), then apiary-cni with
// the netconf keys plugin, when not nil.
func newCNINet(t *testing.T, addr string, plugin map[string]any) *cniNet {
	t.Helper()
	ptp := testenv.RequireProgram(t, "ptp", "/usr/lib/cni", "/opt/cni/bin")
	testenv.RequireProgram(t, "host-local", filepath.Dir(ptp))
	plugins := []any{map[string]any{
		"type": "ptp",
		"ipam": map[string]any{
			"type":    "host-local",
			"ranges":  [][]map[string]string{{{"subnet": cniSubnet, "gateway": cniGw4, "rangeStart": addr, "rangeEnd": addr}}},
			"dataDir": filepath.Join(t.TempDir(), "ipam"),
		},
	}}
	if plugin != nil {
		plugin["type"] = "apiary-cni"
		plugins = append(plugins, plugin)
	}
	raw, err := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": "e2e-cni", "plugins": plugins})
	if err != nil {
		t.Fatal(err)
	}
	list, err := libcni.ConfListFromBytes(raw)
	if err != nil {
		t.Fatal(err)
	}
	cfg := libcni.NewCNIConfigWithCacheDir([]string{filepath.Dir(ptp), filepath.Dir(cniBin)}, t.TempDir(), nil)
	return &cniNet{cfg: cfg, list: list}
}

func (n *cniNet) rt(p *cniPod) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{ContainerID: p.id, NetNS: "/run/netns/" + p.netns, IfName: "eth0"}
}

// add runs ADD for p, and DEL when the test ends; it returns ADD's error.
func (n *cniNet) add(t *testing.T, p *cniPod) error {
	t.Helper()
	res, err := n.cfg.AddNetworkList(context.Background(), n.list, n.rt(p))
	t.Cleanup(func() { n.cfg.DelNetworkList(context.Background(), n.list, n.rt(p)) })
	if err != nil {
		return err
	}
	r, err := current.NewResultFromResult(res)
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range r.Interfaces {
		if i.Sandbox == "" {
			p.hostIf = i.Name
		}
	}
	if p.hostIf == "" {
		t.Fatalf("ptp's result names no host interface: %s", res)
	}
	return nil
}

func (n *cniNet) del(t *testing.T, p *cniPod) {
	t.Helper()
	if err := n.cfg.DelNetworkList(context.Background(), n.list, n.rt(p)); err != nil {
		t.Fatalf("CNI DEL of %s: %v", p.id, err)
	}
}

// ifaceDrops reads policy_iface_stats under pinDir: the packets dropped
// as spoofed, and the pods' packets their egress policy denied.
func ifaceDrops(t *testing.T, pinDir string) (spoofed, denied uint64) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, bpf.PolicyIfaceStatsMap), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	sum := func(idx uint32) uint64 {
		var perCPU []uint64
		if err := m.Lookup(idx, &perCPU); err != nil {
			t.Fatal(err)
		}
		var n uint64
		for _, v := range perCPU {
			n += v
		}
		return n
	}
	return sum(bpf.PolicyIfaceStatsSpoofed), sum(1*bpf.PolicyVerdicts + bpf.PolicyVerdictDenied)
}

// linkIDs returns the IDs of the links pinned for interface ifindex.
func linkIDs(t *testing.T, pinDir string, ifindex int) []link.ID {
	t.Helper()
	var ids []link.ID
	for _, prog := range podiface.Programs {
		l, err := link.LoadPinnedLink(podiface.LinkPin(pinDir, ifindex, prog), nil)
		if err != nil {
			t.Fatalf("the link of %s on interface %d: %v", prog, ifindex, err)
		}
		info, err := l.Info()
		l.Close()
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, info.ID)
	}
	return ids
}

// TestCNIPlugin: a pod made while the agent is down, through the real
// chain ptp + apiary-cni, is judged at its interface from its first frame:
// its packet socket's frames, with a forged source or its own, are
// dropped (and counted) while no agent runs, where the same frame of a
// pod made by ptp alone leaves. The agent, started with the Pod object,
// classifies the pod on the plugin's links (kept, not replaced), and its
// policy applies: the allowed frame passes, the forged one does not. CHECK
// passes; DEL removes the links and the entry, and again is no error.
// Without the agent's pins, ADD fails, unless the netconf says failOpen.
func TestCNIPlugin(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	root := testenv.Cgroup(t)
	configDir := t.TempDir()
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + cniGw4, "--allow-localhost=policy",
	}})
	testenv.Eventually(t, waitTimeout, "the agent pins the interface programs", func() (bool, string) {
		for _, prog := range podiface.Programs {
			if _, err := os.Stat(podiface.ProgramPin(a.pinDir, prog)); err != nil {
				return false, err.Error()
			}
		}
		return true, ""
	})
	a.stop(t)

	covered := makeCNIPod(t, root, uidCNIA, "cna")
	chain := newCNINet(t, cniA4, map[string]any{"bpfPinDir": a.pinDir})
	if err := chain.add(t, covered); err != nil {
		t.Fatalf("ADD through ptp and apiary-cni: %v", err)
	}
	bare := makeCNIPod(t, root, "1e1e1e1e-0000-4000-8000-00000000001e", "cnb")
	if err := newCNINet(t, cniB4, nil).add(t, bare); err != nil {
		t.Fatalf("ADD through ptp: %v", err)
	}
	allowed := listenUDP(t, cniGw4+":7002")
	mac := func(p *cniPod) string {
		ifc, err := net.InterfaceByName(p.hostIf)
		if err != nil {
			t.Fatal(err)
		}
		return ifc.HardwareAddr.String()
	}
	hostA, err := net.InterfaceByName(covered.hostIf)
	if err != nil {
		t.Fatal(err)
	}

	t.Run("CHECK", func(t *testing.T) {
		if err := chain.cfg.CheckNetworkList(context.Background(), chain.list, chain.rt(covered)); err != nil {
			t.Fatalf("CHECK: %v", err)
		}
	})

	t.Run("agent down", func(t *testing.T) {
		// The control: ptp's veth alone lets the frame out.
		bare.run(t, true, pktMACEnv+"="+mac(bare), pktSendEnv+"="+cniB4+">"+cniGw4+":7002:bare")
		if from, got := allowed.next(t); got != "bare" || from.String() != cniB4 {
			t.Fatalf("port 7002 got %q from %s, want %q from %s", got, from, "bare", cniB4)
		}
		spoofed0, denied0 := ifaceDrops(t, a.pinDir)
		covered.run(t, true, pktMACEnv+"="+mac(covered), pktSendEnv+"="+
			cniFake4+">"+cniGw4+":7002:forged;"+cniA4+">"+cniGw4+":7002:own")
		// Both dropped by the program, which counts them as it drops.
		testenv.Eventually(t, waitTimeout, "the forged and the own frame dropped at the interface", func() (bool, string) {
			spoofed, denied := ifaceDrops(t, a.pinDir)
			return spoofed > spoofed0 && denied > denied0, fmt.Sprintf("spoofed %d→%d, denied %d→%d", spoofed0, spoofed, denied0, denied)
		})
		allowed.none(t, "a frame of a pod the agent has not classified")
	})

	links := linkIDs(t, a.pinDir, hostA.Index)
	writeFile(t, filepath.Join(configDir, "pods.yaml"), cniPods)
	a.start(t)
	a.waitPodInterfaces(t, map[string]string{"default/cna": covered.hostIf})

	t.Run("agent classifies", func(t *testing.T) {
		testenv.Eventually(t, waitTimeout, "the allowed frame passes, the forged one does not", func() (bool, string) {
			covered.run(t, true, pktMACEnv+"="+mac(covered), pktSendEnv+"="+
				cniFake4+">"+cniGw4+":7002:forged;"+cniA4+">"+cniGw4+":7002:own")
			allowed.conn.SetReadDeadline(time.Now().Add(time.Second))
			buf := make([]byte, 1500)
			n, from, err := allowed.conn.ReadFromUDPAddrPort(buf)
			if err != nil {
				return false, err.Error()
			}
			if got := string(buf[:n]); got != "own" || from.Addr().Unmap().String() != cniA4 {
				t.Fatalf("port 7002 got %q from %s first, want %q from %s", got, from, "own", cniA4)
			}
			return true, ""
		})
		if again := linkIDs(t, a.pinDir, hostA.Index); fmt.Sprint(again) != fmt.Sprint(links) {
			t.Errorf("the agent replaced the plugin's links %v with %v; it must keep them", links, again)
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(a.pinDir, bpf.PolicyIfacesMap), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		var v bpf.PolicyIfaceValue
		if err := m.Lookup(uint32(hostA.Index), &v); err != nil || v.CgroupID == 0 || podiface.Pending(v) {
			t.Fatalf("policy_ifaces[%d] = %+v (%v), want the pod's own entry", hostA.Index, v, err)
		}
		own := v

		// The plugin's pending entry written after the agent's (the two
		// raced on a new pod): the agent writes the pod's back.
		pending, err := podiface.PendingValue(nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Put(uint32(hostA.Index), pending); err != nil {
			t.Fatal(err)
		}
		testenv.Eventually(t, waitTimeout, "the agent writes the pod's entry over a pending one", func() (bool, string) {
			err := m.Lookup(uint32(hostA.Index), &v)
			return err == nil && v == own, fmt.Sprintf("%+v %v", v, err)
		})
	})

	t.Run("DEL", func(t *testing.T) {
		// Stopped, so that only the plugin can remove the pins.
		a.stop(t)
		chain.del(t, covered)
		pins, _ := filepath.Glob(filepath.Join(a.pinDir, podiface.LinksDir, strconv.Itoa(hostA.Index)+"_*"))
		if len(pins) != 0 {
			t.Errorf("after DEL, pins %v are left", pins)
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(a.pinDir, bpf.PolicyIfacesMap), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		var v bpf.PolicyIfaceValue
		if err := m.Lookup(uint32(hostA.Index), &v); err == nil {
			t.Errorf("after DEL, policy_ifaces[%d] = %+v", hostA.Index, v)
		}
		chain.del(t, covered) // nothing there: no error
	})

	t.Run("no agent pins", func(t *testing.T) {
		empty := testenv.BPFPinDir(t)
		pod := makeCNIPod(t, root, "1f1f1f1f-0000-4000-8000-00000000001f", "cnc")
		closed := newCNINet(t, cniC4, map[string]any{"bpfPinDir": empty})
		err := closed.add(t, pod)
		if err == nil || !strings.Contains(err.Error(), "failOpen") {
			t.Fatalf("ADD without the agent's pins: %v, want an error naming failOpen", err)
		}
		// As the runtime does after a failed ADD.
		closed.del(t, pod)
		if err := newCNINet(t, cniC4, map[string]any{"bpfPinDir": empty, "failOpen": true}).add(t, pod); err != nil {
			t.Fatalf("ADD with failOpen: %v", err)
		}
	})
}
