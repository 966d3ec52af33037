package e2e

// Fail closed, end to end: what the agent cannot implement denies the pod
// rather than opening it, and the tables, /healthz and the monitor say why.

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// egressFC lets client-a reach 127.0.1.171:8080 and nothing else.
const egressFC = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: egress-fc, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toCIDR: [127.0.1.171/32]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`

// egressFCHTTP is egressFC with an L7 http rule, which apiary does not
// implement: the policy is invalid.
const egressFCHTTP = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: egress-fc, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toCIDR: [127.0.1.171/32]
    toPorts:
    - ports: [{port: "8080", protocol: TCP}]
      rules:
        http: [{method: GET}]
`

// endpointPolicyJSON is an endpoint-policy row as `apiary db show -o json`
// gives it.
type endpointPolicyJSON struct {
	endpointPolicyRow
	FailClosedIngress []string `json:"failClosedIngress"`
	FailClosedEgress  []string `json:"failClosedEgress"`
	Reason            string   `json:"reason"`
}

// endpointPolicy returns the endpoint-policy row of the endpoint name.
func (a *agent) endpointPolicy(name string) (endpointPolicyJSON, error) {
	var rows []endpointPolicyJSON
	if err := a.showJSON("endpoint-policy", &rows); err != nil {
		return endpointPolicyJSON{}, err
	}
	for _, r := range rows {
		if r.Name == name {
			return r, nil
		}
	}
	return endpointPolicyJSON{}, fmt.Errorf("no endpoint-policy row %s in %+v", name, rows)
}

// TestPolicyFailClosed: an L7 http rule added to a pod's only egress policy
// makes the policy invalid, and the pod's egress stays denied, its allow
// gone too: the policy row, the endpoint-policy row, /healthz and the
// monitor's verdicts say which policy and why. Fixed, the allow is back.
// With --policy-invalid-mode=ignore the invalid policy is left out, as
// before fail closed: the pod's egress is open.
func TestPolicyFailClosed(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	cgA, _, _ := mkCgroups(t, root)
	listen(t, "127.0.1.171:8080", "127.0.1.172:8080")

	configDir := t.TempDir()
	policyFile := filepath.Join(configDir, "egress-fc.yaml")
	writeFile(t, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(t, policyFile, egressFC)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{"--node-name=e2e-node", "--cgroup-root=" + root}})
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny"})
	expect := func(t *testing.T, what string, want map[string]string) {
		t.Helper()
		testenv.Eventually(t, waitTimeout, what, func() (bool, string) {
			var got []string
			ok := true
			for _, addr := range slices.Sorted(func(yield func(string) bool) {
				for k := range want {
					if !yield(k) {
						return
					}
				}
			}) {
				out := connectFrom(t, cgA, addr, "")
				got = append(got, addr+" "+out)
				ok = ok && (out == want[addr] || want[addr] == "ok" && strings.HasPrefix(out, "ok:"))
			}
			return ok, strings.Join(got, ", ")
		})
	}
	expect(t, "the valid policy enforced", map[string]string{"127.0.1.171:8080": "ok", "127.0.1.172:8080": "EPERM"})

	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+a.addr)

	t.Run("deny", func(t *testing.T) {
		writeFile(t, policyFile, egressFCHTTP)
		const reason = "fail closed: cnp/default/egress-fc: egress[0].toPorts[0].rules.http: not supported"
		testenv.Eventually(t, waitTimeout, "client-a's row fails closed", func() (bool, string) {
			r, err := a.endpointPolicy("default/client-a")
			if err != nil {
				return false, err.Error()
			}
			return r.Reason == reason && r.Egress == "default-deny" && r.ID != 0 && r.Status.Kind == "Done" &&
				slices.Equal(r.FailClosedEgress, []string{"cnp/default/egress-fc"}), fmt.Sprintf("%+v", r)
		})
		// The allow is gone with the rest of the policy.
		expect(t, "egress denied", map[string]string{"127.0.1.171:8080": "EPERM", "127.0.1.172:8080": "EPERM"})

		var policies []struct {
			Name, Status, Error string
			FailClosed          bool
		}
		if err := a.dump("policies", &policies); err != nil {
			t.Fatal(err)
		}
		if len(policies) != 1 || policies[0].Status != "Error" || !policies[0].FailClosed ||
			!strings.Contains(policies[0].Error, "rules.http: not supported") {
			t.Errorf("policies: %+v", policies)
		}
		out, err := a.db("show", "policies")
		if err != nil || !strings.Contains(out, "Error (fail closed)") {
			t.Errorf("apiary db show policies: %v\n%s", err, out)
		}
		out, err = a.db("show", "endpoint-policy")
		if err != nil || !strings.Contains(out, reason) {
			t.Errorf("apiary db show endpoint-policy: %v\n%s", err, out)
		}

		code, body, err := httpGet(a.url("/healthz"))
		if err != nil || code != http.StatusServiceUnavailable ||
			!strings.Contains(body, "failing closed on 1 invalid policies: cnp/default/egress-fc (default/client-a)") {
			t.Errorf("/healthz: %d %v\n%s", code, err, body)
		}

		testenv.Eventually(t, waitTimeout, "apiary monitor shows the fail-closed verdict", func() (bool, string) {
			connectFrom(t, cgA, "127.0.1.171:8080", "")
			for line := range strings.Lines(mon.log.String()) {
				var v struct{ Endpoint, Dst, Verdict, Policy, Reason string }
				if json.Unmarshal([]byte(line), &v) == nil && v.Dst == "127.0.1.171:8080" && v.Verdict == "denied" {
					if v.Reason != "fail closed" || v.Policy != "cnp/default/egress-fc" || v.Endpoint != "default/client-a" {
						t.Fatalf("verdict %+v, want reason %q by cnp/default/egress-fc", v, "fail closed")
					}
					return true, ""
				}
			}
			return false, mon.log.Tail(5)
		})

		// Fixed: the allow is back, the reason and the degradation gone.
		writeFile(t, policyFile, egressFC)
		expect(t, "the fixed policy enforced", map[string]string{"127.0.1.171:8080": "ok", "127.0.1.172:8080": "EPERM"})
		a.waitHealthy(t)
		if r, err := a.endpointPolicy("default/client-a"); err != nil || r.Reason != "" || len(r.FailClosedEgress) != 0 {
			t.Errorf("after the fix: %+v %v", r, err)
		}
	})

	t.Run("ignore", func(t *testing.T) {
		a.stop(t)
		a.start(t, "--policy-invalid-mode=ignore")
		a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny"})
		writeFile(t, policyFile, egressFCHTTP)
		a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off off"})
		expect(t, "egress open", map[string]string{"127.0.1.171:8080": "ok", "127.0.1.172:8080": "ok"})
		if r, err := a.endpointPolicy("default/client-a"); err != nil || r.Reason != "" {
			t.Errorf("ignored: %+v %v", r, err)
		}
		code, body, err := httpGet(a.url("/healthz"))
		if err != nil || code != http.StatusServiceUnavailable || !strings.Contains(body, "ignored (--policy-invalid-mode=ignore): cnp/default/egress-fc") {
			t.Errorf("/healthz: %d %v\n%s", code, err, body)
		}
		// The next test steps (none) would need a healthy agent.
		os.Remove(policyFile)
	})
}

// Pods of TestEndpointConflicts: dup holds 127.0.1.181; friend, created
// later, claims it too; the bad ones have UIDs that cannot name a cgroup
// (a space, '_', "../").
const (
	uidDup    = "0d0d0d0d-0000-4000-8000-00000000000d"
	uidFriend = "0f0f0f0f-0000-4000-8000-00000000000f"
	ipDup     = "127.0.1.181"
)

const conflictPods = `apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata: {name: dup, namespace: default, uid: ` + uidDup + `, creationTimestamp: "2026-11-25T10:00:00Z", labels: {app: dup}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipDup + `}
---
apiVersion: v1
kind: Pod
metadata: {name: friend, namespace: default, uid: ` + uidFriend + `, creationTimestamp: "2026-11-25T10:05:00Z", labels: {app: friend}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + ipDup + `}
---
apiVersion: v1
kind: Pod
metadata: {name: bad-space, namespace: default, uid: "a b", labels: {app: dup}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: 127.0.1.182}
---
apiVersion: v1
kind: Pod
metadata: {name: bad-underscore, namespace: default, uid: "0b0b0b0b_0000", labels: {app: dup}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: 127.0.1.183}
---
apiVersion: v1
kind: Pod
metadata: {name: bad-dots, namespace: default, uid: "../pod` + uidDup + `", labels: {app: dup}}
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: 127.0.1.184}
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: dup-egress, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: dup}}
  egress:
  - toCIDR: [127.0.1.185/32]
`

// TestEndpointConflicts: a second pod claiming a pod's address is an error
// on both endpoints and in /healthz, never a merged identity: the address
// keeps the first pod's own labels, and that pod stays enforced. Pods whose
// UID cannot name a cgroup are shown not enforced, with the reason, never
// "Done" with ID 0.
func TestEndpointConflicts(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	root := testenv.Cgroup(t)
	cgDup := filepath.Join(root, "kubepods", "pod"+uidDup, "ctr")
	cgFriend := filepath.Join(root, "kubepods", "pod"+uidFriend, "ctr")
	for _, d := range []string{cgDup, cgFriend} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			for p := d; p != root; p = filepath.Dir(p) {
				removeCgroup(p)
			}
		})
	}
	listen(t, "127.0.1.185:8080", "127.0.1.186:8080")

	configDir := t.TempDir()
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{"--node-name=e2e-node", "--cgroup-root=" + root}})
	writeFile(t, filepath.Join(configDir, "pods.yaml"), conflictPods)

	type endpointRow struct {
		Name, Error, CgroupError string
		Identity                 uint32
		Labels                   []string
	}
	endpoints := map[string]endpointRow{}
	testenv.Eventually(t, waitTimeout, "both claimants' rows say so", func() (bool, string) {
		var rows []endpointRow
		if err := a.showJSON("endpoints", &rows); err != nil {
			return false, err.Error()
		}
		clear(endpoints)
		for _, r := range rows {
			endpoints[r.Name] = r
		}
		return endpoints["default/dup"].Error == "address "+ipDup+" is claimed by pod default/friend too (it stays this pod's)" &&
			endpoints["default/friend"].Error == "address "+ipDup+" belongs to pod default/dup, which claimed it first (not this pod's)" &&
			endpoints["default/dup"].Identity != 0, fmt.Sprintf("%+v", rows)
	})

	// The address resolves to dup's own identity: app=dup, not app=friend
	// merged in. The row has its identity before the ipcache reconciler
	// has written the map: wait for the map.
	testenv.Eventually(t, waitTimeout, "the ipcache map has dup's identity for its address", func() (bool, string) {
		ids, err := a.ipcacheMap()
		if err != nil {
			return false, err.Error()
		}
		id := ids[ipDup+"/32"]
		return id == endpoints["default/dup"].Identity, fmt.Sprintf("ipcache map: %s has identity %d, dup's is %d", ipDup, id, endpoints["default/dup"].Identity)
	})
	var identities []struct {
		ID     uint32
		Labels []string
	}
	if err := a.showJSON("identities", &identities); err != nil {
		t.Fatal(err)
	}
	for _, id := range identities {
		if id.ID == endpoints["default/dup"].Identity {
			if !slices.Contains(id.Labels, "k8s:app=dup") || slices.Contains(id.Labels, "k8s:app=friend") {
				t.Errorf("dup's identity %d has labels %q", id.ID, id.Labels)
			}
		}
		if slices.Contains(id.Labels, "k8s:app=dup") && slices.Contains(id.Labels, "k8s:app=friend") {
			t.Errorf("a merged identity: %+v", id)
		}
	}

	code, body, err := httpGet(a.url("/healthz"))
	if err != nil || code != http.StatusServiceUnavailable ||
		!strings.Contains(body, "1 addresses claimed by several pods, the first keeps each: "+ipDup+" (default/dup, default/friend)") ||
		!strings.Contains(body, "3 pods not enforced, their UID cannot name a cgroup: default/bad-dots, default/bad-space, default/bad-underscore") {
		t.Errorf("/healthz: %d %v\n%s", code, err, body)
	}

	// dup is still enforced: its policy denies what it does not allow.
	testenv.Eventually(t, waitTimeout, "dup enforced", func() (bool, string) {
		r, err := a.endpointPolicy("default/dup")
		if err != nil {
			return false, err.Error()
		}
		return r.ID != 0 && r.Egress == "default-deny" && r.Status.Kind == "Done" && r.Reason == "", fmt.Sprintf("%+v", r)
	})
	testenv.Eventually(t, waitTimeout, "dup's egress", func() (bool, string) {
		allowed, denied := connectFrom(t, cgDup, "127.0.1.185:8080", ""), connectFrom(t, cgDup, "127.0.1.186:8080", "")
		return strings.HasPrefix(allowed, "ok") && denied == "EPERM", allowed + ", " + denied
	})

	// The bad UIDs: not enforced, with the reason, in both tables.
	var epRows []endpointPolicyJSON
	if err := a.showJSON("endpoint-policy", &epRows); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"default/bad-space", "default/bad-underscore", "default/bad-dots"} {
		i := slices.IndexFunc(epRows, func(r endpointPolicyJSON) bool { return r.Name == name })
		if i < 0 {
			t.Errorf("no endpoint-policy row %s", name)
			continue
		}
		r := epRows[i]
		if r.ID != 0 || r.Cgroup != "" || !strings.HasPrefix(r.Reason, "not enforced: UID ") ||
			!strings.Contains(r.Reason, "cannot name a kubelet cgroup") || r.Egress != "default-deny" {
			t.Errorf("%s: %+v", name, r)
		}
		if e := endpoints[name]; !strings.Contains(e.CgroupError, "cannot name a kubelet cgroup") {
			t.Errorf("%s endpoints row: %+v", name, e)
		}
	}
	out, err := a.db("show", "endpoint-policy")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(out) {
		if strings.HasPrefix(line, "default/bad-") && (!strings.Contains(line, "Not enforced") || strings.Contains(line, "Done")) {
			t.Errorf("apiary db show endpoint-policy: %q", line)
		}
	}
}
