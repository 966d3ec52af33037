package e2e

// ClusterNetworkPolicy (policy.networking.k8s.io/v1beta1, issue 38) on the
// shipped binary: pods of two namespaces in kubelet cgroups, policies in
// --config-dir, real connections between the pods and to a server outside
// the cluster.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

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
// clusternetpol/<name>/<rule>; a policy apiary cannot enforce exactly (a
// domainNames peer in a Deny rule, which the API forbids) fails closed;
// removing the policies restores traffic. Then the tiers: Baseline Deny where no NetworkPolicy selects, a
// NetworkPolicy over it, Admin Accept over the NetworkPolicy's default
// deny, Admin Pass back to the NetworkPolicy.
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
		monitorSays(t, "cn-beta/server", "denied", "clusternetpol/tenant-isolation/not-from-tenant-a", "")
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
		monitorSays(t, "cn-beta/client", "denied", "clusternetpol/no-outside-7000/egress[0]", "")
	})

	t.Run("a policy apiary cannot enforce exactly fails closed", func(t *testing.T) {
		policy("accept", `  tier: Admin
  priority: 5
  subject: {pods: {namespaceSelector: {matchLabels: {tenant: b}}, podSelector: {matchLabels: {app: client}}}}
  egress: [{action: Deny, to: [{domainNames: [example.com]}]}]
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
					ok = ok && p.Status == "Error" && p.FailClosed && strings.Contains(p.Error, "spec.egress[0].to[0].domainNames: only Accept rules")
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

	// The tiers: the Baseline tier decides where no NetworkPolicy
	// selects, a NetworkPolicy overrides it, an Admin Accept overrides
	// the NetworkPolicy's default deny, an Admin Pass of higher
	// precedence hands the decision back to the NetworkPolicy.
	t.Run("baseline deny where no NetworkPolicy selects", func(t *testing.T) {
		policy("baseline", `  tier: Baseline
  priority: 10
  subject: {pods: {namespaceSelector: {matchLabels: {tenant: b}}, podSelector: {matchLabels: {app: server}}}}
  ingress: [{name: no-one, action: Deny, from: [{namespaces: {}}]}]
`)
		expect(t, "server closed to every pod",
			probe{"web", server("9090"), "timeout"}, probe{"client", server("9090"), "timeout"},
			probe{"client", ipCNOutside + ":7000", "ok"})
		monitorSays(t, "cn-beta/server", "denied", "clusternetpol/baseline/no-one", "")
	})

	t.Run("a NetworkPolicy overrides the Baseline tier", func(t *testing.T) {
		writeFile(t, filepath.Join(configDir, "np.yaml"), `apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: from-client, namespace: cn-beta}
spec:
  podSelector: {matchLabels: {app: server}}
  ingress: [{from: [{podSelector: {matchLabels: {app: client}}}]}]
`)
		expect(t, "client allowed by the NetworkPolicy, web by nothing",
			probe{"client", server("9090"), "ok"}, probe{"web", server("9090"), "timeout"})
		monitorSays(t, "cn-beta/server", "denied", "", "default deny")
	})

	t.Run("admin accept wins over the NetworkPolicy's deny", func(t *testing.T) {
		policy("accept-web", `  tier: Admin
  priority: 50
  subject: {namespaces: {matchLabels: {tenant: b}}}
  ingress: [{name: from-tenant-a, action: Accept, from: [{namespaces: {matchLabels: {tenant: a}}}]}]
`)
		expect(t, "web and client allowed",
			probe{"web", server("9090"), "ok"}, probe{"client", server("9090"), "ok"})
	})

	t.Run("admin pass hands over to the NetworkPolicy", func(t *testing.T) {
		policy("pass-web", `  tier: Admin
  priority: 40
  subject: {namespaces: {matchLabels: {tenant: b}}}
  ingress: [{name: tenant-a-decides-not, action: Pass, from: [{pods: {namespaceSelector: {matchLabels: {tenant: a}}, podSelector: {matchLabels: {app: web}}}}]}]
`)
		expect(t, "web denied by the NetworkPolicy again, client allowed",
			probe{"web", server("9090"), "timeout"}, probe{"client", server("9090"), "ok"})
		monitorSays(t, "cn-beta/server", "denied", "clusternetpol/pass-web/tenant-a-decides-not", "default deny")
		remove("pass-web", "accept-web", "baseline", "np")
		expect(t, "open again", probe{"web", server("9090"), "ok"})
	})
}

// Pods of TestClusterNetworkPolicyPacketLevel, each in a network namespace
// of its own (see makeIfPodVia).
const (
	uidCNPktA = "38383838-0000-4000-8000-00000000000a"
	uidCNPktB = "38383838-0000-4000-8000-00000000000b"
	cnPktGw4  = "10.238.0.1"
	cnPktA4   = "10.238.0.11"
	cnPktB4   = "10.238.0.12"
	cnPktGw6  = "fd00:e38::1"
	cnPktA6   = "fd00:e38::11"
	cnPktB6   = "fd00:e38::12"
)

const clusterNetpolPktPods = `apiVersion: v1
kind: Namespace
metadata: {name: cn-pkt, labels: {tenant: pkt}}
---
apiVersion: v1
kind: Pod
metadata: {name: cna, namespace: cn-pkt, uid: ` + uidCNPktA + `, labels: {app: cna}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + cnPktA4 + `, podIPs: [{ip: ` + cnPktA4 + `}, {ip: "` + cnPktA6 + `"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: cnb, namespace: cn-pkt, uid: ` + uidCNPktB + `, labels: {app: cnb}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + cnPktB4 + `, podIPs: [{ip: ` + cnPktB4 + `}, {ip: "` + cnPktB6 + `"}]}
`

// clusterNetpolPktPolicy: cna may not send UDP 7005 to cnb; cnb may not
// receive UDP 7003 from cna.
const clusterNetpolPktPolicy = `apiVersion: policy.networking.k8s.io/v1beta1
kind: ClusterNetworkPolicy
metadata: {name: pkt}
spec:
  tier: Admin
  priority: 1
  subject: {namespaces: {matchLabels: {tenant: pkt}}}
  egress:
  - name: no-7005-to-cnb
    action: Deny
    to: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: cnb}}}}]
    protocols: [{udp: {destinationPort: {number: 7005}}}]
  ingress:
  - name: no-7003-from-cna
    action: Deny
    from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: cna}}}}]
    protocols: [{udp: {destinationPort: {number: 7003}}}]
`

// TestClusterNetworkPolicyPacketLevel: an Admin Deny holds at the pods'
// interfaces, where no socket hook sees the packet: datagrams from a
// socket made in cna's network namespace but outside its cgroup to cnb,
// watched by a packet socket in cnb, which sees the one to an allowed
// port first: the one cna's egress rule denies was dropped at cna's
// interface, the one cnb's ingress rule denies at cnb's. The drops are
// interface verdicts naming the rules of clusternetpol/pkt. IPv4 only: pod-to-pod
// traffic goes through the host, which forwards IPv6 only where
// net.ipv6.conf.all.forwarding is set, and the test does not change it.
func TestClusterNetworkPolicyPacketLevel(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); err != nil || strings.TrimSpace(string(b)) != "1" {
		testenv.Skip(t, "the host does not forward IPv4 (net.ipv4.ip_forward), so pods cannot reach each other")
	}
	root := testenv.Cgroup(t)
	podA := makeIfPodVia(t, root, uidCNPktA, "cna", cnPktGw4, cnPktGw6, cnPktA4, cnPktA6)
	podB := makeIfPodVia(t, root, uidCNPktB, "cnb", cnPktGw4, cnPktGw6, cnPktB4, cnPktB6)
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), clusterNetpolPktPods)
	writeFile(t, filepath.Join(configDir, "policy.yaml"), clusterNetpolPktPolicy)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root,
		"--node-ips=" + cnPktGw4 + "," + cnPktGw6, "--enable-ipv6",
	}})
	a.waitPodInterfaces(t, map[string]string{"cn-pkt/cna": podA.hostIf, "cn-pkt/cnb": podB.hostIf})
	a.waitEndpointPolicy(t, map[string]string{"cn-pkt/cna": "default-allow default-allow", "cn-pkt/cnb": "default-allow default-allow"})
	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+a.addr)

	l := podB.command(t, true, []string{pktListenEnv + "=" + cnPktB4})
	stdout, err := l.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Process.Kill(); l.Wait() })
	lines := make(chan string, 16)
	go func() {
		s := bufio.NewScanner(stdout)
		for s.Scan() {
			lines <- s.Text()
		}
		close(lines)
	}()
	next := func() string {
		select {
		case line := <-lines:
			return line
		case <-time.After(waitTimeout):
			return "nothing within " + waitTimeout.String()
		}
	}
	if got := next(); got != "listening" {
		t.Fatalf("listener in pod cnb: %q", got)
	}
	// One datagram after the other on one path: the allowed one comes
	// first only if the denied ones were dropped.
	podA.run(t, false, udpSendEnv+"="+cnPktB4+":7005:egress-denied;"+cnPktB4+":7003:ingress-denied;"+cnPktB4+":7001:allowed")
	if got := next(); got != "udp 7001" {
		t.Errorf("pod cnb's packet socket first saw %q, want %q: a datagram an Admin Deny denies went through", got, "udp 7001")
	}
	testenv.Eventually(t, waitTimeout, "apiary monitor shows the interfaces' drops by clusternetpol/pkt", func() (bool, string) {
		var out, in bool
		for line := range strings.Lines(mon.log.String()) {
			var v struct{ Endpoint, Direction, Dst, Verdict, Policy, Layer string }
			if json.Unmarshal([]byte(line), &v) != nil || v.Layer != "interface" || v.Verdict != "denied" || !strings.HasPrefix(v.Policy, "clusternetpol/pkt/") {
				continue
			}
			if v.Policy != "clusternetpol/pkt/no-7005-to-cnb" && v.Policy != "clusternetpol/pkt/no-7003-from-cna" {
				continue
			}
			out = out || (v.Endpoint == "cn-pkt/cna" && v.Direction == "egress" && v.Dst == cnPktB4+":7005")
			in = in || (v.Endpoint == "cn-pkt/cnb" && v.Direction == "ingress" && v.Dst == cnPktB4+":7003")
		}
		return out && in, mon.log.Tail(10)
	})
}
