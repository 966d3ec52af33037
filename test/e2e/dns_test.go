package e2e

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// fqdnPolicy selects api.example.com by name and the names of example.org
// by pattern.
const fqdnPolicy = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: to-example, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toFQDNs:
    - matchName: api.example.com
    - matchPattern: "*.example.org"
`

// startDNSMasq runs dnsmasq on a free loopback port as an authoritative-
// only upstream (no resolv.conf, no /etc/hosts) with the given extra
// options, and returns its address once it answers.
func startDNSMasq(t *testing.T, options ...string) string {
	t.Helper()
	bin := testenv.RequireProgram(t, "dnsmasq", "/usr/sbin")
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t)))
	_, port, _ := net.SplitHostPort(addr)
	startProcess(t, "dnsmasq", nil, bin, append([]string{
		"--keep-in-foreground", "--conf-file=/dev/null", "--pid-file",
		"--no-resolv", "--no-hosts", "--listen-address=127.0.0.1", "--bind-interfaces",
		"--port=" + port, "--log-queries", "--log-facility=-",
		"--host-record=ready.e2e.test,127.0.0.1", // what the probe below asks
	}, options...)...)
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp", addr)
	}}
	testenv.Eventually(t, waitTimeout, "dnsmasq to answer on "+addr, func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := r.LookupNetIP(ctx, "ip4", "ready.e2e.test.")
		if err != nil {
			return false, err.Error()
		}
		return true, ""
	})
	return addr
}

// dig runs bin (dig) to ask the DNS server at addr for name's A records over UDP, or TCP,
// and returns the addresses it answered.
func dig(t *testing.T, bin, addr, name string, tcp bool) []string {
	t.Helper()
	host, port, _ := net.SplitHostPort(addr)
	// The proxy may hold the answer until the map has the addresses:
	// wait longer than it may hold.
	args := []string{"@" + host, "-p", port, name, "A", "+short", "+time=20", "+tries=1"}
	if tcp {
		args = append(args, "+tcp")
	}
	out, err := exec.Command(bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("dig %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.Fields(string(out))
}

type fqdnNameRow struct {
	Name string `json:"name"`
	IPs  []struct {
		IP string `json:"ip"`
	} `json:"ips"`
	Selectors []string `json:"selectors"`
}

type ipcacheRow struct {
	Prefix   string   `json:"prefix"`
	Identity uint32   `json:"identity"`
	Labels   []string `json:"labels"`
	Status   struct {
		Kind string `json:"kind"`
	} `json:"status"`
}

// checkProxyStarted checks that the agent started its DNS proxy: the proxy
// listens in a start hook, so once the agent has logged "Started hive" it
// has logged "DNS proxy listening" with its address and upstream.
func checkProxyStarted(t *testing.T, a *agent, addr, upstream string) {
	t.Helper()
	a.waitLog(t, "Started hive")
	rec := a.proc.findLog("DNS proxy listening")
	if rec == nil {
		t.Fatalf("the agent started with --dns-proxy-addr=%s but never logged \"DNS proxy listening\": no DNS proxy", addr)
	}
	if rec["addr"] != addr || rec["upstream"] != upstream {
		t.Fatalf("DNS proxy listening on %v with upstream %v; want %s and %s", rec["addr"], rec["upstream"], addr, upstream)
	}
}

// TestDNSProxy: a workload's resolver is the agent's DNS proxy, dnsmasq its
// upstream. Answers come back unchanged over UDP and TCP; a name a toFQDNs
// selector matches has its address in the ipcache map by the time the
// answer arrives, with an identity that a restart keeps.
func TestDNSProxy(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	digBin := testenv.RequireProgram(t, "dig")
	upstream := startDNSMasq(t,
		"--host-record=api.example.com,198.51.100.10,300",
		"--address=/example.org/198.51.100.20", "--local-ttl=300",
		"--host-record=other.example.net,198.51.100.30,300")
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "to-example.yaml"), fqdnPolicy)
	proxy := net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t)))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--dns-proxy-addr=" + proxy, "--dns-upstream=" + upstream,
		// Hold answers until the map has their addresses, however busy
		// the machine (the default gives up after 100 ms).
		"--tofqdns-proxy-response-max-delay=15s",
	}})
	checkProxyStarted(t, a, proxy, upstream)

	// A name no selector matches is forwarded and answered like any other.
	if got := dig(t, digBin, proxy, "other.example.net", false); !slices.Equal(got, []string{"198.51.100.30"}) {
		t.Fatalf("dig other.example.net through the proxy: %q, want the upstream's 198.51.100.30", got)
	}

	identities := map[string]uint32{}
	for _, tc := range []struct {
		name, ip string
		tcp      bool
	}{
		{"api.example.com", "198.51.100.10", false}, // matchName
		{"www.example.org", "198.51.100.20", true},  // matchPattern, over TCP
		{"api.example.com", "198.51.100.10", true},
	} {
		got := dig(t, digBin, proxy, tc.name, tc.tcp)
		if !slices.Equal(got, []string{tc.ip}) {
			t.Fatalf("dig %s (tcp=%t) through the proxy: %q, want the upstream's %s", tc.name, tc.tcp, got, tc.ip)
		}
		// No waiting: the proxy released the answer only once the map
		// had the address.
		m, err := a.ipcacheMap()
		if err != nil {
			t.Fatal(err)
		}
		id, ok := m[tc.ip+"/32"]
		if !ok {
			t.Fatalf("dig %s returned, but %s/32 is not in the ipcache map:\n%v", tc.name, tc.ip, m)
		}
		if id < 0x01000000 {
			t.Errorf("%s/32 has identity %d, want a local (CIDR/FQDN) identity", tc.ip, id)
		}
		identities[tc.ip] = id
	}
	if identities["198.51.100.10"] == identities["198.51.100.20"] {
		t.Errorf("the two names match different selectors but share identity %d", identities["198.51.100.10"])
	}

	// `apiary db show fqdn-names` lists the selected names with their
	// selectors, and not the unselected one.
	checkNames := func(t *testing.T) {
		t.Helper()
		var rows []fqdnNameRow
		if err := a.showJSON("fqdn-names", &rows); err != nil {
			t.Fatal(err)
		}
		got := map[string]string{}
		for _, r := range rows {
			var ips []string
			for _, ip := range r.IPs {
				ips = append(ips, ip.IP)
			}
			got[r.Name] = fmt.Sprintf("%v %v", ips, r.Selectors)
		}
		want := map[string]string{
			"api.example.com": "[198.51.100.10] [fqdn:api.example.com]",
			"www.example.org": "[198.51.100.20] [fqdn:*.example.org]",
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("apiary db show fqdn-names:\n got %v\nwant %v", got, want)
		}
	}
	checkNames(t)

	// A restart on the same state and pin directories: the DNS cache comes
	// back from the checkpoint, and each address keeps its identity, in the
	// ipcache table (rebuilt by the new agent) and in the map.
	a.restart(t)
	checkProxyStarted(t, a, proxy, upstream)
	for ip := range identities {
		testenv.Eventually(t, waitTimeout, ip+"/32 in the restarted agent's ipcache table", func() (bool, string) {
			var rows []ipcacheRow
			if err := a.dump("ipcache", &rows); err != nil {
				return false, err.Error()
			}
			for _, r := range rows {
				if r.Prefix == ip+"/32" {
					return r.Status.Kind == "Done", fmt.Sprintf("%+v", r)
				}
			}
			return false, fmt.Sprintf("%+v", rows)
		})
	}
	checkNames(t)
	// And asking again changes nothing.
	if got := dig(t, digBin, proxy, "api.example.com", false); !slices.Equal(got, []string{"198.51.100.10"}) {
		t.Fatalf("dig api.example.com after the restart: %q", got)
	}
	m, err := a.ipcacheMap()
	if err != nil {
		t.Fatal(err)
	}
	for ip, want := range identities {
		if m[ip+"/32"] != want {
			t.Errorf("after the restart %s/32 has identity %d in the ipcache map, want %d as before", ip, m[ip+"/32"], want)
		}
	}
	var rows []ipcacheRow
	if err := a.dump("ipcache", &rows); err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if want, ok := identities[strings.TrimSuffix(r.Prefix, "/32")]; ok && r.Identity != want {
			t.Errorf("after the restart the ipcache table gives %s identity %d, want %d as before", r.Prefix, r.Identity, want)
		}
	}
}
