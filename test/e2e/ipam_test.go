package e2e

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

type agentIPRow struct {
	Kind        string `json:"kind"`
	IP          string `json:"ip"`
	ContainerID string `json:"containerID"`
	Plugin      string `json:"plugin"`
	Status      string `json:"status"`
	Action      string `json:"action"`
	Error       string `json:"error"`
}

// waitHealthIP waits until agent-ips has a ready health IP taken with the
// given action, and returns it.
func (a *agent) waitHealthIP(t *testing.T, action string) netip.Addr {
	t.Helper()
	var ip netip.Addr
	testenv.Eventually(t, waitTimeout, "a ready health IP ("+action+") in agent-ips", func() (bool, string) {
		var rows []agentIPRow
		if err := a.showJSON("agent-ips", &rows); err != nil {
			return false, err.Error()
		}
		for _, r := range rows {
			if r.Kind == "health" && r.Status == "ready" && r.Action == action && r.Plugin == "host-local" && r.ContainerID == "apiary-health" {
				var err error
				ip, err = netip.ParseAddr(r.IP)
				return err == nil, fmt.Sprintf("%+v", r)
			}
		}
		return false, fmt.Sprintf("%+v", rows)
	})
	return ip
}

// TestDelegatedIPAM: with --ipam=delegated-plugin the agent gets its health
// IP from Debian's real host-local plugin, which holds the lease; a restart
// confirms the same IP (CNI CHECK) instead of taking another.
func TestDelegatedIPAM(t *testing.T) {
	t.Parallel()
	hostLocal := testenv.RequireProgram(t, "host-local", "/usr/lib/cni", "/opt/cni/bin")
	dataDir := filepath.Join(t.TempDir(), "cni")
	conflist := filepath.Join(t.TempDir(), "10-e2e.conflist")
	conf, err := json.Marshal(map[string]any{
		"cniVersion": "1.0.0",
		"name":       "e2e",
		"plugins": []any{map[string]any{
			"type": "ptp",
			"ipam": map[string]any{
				"type":    "host-local",
				"ranges":  [][]map[string]string{{{"subnet": "10.99.0.0/24"}}},
				"dataDir": dataDir,
			},
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, conflist, string(conf))
	a := startAgent(t, agentOptions{flags: []string{
		"--ipam=delegated-plugin", "--cni-conf-file=" + conflist,
		"--cni-bin-dir=" + filepath.Dir(hostLocal), "--enable-health-ip",
	}})

	ip := a.waitHealthIP(t, "allocated")
	if !netip.MustParsePrefix("10.99.0.0/24").Contains(ip) {
		t.Fatalf("health IP %s is not from host-local's range 10.99.0.0/24", ip)
	}
	// host-local itself holds the lease: a file named after the IP in its
	// data dir, holding the container ID.
	checkLease := func() {
		t.Helper()
		lease, err := os.ReadFile(filepath.Join(dataDir, "e2e", ip.String()))
		if err != nil {
			t.Fatalf("host-local holds no lease for the health IP %s: %v", ip, err)
		}
		if !strings.HasPrefix(string(lease), "apiary-health") {
			t.Fatalf("host-local's lease of %s is for %q, want apiary-health", ip, lease)
		}
	}
	checkLease()
	// The health IP gets the reserved health identity (4) in the ipcache map.
	waitIdentity := func() {
		t.Helper()
		testenv.Eventually(t, waitTimeout, ip.String()+"/32 identity=4 in the ipcache map", func() (bool, string) {
			m, err := a.ipcacheMap()
			if err != nil {
				return false, err.Error()
			}
			return m[ip.String()+"/32"] == 4, fmt.Sprint(m)
		})
	}
	waitIdentity()

	a.restart(t)
	if again := a.waitHealthIP(t, "checked"); again != ip {
		t.Fatalf("after a restart the health IP is %s, want %s as before", again, ip)
	}
	checkLease()
	waitIdentity()
	entries, err := os.ReadDir(filepath.Join(dataDir, "e2e"))
	if err != nil {
		t.Fatal(err)
	}
	var leases []string
	for _, e := range entries {
		if _, err := netip.ParseAddr(e.Name()); err == nil {
			leases = append(leases, e.Name())
		}
	}
	if len(leases) != 1 {
		t.Errorf("host-local holds leases %v, want only the health IP's %s", leases, ip)
	}
}
