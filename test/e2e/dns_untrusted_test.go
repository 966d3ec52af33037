package e2e

import (
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// sharedFQDNPolicy gives client-a and client-c the same DNS rule and the
// same toFQDNs rule: both may ask the resolver for *.allowed.test, and
// connect to what those names resolve to.
const sharedFQDNPolicy = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: shared-fqdn, namespace: default}
spec:
  endpointSelector: {matchExpressions: [{key: app, operator: In, values: [client, other]}]}
  egress:
  - toCIDR: [%s/32]
    toPorts:
    - ports: [{port: "53", protocol: ANY}]
      rules: {dns: [{matchPattern: "*.allowed.test"}]}
  - toFQDNs: [{matchPattern: "*.allowed.test"}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`

// fqdnEndpointRow is a row of fqdn-names with its endpoint.
type fqdnEndpointRow struct {
	Name      string   `json:"name"`
	Endpoint  string   `json:"endpoint"`
	Selectors []string `json:"selectors"`
}

// TestUntrustedResolverAllowsTheAskerOnly: client-a and client-c have the
// same toFQDNs rule. client-a asks a resolver the node does not trust
// (dnsmasq on a loopback address: not --dns-upstream, no cluster DNS
// Service, not in --dns-trusted-resolvers) for a name the rule allows:
// client-a may then connect to the answered address, client-c may not
// (its rule does not see answers another pod's resolver gave). The
// fqdn-names row is client-a's, its label fqdn:*.allowed.test@default/client-a.
// With the resolver trusted (after a restart that restores client-a's
// row), its answer allows both. When client-a goes, its rows go. Without the rule,
// main labelled nothing for anybody, so client-a's connect failed.
func TestUntrustedResolverAllowsTheAskerOnly(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	digBin := testenv.RequireProgram(t, "dig")
	resolver, allowedIP, _ := startResolver(t)
	root := testenv.Cgroup(t)
	cgA, _, cgC := mkCgroups(t, root)
	listen(t, allowedIP+":8080")

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(t, filepath.Join(configDir, "dns.yaml"), fmt.Sprintf(sharedFQDNPolicy, resolver))
	proxy := net.JoinHostPort("127.0.0.1", fmt.Sprint(freePort(t)))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root,
		"--dns-proxy-addr=" + proxy, "--dns-upstream=127.0.0.1:1",
		"--dns-cluster-service=",
		"--tofqdns-proxy-response-max-delay=15s",
	}})
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny", "default/client-c": "off default-deny"})
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")

	ask := func(dir, name string) {
		t.Helper()
		out, err := digIn(dir, digBin, resolver, name, false)
		if err != nil {
			t.Fatalf("dig %s in %s: %v", name, dir, err)
		}
		if status, ips := answerOf(out); status != "NOERROR" || !slices.Equal(ips, []string{allowedIP}) {
			t.Fatalf("dig %s in %s: %s %v, want NOERROR [%s]", name, dir, status, ips, allowedIP)
		}
	}
	want := "ok: hello from " + allowedIP + ":8080"

	// Untrusted: the asker alone. No waiting: the answer was held until
	// client-a's policy allowed the address.
	ask(cgA, "www.allowed.test")
	if got := connectFrom(t, cgA, allowedIP+":8080", ""); got != want {
		t.Errorf("client-a to %s after its own resolver answered: %s, want %s", allowedIP, got, want)
	}
	if got := connectFrom(t, cgC, allowedIP+":8080", ""); got != "EPERM" {
		t.Errorf("client-c to %s, which client-a's resolver gave client-a: %s, want EPERM", allowedIP, got)
	}
	var rows []fqdnEndpointRow
	if err := a.showJSON("fqdn-names", &rows); err != nil {
		t.Fatal(err)
	}
	wantRow := fqdnEndpointRow{Name: "www.allowed.test", Endpoint: "default/client-a", Selectors: []string{"fqdn:*.allowed.test@default/client-a"}}
	if len(rows) != 1 || rows[0].Name != wantRow.Name || rows[0].Endpoint != wantRow.Endpoint || !slices.Equal(rows[0].Selectors, wantRow.Selectors) {
		t.Errorf("fqdn-names: %+v, want [%+v]", rows, wantRow)
	}
	if n, err := a.metric("apiary_fqdn_untrusted_answers_total"); err != nil || n != 1 {
		t.Errorf("apiary_fqdn_untrusted_answers_total: %v %v, want 1", n, err)
	}

	// Trusted: everyone whose rule allows the name, client-a included,
	// whose untrusted row for the same address the restart restored. No
	// waiting: the answer was held until both policies allowed the
	// address.
	a.restart(t, "--dns-trusted-resolvers="+resolver)
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")
	ask(cgA, "trusted.allowed.test")
	for dir, who := range map[string]string{cgA: "client-a", cgC: "client-c"} {
		if got := connectFrom(t, dir, allowedIP+":8080", ""); got != want {
			t.Errorf("%s to %s after a trusted resolver answered client-a: %s, want %s", who, allowedIP, got, want)
		}
	}
	if t.Failed() {
		for _, table := range []string{"fqdn-names", "endpoint-policy", "policy-entries", "identities"} {
			out, _ := a.db("show", table)
			t.Logf("%s:\n%s", table, out)
		}
		out, _ := a.bpf("policy", "list")
		t.Logf("bpf policy list:\n%s", out)
		t.FailNow()
	}

	// client-a goes: the rows of its untrusted answers go with it.
	var others []string
	for _, doc := range strings.Split(policyPods, "---\n") {
		if !strings.Contains(doc, "name: client-a,") {
			others = append(others, doc)
		}
	}
	writeFile(t, filepath.Join(configDir, "pods.yaml"), strings.Join(others, "---\n"))
	testenv.Eventually(t, waitTimeout, "client-a's fqdn-names rows to go", func() (bool, string) {
		var rows []fqdnEndpointRow
		if err := a.showJSON("fqdn-names", &rows); err != nil {
			return false, err.Error()
		}
		return len(rows) == 1 && rows[0].Name == "trusted.allowed.test" && rows[0].Endpoint == "", fmt.Sprintf("%+v", rows)
	})
}
