package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// tableState is an entry of /statedb/tables.
type tableState struct {
	Name        string   `json:"name"`
	Initialized bool     `json:"initialized"`
	Pending     []string `json:"pending"`
}

// waitInitialized waits until the process's tables called names are
// initialized, which is when their reconcilers start pruning what an earlier
// run left behind.
func waitInitialized(t *testing.T, a *apiaryProc, names ...string) {
	t.Helper()
	testenv.Eventually(t, wait, fmt.Sprintf("%s: tables %v initialized", a.name, names), func() (bool, string) {
		var all []tableState
		if err := httpGetJSON("http://"+a.addr+"/statedb/tables", &all); err != nil {
			return false, err.Error()
		}
		var b strings.Builder
		ok := true
		for _, name := range names {
			i := slices.IndexFunc(all, func(s tableState) bool { return s.Name == name })
			if i < 0 {
				ok = false
				fmt.Fprintf(&b, "  %s: no such table\n", name)
				continue
			}
			ok = ok && all[i].Initialized
			fmt.Fprintf(&b, "  %s: initialized=%v pending=%v\n", name, all[i].Initialized, all[i].Pending)
		}
		return ok, b.String()
	})
}

// prefixOwners returns the owners the process's prefixes table has for p.
func (a *apiaryProc) prefixOwners(p netip.Prefix) ([]string, error) {
	var dump map[string][]tables.PrefixLabels
	if err := httpGetJSON("http://"+a.addr+"/statedb/dump/"+tables.PrefixesTableName, &dump); err != nil {
		return nil, err
	}
	var owners []string
	for _, row := range dump[tables.PrefixesTableName] {
		if row.Prefix == p {
			owners = append(owners, row.Owner)
		}
	}
	return owners, nil
}

// ipcacheEntry returns the process's ipcache row of p, if any.
func (a *apiaryProc) ipcacheEntry(p netip.Prefix) (*tables.IPCacheEntry, error) {
	var dump map[string][]tables.IPCacheEntry
	if err := httpGetJSON("http://"+a.addr+"/statedb/dump/"+tables.IPCacheTableName, &dump); err != nil {
		return nil, err
	}
	for _, e := range dump[tables.IPCacheTableName] {
		if e.Prefix == p {
			return &e, nil
		}
	}
	return nil, nil
}

// waitHealth waits until one of the process's health lines ("scope: level
// message error") starts with want.
func waitHealth(t *testing.T, a *apiaryProc, want string) {
	t.Helper()
	testenv.Eventually(t, wait, fmt.Sprintf("%s health %q", a.name, want), func() (bool, string) {
		h, err := a.health()
		if err != nil {
			return false, err.Error()
		}
		return slices.ContainsFunc(h, func(l string) bool { return strings.HasPrefix(l, want) }), strings.Join(h, "\n")
	})
}

// countLog counts the process's JSON log records with message msg whose
// line also contains every string of also.
func (p *proc) countLog(msg string, also ...string) int {
	n := 0
	sc := bufio.NewScanner(strings.NewReader(p.log.String()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var rec map[string]any
		if json.Unmarshal(sc.Bytes(), &rec) != nil || rec["msg"] != msg {
			continue
		}
		if !slices.ContainsFunc(also, func(s string) bool { return !strings.Contains(sc.Text(), s) }) {
			n++
		}
	}
	return n
}

// cnpCRD is a minimal CRD for cilium.io/v2 CiliumNetworkPolicy, of the
// test's own making: any content is accepted. (apiary does not ship Cilium's
// CRDs, whose schemas are Cilium's.)
func cnpCRD() *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "apiextensions.k8s.io/v1",
		"kind":       "CustomResourceDefinition",
		"metadata":   map[string]any{"name": "ciliumnetworkpolicies.cilium.io"},
		"spec": map[string]any{
			"group": "cilium.io",
			"scope": "Namespaced",
			"names": map[string]any{
				"kind": "CiliumNetworkPolicy", "listKind": "CiliumNetworkPolicyList",
				"plural": "ciliumnetworkpolicies", "singular": "ciliumnetworkpolicy",
			},
			"versions": []any{map[string]any{
				"name": "v2", "served": true, "storage": true,
				"schema": map[string]any{"openAPIV3Schema": map[string]any{
					"type": "object", "x-kubernetes-preserve-unknown-fields": true,
				}},
			}},
		},
	}}
}

// TestCiliumPolicyCRDsOptionalOnRealAPIServer runs an agent in a cluster
// with deploy/ installed as it is, without Cilium's policy CRDs: the agent
// treats both policy kinds as empty (one warning each, health OK), so its
// prefixes and ipcache tables initialize. A CiliumNetworkPolicy CRD
// installed later is picked up without a restart (a policy's toCIDR gets
// its prefix), and deleting it removes what its policies gave.
func TestCiliumPolicyCRDsOptionalOnRealAPIServer(t *testing.T) {
	apiserverBin, etcdBin := requireTestbin(t)
	pinRoot := testenv.BPFPinDir(t)
	ctx := context.Background()
	ps := newProcs(t)
	c, bin := startInstalledCluster(t, ps, apiserverBin, etcdBin)
	kubeconfig, _ := c.kubeconfig(t, "apiary-agent")
	agent := startApiary(t, ps, "agent", bin, "agent", "--kubeconfig="+kubeconfig, "--node-name=node-a",
		"--bpf-pin-dir="+filepath.Join(pinRoot, "node-a"), "--state-dir="+t.TempDir())

	const (
		cnpScope  = "selectors.informer-ciliumnetworkpolicies: "
		ccnpScope = "selectors.informer-ciliumclusterwidenetworkpolicies: "
		cnpWarn   = "CiliumNetworkPolicy (cilium.io/v2) is not served by the API server; treating it as empty until its CRD is installed"
		ccnpWarn  = "CiliumClusterwideNetworkPolicy (cilium.io/v2) is not served by the API server; treating it as empty until its CRD is installed"
	)
	waitInitialized(t, agent, tables.PrefixesTableName, tables.IPCacheTableName)
	waitHealth(t, agent, cnpScope+"OK CiliumNetworkPolicy not served; treated as empty")
	waitHealth(t, agent, ccnpScope+"OK CiliumClusterwideNetworkPolicy not served; treated as empty")
	waitHealthy(t, agent)

	// The CRD is installed and a policy created: its CIDR becomes a prefix
	// with an identity, without an agent restart.
	dyn, err := dynamic.NewForConfig(c.admin)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dyn.Resource(crdGVR).Create(ctx, cnpCRD(), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create the CiliumNetworkPolicy CRD: %v", err)
	}
	c.waitEstablished(t, "ciliumnetworkpolicies.cilium.io")
	cnps := dyn.Resource(schema.GroupVersionResource{Group: "cilium.io", Version: "v2", Resource: "ciliumnetworkpolicies"}).Namespace("default")
	policy := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
		"metadata": map[string]any{"name": "to-docs", "namespace": "default"},
		"spec": map[string]any{
			"endpointSelector": map[string]any{"matchLabels": map[string]any{"app": "web"}},
			"egress":           []any{map[string]any{"toCIDR": []any{"192.0.2.0/24"}}},
		},
	}}
	if _, err := cnps.Create(ctx, policy, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create a CiliumNetworkPolicy: %v", err)
	}
	cidr := netip.MustParsePrefix("192.0.2.0/24")
	testenv.Eventually(t, wait, "the policy's CIDR in prefixes and ipcache", func() (bool, string) {
		owners, err := agent.prefixOwners(cidr)
		if err != nil {
			return false, err.Error()
		}
		e, err := agent.ipcacheEntry(cidr)
		if err != nil {
			return false, err.Error()
		}
		return slices.Contains(owners, "policy") && e != nil && e.Identity != 0 && e.Error == "",
			fmt.Sprintf("owners %v, ipcache %+v", owners, e)
	})
	waitHealth(t, agent, cnpScope+"OK Listed and watching")

	// The CRD is deleted, and its policies with it: their prefixes go.
	if err := dyn.Resource(crdGVR).Delete(ctx, "ciliumnetworkpolicies.cilium.io", metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete the CiliumNetworkPolicy CRD: %v", err)
	}
	testenv.Eventually(t, wait, "the policy's CIDR gone from prefixes", func() (bool, string) {
		owners, err := agent.prefixOwners(cidr)
		if err != nil {
			return false, err.Error()
		}
		return !slices.Contains(owners, "policy"), fmt.Sprintf("owners %v", owners)
	})
	waitHealth(t, agent, cnpScope+"OK CiliumNetworkPolicy not served; treated as empty")
	waitHealthy(t, agent)

	// One warning per time a kind was found not served, none of client-go's
	// "Failed to watch" errors, however often the agent checked meanwhile.
	if n := agent.countLog(cnpWarn); n != 2 {
		t.Errorf("%d warnings %q, want 2 (at start and after the CRD was deleted)", n, cnpWarn)
	}
	if n := agent.countLog(ccnpWarn); n != 1 {
		t.Errorf("%d warnings %q, want 1", n, ccnpWarn)
	}
	if n := agent.countLog("Failed to watch", "Cilium"); n != 0 {
		t.Errorf("%d 'Failed to watch' errors about Cilium's kinds, want none", n)
	}
}
