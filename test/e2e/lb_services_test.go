package e2e

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// lbServices are the Services of TestSocketLBServices: a dual-stack one,
// one with ClientIP affinity, and two with internalTrafficPolicy Local, one
// of which has no endpoint on this node. Backends listen on loopback
// addresses (::1 for IPv6), so that a connection the socket LB did not
// translate never leaves the machine.
const lbServices = `apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 10.96.0.40
  clusterIPs: [10.96.0.40, "fd00:96::40"]
  ports: [{name: http, port: 80, targetPort: 8086, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v4, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8086, protocol: TCP}]
endpoints: [{addresses: ["127.0.1.81"], conditions: {ready: true}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v6, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8086, protocol: TCP}]
endpoints: [{addresses: ["::1"], conditions: {ready: true}}]
---
apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: default}
spec:
  clusterIP: 10.96.0.41
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 2}}
  ports: [{name: http, port: 80, targetPort: 8086, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sticky-1, namespace: default, labels: {kubernetes.io/service-name: sticky}}
addressType: IPv4
ports: [{name: http, port: 8086, protocol: TCP}]
endpoints:
- {addresses: ["127.0.1.82"], conditions: {ready: true}}
- {addresses: ["127.0.1.83"], conditions: {ready: true}}
- {addresses: ["127.0.1.84"], conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: local, namespace: default}
spec:
  clusterIP: 10.96.0.42
  internalTrafficPolicy: Local
  ports: [{name: http, port: 80, targetPort: 8086, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local-1, namespace: default, labels: {kubernetes.io/service-name: local}}
addressType: IPv4
ports: [{name: http, port: 8086, protocol: TCP}]
endpoints:
- {addresses: ["127.0.1.85"], nodeName: e2e-node, conditions: {ready: true}}
- {addresses: ["127.0.1.86"], nodeName: other-node, conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: elsewhere, namespace: default}
spec:
  clusterIP: 10.96.0.43
  internalTrafficPolicy: Local
  ports: [{name: http, port: 80, targetPort: 8086, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: elsewhere-1, namespace: default, labels: {kubernetes.io/service-name: elsewhere}}
addressType: IPv4
ports: [{name: http, port: 8086, protocol: TCP}]
endpoints: [{addresses: ["127.0.1.86"], nodeName: other-node, conditions: {ready: true}}]
`

// TestSocketLBServices runs the shipped binary with --enable-socket-lb on
// Services of every family and with the options users set most, and
// connects from a process in the cgroup as a pod would.
func TestSocketLBServices(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	cgroup := testenv.Cgroup(t)
	listen(t, "127.0.1.81:8086", "[::1]:8086", "127.0.1.82:8086", "127.0.1.83:8086",
		"127.0.1.84:8086", "127.0.1.85:8086", "127.0.1.86:8086")
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "services.yaml"), lbServices)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--enable-socket-lb", "--cgroup-root=" + cgroup, "--node-name=e2e-node",
	}})
	testenv.Eventually(t, waitTimeout, "the socket LB attached and every frontend written", func() (bool, string) {
		var health []struct{ Scope, Message string }
		if err := a.dump("health", &health); err != nil {
			return false, err.Error()
		}
		if !slices.ContainsFunc(health, func(h struct{ Scope, Message string }) bool {
			return h.Scope == "socketlb.job-attach" && strings.HasPrefix(h.Message, "Attached to cgroup")
		}) {
			return false, "socket LB not attached yet"
		}
		fes, err := a.frontends()
		if err != nil {
			return false, err.Error()
		}
		done := 0
		for _, fe := range fes {
			if strings.HasSuffix(fe, " Done") {
				done++
			}
		}
		// Five service addresses with one port each.
		return done == 5, strings.Join(fes, "\n")
	})
	connect := func(addr string) string { return connectFrom(t, cgroup, addr, "") }

	t.Run("dual-stack", func(t *testing.T) {
		for addr, want := range map[string]string{
			"10.96.0.40:80":    "ok: hello from 127.0.1.81:8086",
			"[fd00:96::40]:80": "ok: hello from [::1]:8086",
		} {
			if got := connect(addr); got != want {
				t.Errorf("connect %s: %s, want %s", addr, got, want)
			}
		}
		out, err := a.bpf("lb", "list")
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range []string{"SVC [fd00:96::40]:80/TCP SLOT=1 ", "ADDR=[::1]:8086/TCP STATE=active", "REV ID="} {
			if !strings.Contains(out, line) {
				t.Errorf("apiary bpf lb list lacks %q:\n%s", line, out)
			}
		}
	})

	t.Run("unexposed port refused", func(t *testing.T) {
		for _, addr := range []string{"10.96.0.40:81", "[fd00:96::40]:81"} {
			if got := connect(addr); got != "ECONNREFUSED" {
				t.Errorf("connect %s (no service port): %s, want ECONNREFUSED", addr, got)
			}
		}
	})

	t.Run("session affinity", func(t *testing.T) {
		first := connect("10.96.0.41:80")
		if !strings.HasPrefix(first, "ok: hello from 127.0.1.8") {
			t.Fatalf("connect to the affinity service: %s", first)
		}
		for i := range 19 {
			if got := connect("10.96.0.41:80"); got != first {
				t.Fatalf("connection %d went to %q, the first to %q", i+2, got, first)
			}
		}
		// Once the client has been quiet for longer than the timeout,
		// the choice is free again: with three backends, a few tries
		// find another one.
		changed := false
		for range 12 {
			time.Sleep(2500 * time.Millisecond)
			if got := connect("10.96.0.41:80"); got != first {
				changed = true
				break
			}
		}
		if !changed {
			t.Errorf("after 12 idle timeouts every connection still went to %q", first)
		}
	})

	t.Run("internalTrafficPolicy Local", func(t *testing.T) {
		for range 10 {
			if got := connect("10.96.0.42:80"); got != "ok: hello from 127.0.1.85:8086" {
				t.Fatalf("connect to the Local service: %s, want the backend on this node", got)
			}
		}
		if got := connect("10.96.0.43:80"); got != "ECONNREFUSED" {
			t.Errorf("connect to a Local service without a local backend: %s, want ECONNREFUSED", got)
		}
	})
}
