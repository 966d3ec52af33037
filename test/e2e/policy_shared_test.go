package e2e

// Policy sets (issue 41) on the shipped binary: two namespaces' policies
// with the same wide egress rule share one set of entries; connections
// are judged as without it and verdicts name each pod's own policy.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// Pods of this test, apart from the other tests' (own UIDs and addresses).
const (
	uidSharedA      = "6a6a6a6a-0000-4000-8000-00000000006a"
	uidSharedB      = "6b6b6b6b-0000-4000-8000-00000000006b"
	uidSharedServer = "6c6c6c6c-0000-4000-8000-00000000006c"
	ipSharedA       = "127.0.6.1"
	ipSharedB       = "127.0.6.2"
	ipSharedServer  = "127.0.6.3"
)

const sharedPods = `apiVersion: v1
kind: Namespace
metadata: {name: alpha}
---
apiVersion: v1
kind: Namespace
metadata: {name: beta}
---
apiVersion: v1
kind: Namespace
metadata: {name: gamma}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: alpha, uid: ` + uidSharedA + `, labels: {app: a}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipSharedA + `, podIPs: [{ip: ` + ipSharedA + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: beta, uid: ` + uidSharedB + `, labels: {app: b}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipSharedB + `, podIPs: [{ip: ` + ipSharedB + `}]}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: gamma, uid: ` + uidSharedServer + `, labels: {app: server}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipSharedServer + `, podIPs: [{ip: ` + ipSharedServer + `}]}
`

// wideEgress is a policy of namespace ns: its pods may reach every pod of
// every namespace on TCP 8080, nothing else.
func wideEgress(ns string) string {
	return `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: wide, namespace: ` + ns + `}
spec:
  endpointSelector: {}
  egress:
  - toEndpoints: [{matchExpressions: [{key: io.kubernetes.pod.namespace, operator: Exists}]}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`
}

// TestPolicySharedSets: with --policy-share-min-identities=2 the rule
// "every pod on TCP 8080" of alpha's and beta's policies (3 pod
// identities) becomes one policy set both pods refer to; each pod reaches
// the server on 8080 and not on 9090, its verdicts name its own
// namespace's policy, and the set goes with the last policy using it.
func TestPolicySharedSets(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	var cgA, cgB, cgServer string
	for _, c := range []struct {
		dir *string
		uid string
	}{{&cgA, uidSharedA}, {&cgB, uidSharedB}, {&cgServer, uidSharedServer}} {
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
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), sharedPods)
	writeFile(t, filepath.Join(configDir, "wide-alpha.yaml"), wideEgress("alpha"))
	writeFile(t, filepath.Join(configDir, "wide-beta.yaml"), wideEgress("beta"))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--policy-share-min-identities=2"}})
	serveIn(t, cgServer, ipSharedServer+":8080")
	serveIn(t, cgServer, ipSharedServer+":9090")
	a.waitEndpointPolicy(t, map[string]string{"alpha/a": "off default-deny", "beta/b": "off default-deny"})

	sets := func() []endpointPolicyRow {
		var rows, out []endpointPolicyRow
		if err := a.dump("endpoint-policy", &rows); err != nil {
			t.Fatal(err)
		}
		for _, r := range rows {
			if strings.HasPrefix(r.Name, "policy-set:") {
				out = append(out, r)
			}
		}
		return out
	}
	testenv.Eventually(t, waitTimeout, "one policy set of the 3 pod identities", func() (bool, string) {
		s := sets()
		return len(s) == 1 && s[0].Entries == 3 && s[0].Status.Kind == "Done", strings.TrimSpace(fmtRows(s))
	})
	list, err := a.bpf("policy", "list")
	if err != nil || strings.Count(list, "egress shares policy set") != 2 {
		t.Fatalf("bpf policy list: %v\n%s\nwant two endpoints sharing a set", err, list)
	}

	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+a.addr)
	type verdict struct{ Endpoint, Dst, Verdict, Policy string }
	seen := func(endpoint, dst string) (verdict, bool) {
		for line := range strings.Lines(mon.log.String()) {
			var v verdict
			if json.Unmarshal([]byte(line), &v) == nil && v.Endpoint == endpoint && v.Dst == dst && v.Verdict == "allowed" {
				return v, true
			}
		}
		return verdict{}, false
	}
	for _, c := range []struct{ endpoint, cgroup, policy string }{
		{"alpha/a", cgA, "cnp/alpha/wide"}, {"beta/b", cgB, "cnp/beta/wide"},
	} {
		if got := connectFrom(t, c.cgroup, ipSharedServer+":9090", ""); got != "EPERM" {
			t.Errorf("%s to the server's 9090: %s, want EPERM", c.endpoint, got)
		}
		var v verdict
		testenv.Eventually(t, waitTimeout, "apiary monitor names the policy of "+c.endpoint, func() (bool, string) {
			if got := connectFrom(t, c.cgroup, ipSharedServer+":8080", ""); !strings.HasPrefix(got, "ok") {
				t.Fatalf("%s to the server's 8080: %s, want ok", c.endpoint, got)
			}
			var ok bool
			v, ok = seen(c.endpoint, ipSharedServer+":8080")
			return ok, mon.log.Tail(5)
		})
		if v.Policy != c.policy {
			t.Errorf("verdict of %s to the server's 8080: %+v, want policy %s", c.endpoint, v, c.policy)
		}
	}

	// One policy goes: the other pod keeps the set; both go: so does it.
	os.Remove(filepath.Join(configDir, "wide-alpha.yaml"))
	a.waitEndpointPolicy(t, map[string]string{"alpha/a": "off off", "beta/b": "off default-deny"})
	if got := connectFrom(t, cgB, ipSharedServer+":8080", ""); !strings.HasPrefix(got, "ok") {
		t.Errorf("beta/b to the server's 8080 after alpha's policy went: %s, want ok", got)
	}
	os.Remove(filepath.Join(configDir, "wide-beta.yaml"))
	a.waitEndpointPolicy(t, map[string]string{"alpha/a": "off off", "beta/b": "off off"})
	testenv.Eventually(t, waitTimeout, "no policy set and no entry left", func() (bool, string) {
		list, err := a.bpf("policy", "list")
		return len(sets()) == 0 && err == nil && !strings.Contains(list, "shares") && !strings.Contains(list, "(no cgroup)"), list
	})
}

// fmtRows says what the rows of the policy sets are.
func fmtRows(rows []endpointPolicyRow) string {
	var b strings.Builder
	for _, r := range rows {
		fmt.Fprintf(&b, "%s entries=%d %s %s\n", r.Name, r.Entries, r.Status.Kind, r.Status.Error)
	}
	return b.String()
}
