package e2e

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// TestSocketLBNodePortAndLoadBalancer: with --enable-socket-lb, a process
// in the cgroup reaches a Service's backend at <node IP>:<nodePort> and at
// its LoadBalancer ingress IP, as the shipped binary writes those
// frontends.
func TestSocketLBNodePortAndLoadBalancer(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	cgroup := testenv.Cgroup(t)
	listen(t, "127.0.1.61:8080")
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "svc.yaml"), `apiVersion: v1
kind: Service
metadata: {name: edge, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.30
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}]
status:
  loadBalancer:
    ingress: [{ip: 127.0.2.2}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: edge-1, namespace: default, labels: {kubernetes.io/service-name: edge}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["127.0.1.61"], conditions: {ready: true}}]
`)
	// The node's own address is a loopback one, so that a connection the
	// socket LB did not translate never leaves the machine.
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--enable-socket-lb", "--cgroup-root=" + cgroup, "--node-ips=127.0.2.1",
	}})
	testenv.Eventually(t, waitTimeout, "the NodePort and LoadBalancer frontends written", func() (bool, string) {
		fes, err := a.frontends()
		if err != nil {
			return false, err.Error()
		}
		done := 0
		for _, fe := range fes {
			if (strings.HasPrefix(fe, "127.0.2.1:30080/TCP ") || strings.HasPrefix(fe, "127.0.2.2:80/TCP ")) && strings.HasSuffix(fe, " Done") {
				done++
			}
		}
		return done == 2, strings.Join(fes, "\n")
	})
	for _, addr := range []string{"127.0.2.1:30080", "127.0.2.2:80"} {
		testenv.Eventually(t, waitTimeout, "a backend answers at "+addr, func() (bool, string) {
			got := connectFrom(t, cgroup, addr, "")
			return got == "ok: hello from 127.0.1.61:8080", got
		})
	}
}
