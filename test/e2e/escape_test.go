package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Pods of TestPolicyNoWayAround, on node e2e-node.
const (
	uidEsc     = "0e0e0e0e-0000-4000-8000-00000000000e"
	uidLate    = "0f0f0f0f-0000-4000-8000-00000000000f"
	uidHost    = "0d0d0d0d-0000-4000-8000-00000000000d"
	uidStray   = "01010101-0000-4000-8000-000000000001"
	uidOffline = "02020202-0000-4000-8000-000000000002"
	ipEsc      = "127.0.1.61"
	// Peers: the policy allows v4Allowed and v6Allowed on port 8080.
	v4Allowed = "127.0.1.71"
	v4Denied  = "127.0.1.72"
	v6Allowed = "fd00:e2::71"
	v6Denied  = "fd00:e2::72"
)

const escapePods = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: esc, namespace: default, uid: ` + uidEsc + `, labels: {app: esc}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipEsc + `, podIPs: [{ip: ` + ipEsc + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: host, namespace: default, uid: ` + uidHost + `, labels: {app: esc}}
spec: {nodeName: e2e-node, hostNetwork: true, containers: [{name: c, image: busybox}]}
status: {phase: Running}
`

// latePod is a second pod of the workload whose IP the kubelet has not
// reported yet.
const latePod = `apiVersion: v1
kind: Pod
metadata: {name: late, namespace: default, uid: ` + uidLate + `, labels: {app: esc}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Pending}
`

// escapePolicy: app=esc may reach one IPv4 and one IPv6 address on 8080.
const escapePolicy = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: esc, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: esc}}
  egress:
  - toCIDR: [` + v4Allowed + `/32, "` + v6Allowed + `/128"]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`

// addLoopback6 puts IPv6 addresses on lo until the test ends.
func addLoopback6(t *testing.T, addrs ...string) {
	t.Helper()
	testenv.RequireProgram(t, "ip")
	for _, a := range addrs {
		if out, err := exec.Command("ip", "-6", "addr", "add", a+"/128", "dev", "lo", "nodad").CombinedOutput(); err != nil {
			t.Fatalf("ip -6 addr add %s: %v: %s", a, err, out)
		}
		t.Cleanup(func() { exec.Command("ip", "-6", "addr", "del", a+"/128", "dev", "lo").Run() })
	}
}

// TestPolicyNoWayAround: ways a process in a pod could get around its
// egress policy, each closed on the shipped binary: IPv6 (the same policy
// holds, an IPv6 CIDR allows), an IPv4 address written as ::ffff:a.b.c.d on
// a dual-stack socket (EPERM at once), a pod cgroup the agent has not
// classified (denied, also while the agent is down), a pod whose IP is not
// reported yet (enforced by its labels' identity from its first
// connection). A host-network pod, the host's, is not enforced.
func TestPolicyNoWayAround(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	addLoopback6(t, v6Allowed, v6Denied)
	root := testenv.Cgroup(t)
	mk := func(uid string) string {
		t.Helper()
		dir := filepath.Join(root, "kubepods", "besteffort", "pod"+uid, "ctr")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			for p := dir; p != root; p = filepath.Dir(p) {
				removeCgroup(p)
			}
		})
		return dir
	}
	cgEsc, cgHost, cgStray := mk(uidEsc), mk(uidHost), mk(uidStray)
	listen(t, v4Allowed+":8080", v4Denied+":8080", "["+v6Allowed+"]:8080", "["+v6Denied+"]:8080", "[::1]:8089")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), escapePods)
	writeFile(t, filepath.Join(configDir, "policy.yaml"), escapePolicy)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{"--node-name=e2e-node", "--cgroup-root=" + root}})
	a.waitEndpointPolicy(t, map[string]string{"default/esc": "off default-deny", "default/host": "off off"})

	check := func(t *testing.T, who, dir string, want map[string]string) {
		t.Helper()
		for addr, w := range want {
			got := connectFrom(t, dir, addr, "")
			if got != w && !(w == "ok" && strings.HasPrefix(got, "ok:")) {
				t.Errorf("%s to %s: %s, want %s", who, addr, got, w)
			}
		}
	}

	t.Run("IPv6 and IPv4-mapped addresses meet the same policy", func(t *testing.T) {
		check(t, "esc", cgEsc, map[string]string{
			v4Allowed + ":8080":               "ok",
			v4Denied + ":8080":                "EPERM",
			"[" + v6Allowed + "]:8080":        "ok",
			"[" + v6Denied + "]:8080":         "EPERM",
			"[::1]:8089":                      "EPERM",
			"[::ffff:" + v4Denied + "]:8080":  "EPERM",
			"[::ffff:" + v4Allowed + "]:8080": "ok",
		})
	})

	t.Run("a host-network pod is the host's", func(t *testing.T) {
		check(t, "the host-network pod", cgHost, map[string]string{v4Denied + ":8080": "ok", "[" + v6Denied + "]:8080": "ok"})
	})

	t.Run("an unclassified pod cgroup is denied", func(t *testing.T) {
		check(t, "a pod cgroup no Pod names", cgStray, map[string]string{v4Allowed + ":8080": "EPERM", "[" + v6Allowed + "]:8080": "EPERM"})
		// Outside the kubelet's tree, nothing changes.
		check(t, "a process outside the pods", root, map[string]string{v4Denied + ":8080": "ok"})
		out, err := a.bpf("policy", "list")
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out, "pod tree cgroup") {
			t.Errorf("apiary bpf policy list shows no pod tree:\n%s", out)
		}
	})

	t.Run("a pod without an IP yet is enforced from its first connection", func(t *testing.T) {
		cgLate := mk(uidLate)
		// Unclassified until the agent knows it: denied, not open.
		check(t, "the new pod", cgLate, map[string]string{v4Allowed + ":8080": "EPERM"})
		writeFile(t, filepath.Join(configDir, "late.yaml"), latePod)
		a.waitEndpointPolicy(t, map[string]string{"default/late": "off default-deny"})
		check(t, "the new pod", cgLate, map[string]string{v4Allowed + ":8080": "ok", v4Denied + ":8080": "EPERM"})
	})

	t.Run("a pod started while the agent is down waits for it", func(t *testing.T) {
		a.stop(t)
		cgOffline := mk(uidOffline)
		check(t, "a pod started while the agent is down", cgOffline, map[string]string{v4Allowed + ":8080": "EPERM"})
		check(t, "esc while the agent is down", cgEsc, map[string]string{v4Allowed + ":8080": "ok", v4Denied + ":8080": "EPERM"})
		writeFile(t, filepath.Join(configDir, "offline.yaml"), strings.ReplaceAll(strings.ReplaceAll(latePod,
			uidLate, uidOffline), "name: late", "name: offline"))
		a.start(t)
		a.waitEndpointPolicy(t, map[string]string{"default/offline": "off default-deny"})
		check(t, "the pod once the agent is back", cgOffline, map[string]string{v4Allowed + ":8080": "ok", v4Denied + ":8080": "EPERM"})
	})
}
