// Package kubernetes is not network-policy-api's: build.sh adds this file to
// the conformance suite's package sigs.k8s.io/network-policy-api/
// conformance/utils/kubernetes, and one call into it to each of that
// package's apply.go and helper.go. It lets the suite run on a kernel
// without SCTP (no CONFIG_IP_SCTP), where it otherwise cannot start: agnhost
// porter exits when it cannot open its SCTP socket, so the base pods never
// become Ready. It changes the suite only when APIARY_CNP_NO_SCTP=1; it logs
// every probe, for apiary's test/cluster to count them per test.
package kubernetes

import (
	"os"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// apiaryNoSCTPEnv set to 1 says the kernel has no SCTP.
const apiaryNoSCTPEnv = "APIARY_CNP_NO_SCTP"

// apiarySCTPServerLeftOut begins the log line of each container left out.
const apiarySCTPServerLeftOut = "APIARY-SCTP-SERVER-LEFT-OUT"

func apiaryNoSCTP() bool { return os.Getenv(apiaryNoSCTPEnv) == "1" }

// apiaryDropSCTPServers removes from a StatefulSet of the base manifests
// the containers that serve SCTP (agnhost porter with a SERVE_SCTP_PORT_*
// variable). The TCP and UDP servers and the client stay.
func apiaryDropSCTPServers(t *testing.T, u *unstructured.Unstructured) {
	if !apiaryNoSCTP() || u.GetKind() != "StatefulSet" {
		return
	}
	containers, found, err := unstructured.NestedSlice(u.Object, "spec", "template", "spec", "containers")
	if err != nil || !found {
		return
	}
	var keep []any
	for _, c := range containers {
		if servesSCTP(c) {
			t.Logf("%s: left out container %v of StatefulSet %s/%s (this kernel has no SCTP)",
				apiarySCTPServerLeftOut, c.(map[string]any)["name"], u.GetNamespace(), u.GetName())
			continue
		}
		keep = append(keep, c)
	}
	if err := unstructured.SetNestedSlice(u.Object, keep, "spec", "template", "spec", "containers"); err != nil {
		t.Fatalf("StatefulSet %s/%s: %v", u.GetNamespace(), u.GetName(), err)
	}
}

func servesSCTP(c any) bool {
	m, ok := c.(map[string]any)
	if !ok {
		return false
	}
	env, _ := m["env"].([]any)
	for _, e := range env {
		if v, ok := e.(map[string]any); ok {
			if name, _ := v["name"].(string); strings.HasPrefix(name, "SERVE_SCTP_PORT_") {
				return true
			}
		}
	}
	return false
}

// apiaryProbeLog begins the log line of each probe (every attempt).
const apiaryProbeLog = "APIARY-PROBE"

// apiaryProbe logs a probe and reports whether it is left out because it
// is SCTP's and the kernel has none: the probe then counts as met, and the
// test's TCP and UDP probes decide.
func apiaryProbe(t *testing.T, protocol, namespace, pod, host string, port int32, shouldConnect bool) bool {
	skip := protocol == "sctp" && apiaryNoSCTP()
	t.Logf("%s %s %s/%s -> %s:%d connect=%t skipped=%t", apiaryProbeLog, protocol, namespace, pod, host, port, shouldConnect, skip)
	return skip
}
