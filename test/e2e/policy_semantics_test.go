package e2e

// The reference's policy semantics where apiary used to depart from it in
// ways that opened what should be closed (issue 24), and --allow-localhost,
// on the shipped binary: pods of two namespaces in cgroups, the node as an
// address of its own (--node-ips), real connections.

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Pods of this test, apart from the other tests' (own UIDs and addresses).
const (
	uidWeb    = "5a5a5a5a-0000-4000-8000-00000000005a"
	uidClient = "5b5b5b5b-0000-4000-8000-00000000005b"
	uidServer = "5c5c5c5c-0000-4000-8000-00000000005c"
	ipWeb     = "127.0.5.1"
	ipClient  = "127.0.5.2"
	ipServer  = "127.0.5.3"
	ipNode    = "127.0.5.100" // the node's own address: reserved:host
)

const semanticsPods = `apiVersion: v1
kind: Namespace
metadata: {name: alpha}
---
apiVersion: v1
kind: Namespace
metadata: {name: beta}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: alpha, uid: ` + uidWeb + `, labels: {app: web}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipWeb + `, podIPs: [{ip: ` + ipWeb + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: beta, uid: ` + uidClient + `, labels: {app: client}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipClient + `, podIPs: [{ip: ` + ipClient + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: beta, uid: ` + uidServer + `, labels: {app: server}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipServer + `, podIPs: [{ip: ` + ipServer + `}]}
`

// A policy of namespace beta that names alpha in its endpointSelector: it
// must not select alpha/web (class 1).
const crossNamespace = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: deny-alpha-web, namespace: beta}
spec:
  endpointSelector: {matchLabels: {app: web, io.kubernetes.pod.namespace: alpha}}
  ingress: [{}]
`

// beta/server accepts beta/client only.
const serverIngress = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: server, namespace: beta}
spec:
  endpointSelector: {matchLabels: {app: server}}
  ingress: [{fromEndpoints: [{matchLabels: {app: client}}]}]
`

// beta/client may reach the node (a reserved: peer gets no namespace,
// class 3); the rule with an empty peer list allows nothing (class 5).
const clientEgress = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: client, namespace: beta}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toEndpoints: [{matchLabels: {"reserved:host": ""}}]
  - toEndpoints: []
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`

// The node may not reach beta/server: an explicit deny wins over
// --allow-localhost=always (class 3 and 8).
const denyHost = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: deny-host, namespace: beta}
spec:
  endpointSelector: {matchLabels: {app: server}}
  ingressDeny: [{fromEndpoints: [{matchLabels: {"reserved:host": ""}}]}]
`

// TestPolicySemantics: the binary closes what the reference closes — a
// namespaced policy cannot reach into another namespace, an empty peer
// list allows nothing, a reserved:host peer of a namespaced policy is the
// node (so its deny denies) — and lets the node reach its pods under
// --allow-localhost=always but not =policy.
func TestPolicySemantics(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	var cgWeb, cgClient, cgServer string
	for _, c := range []struct {
		dir *string
		uid string
	}{{&cgWeb, uidWeb}, {&cgClient, uidClient}, {&cgServer, uidServer}} {
		*c.dir = filepath.Join(root, "kubepods", "pod"+c.uid, "ctr")
		if err := os.MkdirAll(*c.dir, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			for p := *c.dir; p != root; p = filepath.Dir(p) {
				removeCgroup(p)
			}
		})
	}
	listen(t, ipNode+":7000") // a server of the node
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), semanticsPods)
	writeFile(t, filepath.Join(configDir, "cross-namespace.yaml"), crossNamespace)
	writeFile(t, filepath.Join(configDir, "server.yaml"), serverIngress)
	flags := []string{"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + ipNode}
	a := startAgent(t, agentOptions{configDir: configDir, flags: flags})
	serveIn(t, cgWeb, ipWeb+":8080")
	serveIn(t, cgServer, ipServer+":9090")

	expect := func(t *testing.T, what, from, addr, bind, want string) {
		t.Helper()
		got := connectFrom(t, from, addr, bind)
		if got != want && !(want == "ok" && strings.HasPrefix(got, "ok:")) {
			t.Errorf("%s: %s, want %s", what, got, want)
		}
	}

	t.Run("a namespaced policy does not select another namespace's pods", func(t *testing.T) {
		a.waitEndpointPolicy(t, map[string]string{
			"alpha/web": "off off", "beta/server": "default-deny off", "beta/client": "off off",
		})
		expect(t, "beta/client to alpha/web", cgClient, ipWeb+":8080", ipClient, "ok")
		expect(t, "beta/client to beta/server", cgClient, ipServer+":9090", ipClient, "ok")
	})

	t.Run("allow-localhost=always: the node reaches a default-deny pod", func(t *testing.T) {
		expect(t, "the node to beta/server", root, ipServer+":9090", ipNode, "ok")
		expect(t, "alpha/web to beta/server", cgWeb, ipServer+":9090", ipWeb, "timeout")
	})

	t.Run("reserved:host peers are the node; an empty peer list allows nothing", func(t *testing.T) {
		writeFile(t, filepath.Join(configDir, "client.yaml"), clientEgress)
		a.waitEndpointPolicy(t, map[string]string{"beta/client": "off default-deny"})
		expect(t, "beta/client to the node", cgClient, ipNode+":7000", "", "ok")
		expect(t, "beta/client to alpha/web:8080 (toEndpoints: [])", cgClient, ipWeb+":8080", ipClient, "EPERM")
	})

	t.Run("a deny of reserved:host wins over allow-localhost", func(t *testing.T) {
		writeFile(t, filepath.Join(configDir, "deny-host.yaml"), denyHost)
		testenv.Eventually(t, waitTimeout, "the node denied", func() (bool, string) {
			got := connectFrom(t, root, ipServer+":9090", ipNode)
			return got == "timeout", got
		})
		os.Remove(filepath.Join(configDir, "deny-host.yaml"))
		testenv.Eventually(t, waitTimeout, "the node allowed again", func() (bool, string) {
			got := connectFrom(t, root, ipServer+":9090", ipNode)
			return strings.HasPrefix(got, "ok"), got
		})
	})

	t.Run("allow-localhost=policy: the node is a peer like any other", func(t *testing.T) {
		os.Remove(filepath.Join(configDir, "client.yaml"))
		a.restart(t, append(flags, "--allow-localhost=policy")...)
		a.waitEndpointPolicy(t, map[string]string{"beta/server": "default-deny off", "beta/client": "off off"})
		testenv.Eventually(t, waitTimeout, "the node denied by default", func() (bool, string) {
			got := connectFrom(t, root, ipServer+":9090", ipNode)
			return got == "timeout", got
		})
		expect(t, "beta/client to beta/server", cgClient, ipServer+":9090", ipClient, "ok")
	})
}
