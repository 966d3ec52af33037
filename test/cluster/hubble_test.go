//go:build cluster

package cluster

import (
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// clusterFlow is a line of `hubble observe -o json`, reduced to what
// testHubble checks.
type clusterFlow struct {
	Flow struct {
		Verdict string `json:"verdict"`
		IP      struct {
			Destination string `json:"destination"`
		} `json:"IP"`
		Source             clusterFlowEndpoint              `json:"source"`
		Destination        clusterFlowEndpoint              `json:"destination"`
		DestinationService struct{ Name, Namespace string } `json:"destination_service"`
		NodeName           string                           `json:"node_name"`
		SockXlatePoint     string                           `json:"sock_xlate_point"`
		TrafficDirection   string                           `json:"traffic_direction"`
		EgressAllowedBy    []struct{ Name string }          `json:"egress_allowed_by"`
	} `json:"flow"`
}

type clusterFlowEndpoint struct {
	Namespace string                        `json:"namespace"`
	PodName   string                        `json:"pod_name"`
	Workloads []struct{ Kind, Name string } `json:"workloads"`
}

// testHubble: the real hubble CLI, on the node, reads the flows of the
// test's pods from the DaemonSet's agent through the Hubble socket the
// deployment puts in the agent's state directory (a hostPath): the client
// denied to the other pod and allowed, through the Service, to a server
// of the Deployment, each with its namespace, pod and verdict, and the
// socket LB's translation of that connection.
func testHubble(t *testing.T, n *node, w *workloads) {
	bin, server := hubbleOf(t, n)
	observe := func(args ...string) []clusterFlow {
		t.Helper()
		return observeHubble(t, bin, server, args...)
	}
	if out, err := exec.Command(bin, "status", "--server", server).CombinedOutput(); err != nil || !strings.Contains(string(out), "Ok") {
		t.Fatalf("hubble status: %v: %s", err, out)
	}

	other := w.other.Status.PodIP
	var denied, allowed *clusterFlow
	testenv.Eventually(t, waitTimeout, "hubble observe shows the client's denied and allowed flows", func() (bool, string) {
		connect(t, w.client, other+":8080")
		connect(t, w.client, w.clusterIP+":80")
		flows := observe("--last", "1000", "--pod", ns+"/"+w.client.Name)
		denied, allowed = nil, nil
		for i, f := range flows {
			switch {
			case f.Flow.Verdict == "DROPPED" && f.Flow.IP.Destination == other:
				denied = &flows[i]
			case f.Flow.Verdict == "FORWARDED" && f.Flow.TrafficDirection == "EGRESS" && f.Flow.DestinationService.Name == "server":
				allowed = &flows[i]
			}
		}
		return denied != nil && allowed != nil, fmt.Sprintf("%d flows of the client, denied %v, allowed %v", len(flows), denied, allowed)
	})
	if f := denied.Flow; f.Source.Namespace != ns || f.Source.PodName != w.client.Name || f.TrafficDirection != "EGRESS" ||
		f.Destination.PodName != w.other.Name || f.NodeName == "" {
		t.Errorf("denied flow: %+v", f)
	}
	if f := allowed.Flow; f.Source.PodName != w.client.Name || f.DestinationService.Namespace != ns ||
		!strings.HasPrefix(f.Destination.PodName, "server-") || f.Destination.Namespace != ns ||
		len(f.Destination.Workloads) != 1 || f.Destination.Workloads[0] != (struct{ Kind, Name string }{"Deployment", "server"}) ||
		len(f.EgressAllowedBy) != 1 || f.EgressAllowedBy[0].Name != "client-egress" {
		t.Errorf("allowed flow: %+v", f)
	}
	// The socket LB's translation of the client's connection to the
	// Service, as the reference's trace-sock flow to the frontend.
	xl := observe("--last", "1000", "--type", "trace-sock", "--from-pod", ns+"/"+w.client.Name, "--to-ip", w.clusterIP)
	var pre bool
	for _, f := range xl {
		pre = pre || (f.Flow.SockXlatePoint == "SOCK_XLATE_POINT_PRE_DIRECTION_FWD" && f.Flow.Verdict == "TRACED" &&
			f.Flow.Source.PodName == w.client.Name && f.Flow.DestinationService.Name == "server")
	}
	if !pre {
		t.Errorf("no pre-xlate-fwd flow of the client to %s: %+v", w.clusterIP, xl)
	}
	// As an operator filters: the namespace's drops.
	drops := observe("--last", "1000", "--namespace", ns, "--verdict", "DROPPED")
	if len(drops) == 0 {
		t.Error("--namespace --verdict DROPPED: nothing")
	}
	for _, f := range drops {
		if f.Flow.Verdict != "DROPPED" || (f.Flow.Source.Namespace != ns && f.Flow.Destination.Namespace != ns) {
			t.Errorf("--namespace %s --verdict DROPPED: %+v", ns, f.Flow)
		}
	}
}

// hubbleOf returns the hubble CLI and the address of the DaemonSet agent's
// Hubble socket on the node (a hostPath in the agent's state directory).
func hubbleOf(t *testing.T, n *node) (bin, server string) {
	return testenv.RequireHubble(t, repoRoot), "unix://" + filepath.Join(n.dir, "agent-state", "hubble.sock")
}

// observeHubble runs `hubble observe -o json ARGS` against server.
func observeHubble(t *testing.T, bin, server string, args ...string) []clusterFlow {
	t.Helper()
	return runObserve(t, exec.Command(bin, append([]string{"observe", "--server", server, "-o", "json"}, args...)...))
}

// observeHubble runs `hubble observe -o json ARGS` in the node's mount
// namespace, against its agent's Hubble socket in the node's own state
// directory (a tmpfs only the node sees).
func (w *workerNode) observeHubble(t *testing.T, args ...string) []clusterFlow {
	t.Helper()
	bin := testenv.RequireHubble(t, repoRoot)
	ns := []string{"-t", strconv.Itoa(w.holder.cmd.Process.Pid), "-m", "--", bin,
		"observe", "--server", "unix://" + filepath.Join(w.stateDir, "hubble.sock"), "-o", "json"}
	return runObserve(t, exec.Command("nsenter", append(ns, args...)...))
}

func runObserve(t *testing.T, cmd *exec.Cmd) []clusterFlow {
	t.Helper()
	out, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("%s: %v: %s%s", strings.Join(cmd.Args, " "), err, out, stderr)
	}
	var flows []clusterFlow
	for line := range strings.Lines(string(out)) {
		var f clusterFlow
		if err := json.Unmarshal([]byte(line), &f); err != nil {
			t.Fatalf("hubble printed %q: %v", line, err)
		}
		flows = append(flows, f)
	}
	return flows
}

// checkSuiteFlows: `hubble observe` through the DaemonSet shows the
// traffic of the suite that just ran on the node: flows between pods of
// the namespaces it made (neither the test's own nor kube-system), both
// forwarded and dropped, as its policies allowed and denied them.
func checkSuiteFlows(t *testing.T, n *node) {
	t.Helper()
	bin, server := hubbleOf(t, n)
	verdicts := map[string]int{}
	namespaces := map[string]bool{}
	for _, f := range observeHubble(t, bin, server, "--last", "4000") {
		for _, e := range []clusterFlowEndpoint{f.Flow.Source, f.Flow.Destination} {
			if e.Namespace != "" && e.Namespace != ns && e.Namespace != "kube-system" && e.PodName != "" {
				verdicts[f.Flow.Verdict]++
				namespaces[e.Namespace] = true
				break
			}
		}
	}
	if verdicts["FORWARDED"] == 0 || verdicts["DROPPED"] == 0 {
		t.Errorf("hubble observe: flows of the suite's pods by verdict %v (namespaces %v), want forwarded and dropped ones", verdicts, namespaces)
		return
	}
	t.Logf("hubble observe: the suite's flows by verdict %v, in %d namespaces", verdicts, len(namespaces))
}
