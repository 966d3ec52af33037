package e2e

// ClusterNetworkPolicy (policy.networking.k8s.io/v1beta1, issue 38) on the
// shipped binary: pods of two namespaces in kubelet cgroups, policies in
// --config-dir, real connections between the pods and to a server outside
// the cluster.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Pods and addresses of this test, apart from the other tests'.
const (
	uidCNWeb    = "38383838-0000-4000-8000-000000000001"
	uidCNClient = "38383838-0000-4000-8000-000000000002"
	uidCNServer = "38383838-0000-4000-8000-000000000003"
	ipCNWeb     = "127.0.38.1"
	ipCNClient  = "127.0.38.2"
	ipCNServer  = "127.0.38.3"
	ipCNOutside = "127.0.38.100"
	ipCNNode    = "127.0.38.200"
)

// cn-alpha (tenant=a): web; cn-beta (tenant=b): client, server, whose
// container port "http" is 9090.
const clusterNetpolPods = `apiVersion: v1
kind: Namespace
metadata: {name: cn-alpha, labels: {tenant: a}}
---
apiVersion: v1
kind: Namespace
metadata: {name: cn-beta, labels: {tenant: b}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: cn-alpha, uid: ` + uidCNWeb + `, labels: {app: web}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipCNWeb + `, podIPs: [{ip: ` + ipCNWeb + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: cn-beta, uid: ` + uidCNClient + `, labels: {app: client}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipCNClient + `, podIPs: [{ip: ` + ipCNClient + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: cn-beta, uid: ` + uidCNServer + `, labels: {app: server}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox, ports: [{name: http, containerPort: 9090}]}]}
status: {phase: Running, podIP: ` + ipCNServer + `, podIPs: [{ip: ` + ipCNServer + `}]}
`

func clusterNetpolDoc(name, spec string) string {
	return "apiVersion: policy.networking.k8s.io/v1beta1\nkind: ClusterNetworkPolicy\nmetadata: {name: " + name + "}\nspec:\n" + spec
}

// TestClusterNetworkPolicy: Admin-tier Deny rules from --config-dir win
// over a NetworkPolicy that allows the same traffic and leave the rest of
// the subject's traffic open (no default deny); ingress by namespace,
// egress by network and port, a named port; verdicts name
// clusternetpol/<name>; a policy apiary cannot enforce exactly (Accept)
// fails closed; removing the policies restores traffic.
func TestClusterNetworkPolicy(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	cg := map[string]string{}
	for name, uid := range map[string]string{"web": uidCNWeb, "client": uidCNClient, "server": uidCNServer} {
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
	listen(t, ipCNOutside+":7000", ipCNOutside+":7001")
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), clusterNetpolPods)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + ipCNNode,
	}})
	for _, port := range []string{"9090", "9091"} {
		serveIn(t, cg["server"], ipCNServer+":"+port)
	}
	a.waitEndpointPolicy(t, map[string]string{"cn-beta/server": "off off", "cn-beta/client": "off off"})

	type probe struct{ from, addr, want string }
	expect := func(t *testing.T, what string, probes ...probe) {
		t.Helper()
		ips := map[string]string{"web": ipCNWeb, "client": ipCNClient, "server": ipCNServer}
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
	server := func(port string) string { return ipCNServer + ":" + port }
	policy := func(name, spec string) {
		writeFile(t, filepath.Join(configDir, name+".yaml"), clusterNetpolDoc(name, spec))
	}
	remove := func(names ...string) {
		for _, n := range names {
			if err := os.Remove(filepath.Join(configDir, n+".yaml")); err != nil {
				t.Fatal(err)
			}
		}
	}
	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+a.addr)
	// monitorSays waits for a monitor line of endpoint with the verdict
	// and policy.
	monitorSays := func(t *testing.T, endpoint, verdict, policy, reason string) {
		t.Helper()
		testenv.Eventually(t, waitTimeout, "apiary monitor: "+endpoint+" "+verdict+" by "+policy, func() (bool, string) {
			for line := range strings.Lines(mon.log.String()) {
				var v struct{ Endpoint, Verdict, Policy, Reason string }
				if json.Unmarshal([]byte(line), &v) == nil && v.Endpoint == endpoint && v.Verdict == verdict &&
					v.Policy == policy && (reason == "" || v.Reason == reason) {
					return true, line
				}
			}
			return false, mon.log.Tail(3)
		})
	}

	expect(t, "open before any policy",
		probe{"client", server("9090"), "ok"}, probe{"web", server("9090"), "ok"}, probe{"client", ipCNOutside + ":7000", "ok"})

	t.Run("admin deny wins over a NetworkPolicy allow", func(t *testing.T) {
		writeFile(t, filepath.Join(configDir, "np.yaml"), `apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: allow-all, namespace: cn-beta}
spec:
  podSelector: {matchLabels: {app: server}}
  ingress: [{from: [{namespaceSelector: {}}]}]
`)
		policy("tenant-isolation", `  tier: Admin
  priority: 10
  subject: {namespaces: {matchLabels: {tenant: b}}}
  ingress:
  - name: not-from-tenant-a
    action: Deny
    from: [{namespaces: {matchLabels: {tenant: a}}}]
    protocols: [{destinationNamedPort: http}]
`)
		a.waitEndpointPolicy(t, map[string]string{"cn-beta/server": "default-deny off", "cn-beta/client": "default-allow off"})
		expect(t, "tenant a denied on http (9090) only; tenant b allowed",
			probe{"web", server("9090"), "timeout"}, probe{"web", server("9091"), "ok"},
			probe{"client", server("9090"), "ok"})
		monitorSays(t, "cn-beta/server", "denied", "clusternetpol/tenant-isolation", "")
	})

	t.Run("admin egress deny by network and port leaves the rest open", func(t *testing.T) {
		policy("no-outside-7000", `  tier: Admin
  priority: 20
  subject: {pods: {namespaceSelector: {matchLabels: {tenant: b}}, podSelector: {matchLabels: {app: client}}}}
  egress:
  - action: Deny
    to: [{networks: [`+ipCNOutside+`/32]}]
    protocols: [{tcp: {destinationPort: {number: 7000}}}]
`)
		a.waitEndpointPolicy(t, map[string]string{"cn-beta/client": "default-allow default-allow"})
		expect(t, "client: outside:7000 denied, outside:7001 and the server open",
			probe{"client", ipCNOutside + ":7000", "EPERM"}, probe{"client", ipCNOutside + ":7001", "ok"},
			probe{"client", server("9090"), "ok"})
		monitorSays(t, "cn-beta/client", "denied", "clusternetpol/no-outside-7000", "")
	})

	t.Run("a policy apiary cannot enforce exactly fails closed", func(t *testing.T) {
		policy("accept", `  tier: Admin
  priority: 5
  subject: {pods: {namespaceSelector: {matchLabels: {tenant: b}}, podSelector: {matchLabels: {app: client}}}}
  egress: [{action: Accept, to: [{namespaces: {}}]}]
`)
		expect(t, "client's egress closed",
			probe{"client", server("9090"), "EPERM"}, probe{"client", ipCNOutside + ":7001", "EPERM"})
		testenv.Eventually(t, waitTimeout, "the policies rows", func() (bool, string) {
			var policies []struct {
				Name, Status, Error string
				FailClosed          bool
			}
			if err := a.dump("policies", &policies); err != nil {
				return false, err.Error()
			}
			ok, n := true, 0
			for _, p := range policies {
				switch p.Name {
				case "clusternetpol/accept":
					n++
					ok = ok && p.Status == "Error" && p.FailClosed && strings.Contains(p.Error, "spec.egress[0].action: Accept is not implemented yet")
				case "clusternetpol/tenant-isolation", "clusternetpol/no-outside-7000":
					n++
					ok = ok && p.Status == "OK"
				}
			}
			return ok && n == 3, fmt.Sprintf("%+v", policies)
		})
		monitorSays(t, "cn-beta/client", "denied", "clusternetpol/accept", "fail closed")
	})

	t.Run("removal restores traffic", func(t *testing.T) {
		remove("accept", "no-outside-7000", "tenant-isolation", "np")
		a.waitEndpointPolicy(t, map[string]string{"cn-beta/server": "off off", "cn-beta/client": "off off"})
		expect(t, "open again",
			probe{"web", server("9090"), "ok"}, probe{"client", ipCNOutside + ":7000", "ok"})
		a.waitHealthy(t)
	})
}
