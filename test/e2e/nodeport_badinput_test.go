package e2e

import (
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// npOddities: a Service of another proxy on a node port, a nodePort
// outside --node-port-range, an external IP that is the node's own
// address, and a LoadBalancer IP two Services share on other ports and a
// third asks for on a port already taken.
var npOddities = `---
apiVersion: v1
kind: Service
metadata: {name: np-other-proxy, namespace: default, labels: {service.kubernetes.io/service-proxy-name: someone-else}}
spec:
  type: NodePort
  clusterIP: 10.96.0.90
  ports: [{name: tcp, port: 80, targetPort: 8080, nodePort: 30090, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-other-proxy-1, namespace: default, labels: {kubernetes.io/service-name: np-other-proxy, service.kubernetes.io/service-proxy-name: someone-else}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["` + npPod4 + `"], nodeName: e2e-node, conditions: {ready: true}}]
---
apiVersion: v1
kind: Service
metadata: {name: np-out-of-range, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.91
  ports: [{name: tcp, port: 80, targetPort: 8080, nodePort: 40091, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: np-ext-node, namespace: default}
spec:
  clusterIP: 10.96.0.92
  externalIPs: [` + npNode4 + `]
  ports: [{name: tcp, port: 8092, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: np-ext-node-1, namespace: default, labels: {kubernetes.io/service-name: np-ext-node}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["` + npPod4 + `"], nodeName: e2e-node, conditions: {ready: true}}]
` + npSharedLB("np-lb-a", "10.96.0.93", 80) + npSharedLB("np-lb-b", "10.96.0.94", 81) + npSharedLB("np-lb-c", "10.96.0.95", 80)

// npSharedIP is the LoadBalancer IP of npSharedLB.
const npSharedIP = "10.241.9.60"

func npSharedLB(name, clusterIP string, port int) string {
	return fmt.Sprintf(`---
apiVersion: v1
kind: Service
metadata: {name: %[1]s, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: %[2]s
  allocateLoadBalancerNodePorts: false
  ports: [{name: tcp, port: %[3]d, targetPort: 8080, protocol: TCP}]
status: {loadBalancer: {ingress: [{ip: %[4]s}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-1, namespace: default, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["%[5]s"], nodeName: e2e-node, conditions: {ready: true}}]
`, name, clusterIP, port, npSharedIP, npPod4)
}

// npManyPorts is a Service with n ports (10000+i -> the pod's 8080) on a
// cluster IP and an external IP the outside client routes to the node.
func npManyPorts(n int) string {
	var b strings.Builder
	b.WriteString("---\napiVersion: v1\nkind: Service\nmetadata: {name: np-many, namespace: default}\nspec:\n  clusterIP: 10.96.0.96\n  externalIPs: [10.241.9.70]\n  ports:\n")
	for i := range n {
		fmt.Fprintf(&b, "  - {name: p%d, port: %d, targetPort: 8080, protocol: TCP}\n", i, 10000+i)
	}
	b.WriteString("---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: np-many-1, namespace: default, labels: {kubernetes.io/service-name: np-many}}\naddressType: IPv4\nports:\n")
	for i := range n {
		fmt.Fprintf(&b, "- {name: p%d, port: 8080, protocol: TCP}\n", i)
	}
	b.WriteString("endpoints: [{addresses: [\"" + npPod4 + "\"], nodeName: e2e-node, conditions: {ready: true}}]\n")
	return b.String()
}

// TestNodePortLeftAlone: what the north-south programs do with odd or bad
// Services, from the outside client.
//   - A Service labelled for another proxy is left alone on this path
//     too: its node port reaches whatever listens on the node (here a
//     listener of the test), untranslated.
//   - A nodePort outside --node-port-range is an error on the Service's
//     row and opens nothing.
//   - An external IP that is the node's own address is served, as
//     kube-proxy serves it: <node IP>:<port> reaches the backend.
//   - A LoadBalancer IP shared by two Services on different ports serves
//     both; a third Service asking for a port already taken is refused that
//     frontend with a conflict on its row, and the first keeps it.
//   - A Service with 10,000 ports is programmed (its last port answers
//     through the external IP) without stopping the others; the time it
//     takes is logged.
func TestNodePortLeftAlone(t *testing.T) {
	// The listener of the node itself for the other proxy's node port.
	ln, err := net.Listen("tcp", npNode4+":30090")
	if err != nil {
		// The address comes with setupNodePort's device: listen on all.
		ln, err = net.Listen("tcp", ":30090")
	}
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			fmt.Fprintln(c, "the node itself")
			c.Close()
		}
	}()

	// The odd Services come after the start: the agent's health is
	// degraded while a Service has problems, and it is started healthy.
	s := setupNodePort(t, "", "auto")
	writeFile(t, filepath.Join(s.configDir, "odd.yaml"), npOddities)
	testenv.Eventually(t, waitTimeout, "the shared LoadBalancer IP's first port", func() (bool, string) {
		got := s.client.run(t, connectEnv+"="+npSharedIP+":80")
		return got == "ok: hello "+npClient4, got
	})

	t.Run("another proxy's Service", func(t *testing.T) {
		if got := s.client.run(t, connectEnv+"="+npNode4+":30090"); got != "ok: the node itself" {
			t.Errorf("node port of a Service labelled for another proxy: %q, want the node's own listener", got)
		}
		out, err := s.a.bpf("nodeport", "list")
		if err != nil || strings.Contains(out, ":30090") {
			t.Errorf("a flow to the other proxy's node port was translated: %v\n%s", err, out)
		}
	})

	t.Run("nodePort outside the range", func(t *testing.T) {
		var rows []struct {
			Name   string
			Errors []string
		}
		if err := s.a.dump("services", &rows); err != nil {
			t.Fatal(err)
		}
		found := false
		for _, r := range rows {
			if r.Name == "default/np-out-of-range" {
				found = strings.Contains(strings.Join(r.Errors, ";"), "nodePort 40091 is outside --node-port-range")
			}
		}
		if !found {
			t.Errorf("np-out-of-range's row does not say its nodePort is outside the range: %+v", rows)
		}
		if got := s.client.run(t, connectEnv+"="+npNode4+":40091"); got != "ECONNREFUSED" {
			t.Errorf("nodePort 40091: %q, want nothing there (the node's own refusal)", got)
		}
	})

	t.Run("external IP is the node's address", func(t *testing.T) {
		testenv.Eventually(t, waitTimeout, "the node's address at the Service's port", func() (bool, string) {
			got := s.client.run(t, connectEnv+"="+npNode4+":8092")
			return got == "ok: hello "+npClient4, got
		})
	})

	t.Run("shared LoadBalancer IP", func(t *testing.T) {
		if got := s.client.run(t, connectEnv+"="+npSharedIP+":81"); got != "ok: hello "+npClient4 {
			t.Errorf("the second Service on the shared IP: %q", got)
		}
		var rows []struct {
			Name      string
			Conflicts []string
		}
		if err := s.a.dump("services", &rows); err != nil {
			t.Fatal(err)
		}
		// Whichever of np-lb-a and np-lb-c the agent met first keeps
		// :80; the other's row names it. np-lb-b has :81 to itself.
		conflicts := map[string]string{}
		for _, r := range rows {
			conflicts[r.Name] = strings.Join(r.Conflicts, ";")
		}
		const used = "frontend " + npSharedIP + ":80/TCP is already used by service "
		a, b, c := conflicts["default/np-lb-a"], conflicts["default/np-lb-b"], conflicts["default/np-lb-c"]
		if b != "" || !(a == "" && c == used+"default/np-lb-a" || c == "" && a == used+"default/np-lb-c") {
			t.Errorf("conflicts a %q, b %q, c %q; want one of a and c to name the other", a, b, c)
		}
	})

	t.Run("10000 ports", func(t *testing.T) {
		start := time.Now()
		writeFile(t, filepath.Join(s.configDir, "many.yaml"), npManyPorts(10000))
		testenv.Eventually(t, 2*waitTimeout, "the last of 10,000 ports through the external IP", func() (bool, string) {
			got := s.client.run(t, connectEnv+"=10.241.9.70:19999")
			return got == "ok: hello "+npClient4, got
		})
		took := time.Since(start)
		t.Logf("a Service with 10,000 ports: programmed and answering from outside in %s", took.Round(time.Millisecond))
		start = time.Now()
		if got := s.client.run(t, connectEnv+"="+npNode4+":30081"); got != "ok: hello "+npClient4 {
			t.Errorf("another Service after the 10,000 ports: %q", got)
		}
		if got := s.client.run(t, connectEnv+"=10.241.9.70:10000"); got != "ok: hello "+npClient4 {
			t.Errorf("the first of the 10,000 ports: %q", got)
		}
		t.Logf("two connections after it: %s", time.Since(start).Round(time.Millisecond))
	})
}
