package e2e

// Kubernetes NetworkPolicy on the shipped binary (issue 26): pods of two
// namespaces in kubelet cgroups, NetworkPolicies in --config-dir, real
// connections between the pods and to servers outside the cluster.

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Pods and addresses of this test, apart from the other tests' (127.0.26.x).
const (
	uidNPWeb    = "26262626-0000-4000-8000-000000000001"
	uidNPOther  = "26262626-0000-4000-8000-000000000002"
	uidNPClient = "26262626-0000-4000-8000-000000000003"
	uidNPServer = "26262626-0000-4000-8000-000000000004"
	ipNPWeb     = "127.0.26.1"
	ipNPOther   = "127.0.26.2"
	ipNPClient  = "127.0.26.3"
	ipNPServer  = "127.0.26.4"
	// Outside the cluster: 127.0.26.100 inside the ipBlock, .105 in its
	// except.
	ipNPOutside = "127.0.26.100"
	ipNPExcept  = "127.0.26.105"
	ipNPNode    = "127.0.26.200"
)

// alpha (env=dev): web, other; beta (env=prod, no kubernetes.io/metadata.name
// label: the agent adds it): client, server, whose container port "http"
// is 9090.
const netpolPods = `apiVersion: v1
kind: Namespace
metadata: {name: np-alpha, labels: {env: dev}}
---
apiVersion: v1
kind: Namespace
metadata: {name: np-beta, labels: {env: prod}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: np-alpha, uid: ` + uidNPWeb + `, labels: {app: web}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipNPWeb + `, podIPs: [{ip: ` + ipNPWeb + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: other, namespace: np-alpha, uid: ` + uidNPOther + `, labels: {app: other}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipNPOther + `, podIPs: [{ip: ` + ipNPOther + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: np-beta, uid: ` + uidNPClient + `, labels: {app: client}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipNPClient + `, podIPs: [{ip: ` + ipNPClient + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: np-beta, uid: ` + uidNPServer + `, labels: {app: server}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox, ports: [{name: http, containerPort: 9090}]}]}
status: {phase: Running, podIP: ` + ipNPServer + `, podIPs: [{ip: ` + ipNPServer + `}]}
`

func npDoc(name, spec string) string {
	return "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: " + name + ", namespace: np-beta}\nspec:\n" + spec
}

// TestNetworkPolicy: NetworkPolicies from --config-dir enforced by the
// binary — default deny, peers ANDed in one entry and ORed across entries,
// a namespace by its kubernetes.io/metadata.name, a named port and an
// endPort range, an ipBlock with except (a pod's address inside the block
// is the block's, one inside an except is not), egress deny-all — named
// netpol/<ns>/<name> in the tables, /healthz and the monitor, and removing
// them restores traffic.
func TestNetworkPolicy(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	cg := map[string]string{}
	for name, uid := range map[string]string{"web": uidNPWeb, "other": uidNPOther, "client": uidNPClient, "server": uidNPServer} {
		cg[name] = filepath.Join(root, "kubepods", "pod"+uid, "ctr")
		if err := os.MkdirAll(cg[name], 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			for p := cg[name]; p != root; p = filepath.Dir(p) {
				removeCgroup(p)
			}
		})
	}
	listen(t, ipNPOutside+":7000", ipNPExcept+":7000")
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), netpolPods)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + ipNPNode,
	}})
	for _, port := range []string{"9090", "9091", "9093"} {
		serveIn(t, cg["server"], ipNPServer+":"+port)
	}
	serveIn(t, cg["web"], ipNPWeb+":9090")
	a.waitEndpointPolicy(t, map[string]string{"np-beta/server": "off off", "np-beta/client": "off off"})

	// A probe: a connection from a pod (its cgroup, its address) to addr.
	type probe struct{ from, addr, want string }
	// expect waits until every probe has its outcome, running them at once
	// (a denied ingress is a timeout of its own).
	expect := func(t *testing.T, what string, probes ...probe) {
		t.Helper()
		ips := map[string]string{"web": ipNPWeb, "other": ipNPOther, "client": ipNPClient, "server": ipNPServer}
		testenv.Eventually(t, waitTimeout, what, func() (bool, string) {
			got := make([]string, len(probes))
			var wg sync.WaitGroup
			for i, p := range probes {
				wg.Go(func() {
					out, err := helperIn(t, cg[p.from], connectEnv+"="+p.addr, bindEnv+"="+ips[p.from]).Output()
					got[i] = strings.TrimSpace(string(out))
					if err != nil {
						got[i] = fmt.Sprintf("helper: %v", err)
					}
				})
			}
			wg.Wait()
			ok := true
			var report []string
			for i, p := range probes {
				good := got[i] == p.want || p.want == "ok" && strings.HasPrefix(got[i], "ok")
				ok = ok && good
				report = append(report, fmt.Sprintf("%s -> %s: %s (want %s)", p.from, p.addr, got[i], p.want))
			}
			return ok, strings.Join(report, "; ")
		})
	}
	server := func(port string) string { return ipNPServer + ":" + port }
	policy := func(name, spec string) { writeFile(t, filepath.Join(configDir, name+".yaml"), npDoc(name, spec)) }
	remove := func(names ...string) {
		for _, n := range names {
			if err := os.Remove(filepath.Join(configDir, n+".yaml")); err != nil {
				t.Fatal(err)
			}
		}
	}

	expect(t, "open before any policy",
		probe{"client", server("9090"), "ok"}, probe{"web", server("9090"), "ok"}, probe{"client", ipNPOutside + ":7000", "ok"})

	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+a.addr)

	t.Run("default deny", func(t *testing.T) {
		policy("default-deny", "  podSelector: {}\n  policyTypes: [Ingress]\n")
		a.waitEndpointPolicy(t, map[string]string{"np-beta/server": "default-deny off", "np-beta/client": "default-deny off"})
		expect(t, "np-beta's pods closed to every pod", probe{"client", server("9090"), "timeout"}, probe{"web", server("9090"), "timeout"})
		testenv.Eventually(t, waitTimeout, "apiary monitor names no policy for the default deny", func() (bool, string) {
			for line := range strings.Lines(mon.log.String()) {
				var v struct{ Endpoint, Verdict, Reason string }
				if json.Unmarshal([]byte(line), &v) == nil && v.Endpoint == "np-beta/server" && v.Verdict == "denied" {
					return v.Reason == "default deny", line
				}
			}
			return false, mon.log.Tail(3)
		})
	})

	t.Run("peers: AND in one entry", func(t *testing.T) {
		policy("server", `  podSelector: {matchLabels: {app: server}}
  ingress:
  - from:
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: np-alpha}}
      podSelector: {matchLabels: {app: web}}
`)
		expect(t, "np-alpha/web only",
			probe{"web", server("9090"), "ok"}, probe{"other", server("9090"), "timeout"}, probe{"client", server("9090"), "timeout"})
	})

	t.Run("peers: OR across entries", func(t *testing.T) {
		policy("server", `  podSelector: {matchLabels: {app: server}}
  ingress:
  - from:
    - namespaceSelector: {matchLabels: {env: dev}}
    - podSelector: {matchLabels: {app: client}}
`)
		expect(t, "np-alpha's pods and np-beta/client",
			probe{"web", server("9090"), "ok"}, probe{"other", server("9090"), "ok"}, probe{"client", server("9090"), "ok"})
	})

	t.Run("named port and endPort", func(t *testing.T) {
		policy("server", `  podSelector: {matchLabels: {app: server}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: client}}}]
    ports: [{port: http}, {port: 9091, endPort: 9092, protocol: TCP}]
`)
		expect(t, "http (9090) and 9091-9092, not 9093",
			probe{"client", server("9090"), "ok"}, probe{"client", server("9091"), "ok"},
			probe{"client", server("9093"), "timeout"}, probe{"web", server("9090"), "timeout"})
	})

	t.Run("ipBlock with except", func(t *testing.T) {
		remove("default-deny", "server")
		policy("client-egress", `  podSelector: {matchLabels: {app: client}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 127.0.26.0/24, except: [127.0.26.104/29, `+ipNPWeb+`/32]}}]
`)
		a.waitEndpointPolicy(t, map[string]string{"np-beta/server": "off off", "np-beta/client": "off default-deny"})
		// A pod's address inside the block is the block's, as upstream's
		// suite expects; the web pod's is in an except.
		expect(t, "the block and the pods in it, not its excepts",
			probe{"client", ipNPOutside + ":7000", "ok"}, probe{"client", ipNPExcept + ":7000", "EPERM"},
			probe{"client", server("9090"), "ok"}, probe{"client", ipNPWeb + ":9090", "EPERM"})
		testenv.Eventually(t, waitTimeout, "apiary monitor names the policy that let the client reach the server pod", func() (bool, string) {
			for line := range strings.Lines(mon.log.String()) {
				var v struct{ Endpoint, Dst, Verdict, Policy, Reason string }
				if json.Unmarshal([]byte(line), &v) == nil && v.Endpoint == "np-beta/client" && v.Dst == server("9090") &&
					v.Verdict == "allowed" && v.Reason != "no policy" {
					return v.Policy == "netpol/np-beta/client-egress", line
				}
			}
			return false, mon.log.Tail(3)
		})
	})

	t.Run("egress deny-all", func(t *testing.T) {
		policy("client-egress", "  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n")
		expect(t, "nothing out",
			probe{"client", ipNPOutside + ":7000", "EPERM"}, probe{"client", server("9090"), "EPERM"},
			probe{"web", server("9090"), "ok"})
		testenv.Eventually(t, waitTimeout, "apiary monitor", func() (bool, string) {
			for line := range strings.Lines(mon.log.String()) {
				var v struct{ Endpoint, Direction, Verdict string }
				if json.Unmarshal([]byte(line), &v) == nil && v.Endpoint == "np-beta/client" && v.Direction == "egress" && v.Verdict == "denied" {
					return true, line
				}
			}
			return false, mon.log.Tail(3)
		})
	})

	t.Run("rows, counters, monitor and health name netpol/<ns>/<name>; an invalid one fails closed", func(t *testing.T) {
		policy("server", `  podSelector: {matchLabels: {app: server}}
  ingress: [{from: [{podSelector: {}}]}]
`)
		policy("client-egress", `  podSelector: {matchLabels: {app: client}}
  policyTypes: [Egress]
  egress: [{ports: [{port: 70000}]}]
`)
		// client's egress fails closed (its allow of every peer on a port
		// that cannot be is gone); server lets np-beta's pods in.
		expect(t, "client fails closed, server open to np-beta",
			probe{"client", ipNPOutside + ":7000", "EPERM"}, probe{"client", server("9090"), "EPERM"},
			probe{"web", server("9090"), "timeout"})
		testenv.Eventually(t, waitTimeout, "the rows", func() (bool, string) {
			var policies []struct {
				Name, Status, Error string
				FailClosed          bool
			}
			if err := a.dump("policies", &policies); err != nil {
				return false, err.Error()
			}
			var status []struct {
				Name     string
				Verdicts struct{ Allowed, Denied uint64 }
			}
			if err := a.dump("policy-status", &status); err != nil {
				return false, err.Error()
			}
			var names []string
			ok := true
			for _, p := range policies {
				names = append(names, p.Name)
				switch p.Name {
				case "netpol/np-beta/client-egress":
					ok = ok && p.Status == "Error" && p.FailClosed && strings.Contains(p.Error, "spec.egress[0].ports[0]: port: 70000")
				case "netpol/np-beta/server":
					ok = ok && p.Status == "OK"
				}
			}
			denied := false
			for _, s := range status {
				denied = denied || (s.Name == "netpol/np-beta/client-egress" && s.Verdicts.Denied > 0)
			}
			return ok && denied && slices.Equal(names, []string{"netpol/np-beta/client-egress", "netpol/np-beta/server"}),
				fmt.Sprintf("%+v %+v", policies, status)
		})
		testenv.Eventually(t, waitTimeout, "apiary monitor names the policy failing closed", func() (bool, string) {
			for line := range strings.Lines(mon.log.String()) {
				var v struct{ Endpoint, Verdict, Policy, Reason string }
				if json.Unmarshal([]byte(line), &v) == nil && v.Endpoint == "np-beta/client" && v.Policy == "netpol/np-beta/client-egress" &&
					v.Verdict == "denied" && v.Reason == "fail closed" {
					return true, ""
				}
			}
			return false, mon.log.Tail(3)
		})
		code, body, err := httpGet(a.url("/healthz"))
		if err != nil || code != http.StatusServiceUnavailable ||
			!strings.Contains(body, "failing closed on 1 invalid policies: netpol/np-beta/client-egress (np-beta/client)") {
			t.Errorf("/healthz: %d %v\n%s", code, err, body)
		}
	})

	t.Run("removal restores traffic", func(t *testing.T) {
		remove("server", "client-egress")
		a.waitEndpointPolicy(t, map[string]string{"np-beta/server": "off off", "np-beta/client": "off off"})
		expect(t, "open again",
			probe{"client", server("9090"), "ok"}, probe{"other", server("9093"), "ok"},
			probe{"client", ipNPOutside + ":7000", "ok"}, probe{"client", ipNPExcept + ":7000", "ok"})
		a.waitHealthy(t)
	})
}
