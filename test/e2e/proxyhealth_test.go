package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// proxyHealthService is a LoadBalancer Service with externalTrafficPolicy
// Local and a health check node port, with one endpoint on the agent's
// node (ready as localReady says) and one on another node.
func proxyHealthService(name string, hcPort int, localReady bool) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: %[1]s, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.41
  externalTrafficPolicy: Local
  healthCheckNodePort: %[2]d
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30081, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-1, namespace: default, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["127.0.1.71"], nodeName: e2e-node, conditions: {ready: %[3]v}}
- {addresses: ["127.0.1.72"], nodeName: other-node, conditions: {ready: true}}
`, name, hcPort, localReady)
}

// TestKubeProxyHealth: the agent answers kube-proxy's health endpoint
// (--kube-proxy-healthz-addr) on /healthz and /livez, 200 with
// lastUpdated and currentTime while the load-balancing maps are in line
// with the Services, 503 once a change has waited longer than
// --kube-proxy-healthz-timeout (the maps full), and 200 again when it is
// served; and, with --enable-health-check-node-port, each
// externalTrafficPolicy Local Service's healthCheckNodePort: 200 with one
// local endpoint (the other node's is not counted), 503 when it is not
// ready, closed when the Service goes. A port another process holds is
// an error in the proxy-health table and the agent's /healthz, the agent
// serving.
func TestKubeProxyHealth(t *testing.T) {
	testenv.RequireRoot(t)
	configDir := t.TempDir()
	hcPort := freePort(t)
	svcFile := filepath.Join(configDir, "web.yaml")
	writeFile(t, svcFile, proxyHealthService("web", hcPort, true))
	hzAddr := net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t)))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--node-ips=127.0.2.1", "--bpf-lb-map-max=16",
		"--kube-proxy-healthz-addr=" + hzAddr, "--kube-proxy-healthz-timeout=2s", "--enable-health-check-node-port",
	}})

	type answer struct {
		code int
		body map[string]any
	}
	get := func(url string) (answer, string) {
		code, body, err := httpGet(url)
		if err != nil {
			return answer{}, err.Error()
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(body), &m); err != nil {
			return answer{code: code}, fmt.Sprintf("%d %s: %v", code, body, err)
		}
		return answer{code, m}, fmt.Sprintf("%d %s", code, body)
	}
	waitHealthz := func(want int) {
		t.Helper()
		for _, path := range []string{"/healthz", "/livez"} {
			testenv.Eventually(t, waitTimeout, fmt.Sprintf("%s %d", path, want), func() (bool, string) {
				got, says := get("http://" + hzAddr + path)
				_, last := got.body["lastUpdated"].(string)
				_, cur := got.body["currentTime"].(string)
				return got.code == want && last && cur, says
			})
		}
	}
	hcURL := fmt.Sprintf("http://127.0.0.1:%d/", hcPort)
	waitCheck := func(wantCode int, wantEndpoints float64, wantProxyHealthy bool) {
		t.Helper()
		testenv.Eventually(t, waitTimeout, fmt.Sprintf("health check node port %d with %v local endpoints", wantCode, wantEndpoints), func() (bool, string) {
			got, says := get(hcURL)
			svc, _ := got.body["service"].(map[string]any)
			return got.code == wantCode && got.body["localEndpoints"] == wantEndpoints && got.body["serviceProxyHealthy"] == wantProxyHealthy &&
				svc["namespace"] == "default" && svc["name"] == "web", says
		})
	}

	waitHealthz(http.StatusOK)
	if code, body, err := httpGet("http://" + hzAddr + "/metrics"); err != nil || code != http.StatusNotFound {
		t.Errorf("another path: %d %s %v, want 404", code, body, err)
	}
	waitCheck(http.StatusOK, 1, true)
	resp, err := http.Get(hcURL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if w := resp.Header.Get("X-Load-Balancing-Endpoint-Weight"); w != "1" {
		t.Errorf("X-Load-Balancing-Endpoint-Weight %q, want 1", w)
	}

	t.Run("local endpoint not ready", func(t *testing.T) {
		writeFile(t, svcFile, proxyHealthService("web", hcPort, false))
		waitCheck(http.StatusServiceUnavailable, 0, true)
		testenv.Eventually(t, waitTimeout, "the proxy-health table", func() (bool, string) {
			var rows []*tables.ProxyHealthListener
			if err := a.dump(tables.ProxyHealthTableName, &rows); err != nil {
				return false, err.Error()
			}
			got := map[string]string{}
			for _, r := range rows {
				got[r.Name] = fmt.Sprintf("%s %d %s", r.Address, r.LocalEndpoints, r.Error)
			}
			want := map[string]string{"healthz": hzAddr + " 0 ", "default/web": fmt.Sprintf(":%d 0 ", hcPort)}
			return fmt.Sprint(got) == fmt.Sprint(want), fmt.Sprint(got)
		})
		writeFile(t, svcFile, proxyHealthService("web", hcPort, true))
		waitCheck(http.StatusOK, 1, true)
	})

	t.Run("maps full", func(t *testing.T) {
		// 20 ports of a cluster IP: more frontends than the 16 entries
		// of the maps hold.
		var ports []string
		for i := range 20 {
			ports = append(ports, fmt.Sprintf("{name: p%d, port: %d, protocol: TCP}", i, 9000+i))
		}
		big := filepath.Join(configDir, "big.yaml")
		writeFile(t, big, `apiVersion: v1
kind: Service
metadata: {name: big, namespace: default}
spec:
  clusterIP: 10.96.0.42
  ports: [`+strings.Join(ports, ", ")+`]
`)
		waitHealthz(http.StatusServiceUnavailable)
		waitCheck(http.StatusServiceUnavailable, 1, false)
		if err := os.Remove(big); err != nil {
			t.Fatal(err)
		}
		waitHealthz(http.StatusOK)
		waitCheck(http.StatusOK, 1, true)
	})

	t.Run("port taken", func(t *testing.T) {
		ln, err := net.Listen("tcp", ":0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		taken := ln.Addr().(*net.TCPAddr).Port
		busy := filepath.Join(configDir, "busy.yaml")
		writeFile(t, busy, strings.NewReplacer("10.96.0.41", "10.96.0.43", "30081", "30082").Replace(proxyHealthService("busy", taken, true)))
		testenv.Eventually(t, waitTimeout, "the agent's /healthz names the taken port", func() (bool, string) {
			code, body, err := httpGet(a.url("/healthz"))
			if err != nil {
				return false, err.Error()
			}
			return code != http.StatusOK && strings.Contains(body, "default/busy") && strings.Contains(body, strconv.Itoa(taken)), fmt.Sprintf("%d %s", code, body)
		})
		waitCheck(http.StatusOK, 1, true) // the others still answer
		if err := os.Remove(busy); err != nil {
			t.Fatal(err)
		}
		a.waitHealthy(t)
	})

	t.Run("service gone", func(t *testing.T) {
		if err := os.Remove(svcFile); err != nil {
			t.Fatal(err)
		}
		testenv.Eventually(t, waitTimeout, "the health check node port closed", func() (bool, string) {
			_, _, err := httpGet(hcURL)
			return err != nil && strings.Contains(err.Error(), "connection refused"), fmt.Sprint(err)
		})
	})
}
