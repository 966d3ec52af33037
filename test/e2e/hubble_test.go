package e2e

// Hubble's observer API end to end: the real hubble CLI (the reference's,
// built by scripts/hubble-testbin) against the shipped agent, reading the
// flows of pods that are network namespaces with a veth and a kubelet
// cgroup.

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	flowpb "github.com/cilium/cilium/api/v1/flow"
	observerpb "github.com/cilium/cilium/api/v1/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/apiary-net/apiary/internal/testenv"
)

const (
	uidHbA   = "1a1a1a1a-0000-4000-8000-0000000000a8"
	uidHbB   = "1b1b1b1b-0000-4000-8000-0000000000b8"
	hbGw4    = "10.238.0.1"
	hbA4     = "10.238.0.11"
	hbB4     = "10.238.0.12"
	hbFake4  = "10.238.0.99"
	hbGw6    = "fd00:e8::1"
	hbA6     = "fd00:e8::11"
	hbB6     = "fd00:e8::12"
	hubbleNS = "shop"
	// hbSvc4 is the ClusterIP of shop/web, whose backend is the node's
	// 8080.
	hbSvc4 = "10.96.238.80"
)

// hubblePods: hba in namespace shop, whose egress policy lets it reach
// the node on TCP 8080 only; hbb in default, without policy.
const hubblePods = `apiVersion: v1
kind: Namespace
metadata: {name: shop}
---
apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: Pod
metadata:
  name: hba
  generateName: hba-7c9d5-
  namespace: shop
  uid: ` + uidHbA + `
  labels: {app: hba, pod-template-hash: 7c9d5}
  ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, name: hba-7c9d5, uid: 1a1a1a1a-0000-4000-8000-0000000000a9, controller: true}]
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + hbA4 + `, podIPs: [{ip: ` + hbA4 + `}]}
---
apiVersion: v1
kind: Pod
metadata:
  name: hbb
  generateName: hbb-
  namespace: default
  uid: ` + uidHbB + `
  labels: {app: hbb}
  ownerReferences: [{apiVersion: apps/v1, kind: DaemonSet, name: hbb, uid: 1b1b1b1b-0000-4000-8000-0000000000b9, controller: true}]
spec: {nodeName: e2e-node, containers: [{name: c, image: busybox}]}
status: {phase: Running, podIP: ` + hbB4 + `, podIPs: [{ip: ` + hbB4 + `}]}
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: hba-egress, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: hba}}
  egress:
  - toEntities: [host]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: ` + hbSvc4 + `
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["` + hbGw4 + `"], conditions: {ready: true}}]
`

// hubbleFlow is a line of `hubble observe -o json`, reduced to what the
// test checks.
type hubbleFlow struct {
	Flow struct {
		Time    time.Time `json:"time"`
		Verdict string    `json:"verdict"`
		IP      struct {
			Source      string `json:"source"`
			Destination string `json:"destination"`
		} `json:"IP"`
		L4 struct {
			TCP *struct {
				DestinationPort int `json:"destination_port"`
			} `json:"TCP"`
			UDP *struct {
				DestinationPort int `json:"destination_port"`
			} `json:"UDP"`
		} `json:"l4"`
		DestinationService struct{ Name, Namespace string } `json:"destination_service"`
		DestinationNames   []string                         `json:"destination_names"`
		SockXlatePoint     string                           `json:"sock_xlate_point"`
		Source             hubbleEndpoint                   `json:"source"`
		Destination        hubbleEndpoint                   `json:"destination"`
		NodeName           string                           `json:"node_name"`
		TrafficDirection   string                           `json:"traffic_direction"`
		DropReasonDesc     string                           `json:"drop_reason_desc"`
		EventType          struct {
			Type int `json:"type"`
		} `json:"event_type"`
		EgressAllowedBy []struct{ Name, Namespace, Kind string } `json:"egress_allowed_by"`
		L7              *struct {
			Type string `json:"type"`
			DNS  *struct {
				Query string   `json:"query"`
				IPs   []string `json:"ips"`
				Rcode int      `json:"rcode"`
			} `json:"dns"`
		} `json:"l7"`
	} `json:"flow"`
}

type hubbleEndpoint struct {
	Identity  int                           `json:"identity"`
	Namespace string                        `json:"namespace"`
	PodName   string                        `json:"pod_name"`
	Labels    []string                      `json:"labels"`
	Workloads []struct{ Kind, Name string } `json:"workloads"`
}

// workload is the endpoint's one workload, "Kind/name", "" for none.
func (e hubbleEndpoint) workload() string {
	if len(e.Workloads) != 1 {
		return fmt.Sprint(e.Workloads)
	}
	return e.Workloads[0].Kind + "/" + e.Workloads[0].Name
}

func (f hubbleFlow) dstPort() int {
	switch {
	case f.Flow.L4.TCP != nil:
		return f.Flow.L4.TCP.DestinationPort
	case f.Flow.L4.UDP != nil:
		return f.Flow.L4.UDP.DestinationPort
	}
	return 0
}

func (f hubbleFlow) String() string {
	return fmt.Sprintf("%s %s %s/%s -> %s/%s %s:%d %s type=%d",
		f.Flow.Time.Format(time.StampMicro), f.Flow.Verdict, f.Flow.Source.Namespace, f.Flow.Source.PodName,
		f.Flow.Destination.Namespace, f.Flow.Destination.PodName, f.Flow.IP.Destination, f.dstPort(),
		f.Flow.DropReasonDesc, f.Flow.EventType.Type)
}

func parseHubbleFlows(t *testing.T, out string) []hubbleFlow {
	t.Helper()
	var flows []hubbleFlow
	for line := range strings.Lines(out) {
		if strings.TrimSpace(line) == "" {
			continue
		}
		var f hubbleFlow
		if err := json.Unmarshal([]byte(line), &f); err != nil {
			t.Fatalf("hubble printed %q: %v", line, err)
		}
		flows = append(flows, f)
	}
	return flows
}

// hubbleCLI runs the hubble CLI against the agent's socket.
type hubbleCLI struct{ bin, server string }

func (h hubbleCLI) run(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command(h.bin, append(args, "--server", h.server)...)
	cmd.Env = cleanEnv()
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("hubble %s: %v: %s%s", strings.Join(args, " "), err, out, stderr)
	}
	return string(out)
}

func (h hubbleCLI) observe(t *testing.T, args ...string) []hubbleFlow {
	t.Helper()
	return parseHubbleFlows(t, h.run(t, append([]string{"observe", "-o", "json"}, args...)...))
}

// startHubbleAgent starts the agent with pods hba and hbb, Hubble on a
// socket of its own, and returns the pods and the CLI.
func startHubbleAgent(t *testing.T, flags ...string) (*agent, *ifPod, *ifPod, hubbleCLI, string) {
	testenv.RequireRoot(t)
	testenv.RequireProgram(t, "ip")
	bin := testenv.RequireHubble(t, repoRoot)
	root := testenv.Cgroup(t)
	podA := makeIfPodVia(t, root, uidHbA, "hba", hbGw4, hbGw6, hbA4, hbA6)
	podB := makeIfPodVia(t, root, uidHbB, "hbb", hbGw4, hbGw6, hbB4, hbB6)
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "objects.yaml"), hubblePods)
	sock := filepath.Join(t.TempDir(), "hubble.sock")
	a := startAgent(t, agentOptions{configDir: configDir, flags: append([]string{
		"--node-name=e2e-node", "--cgroup-root=" + root, "--node-ips=" + hbGw4,
		"--enable-hubble", "--hubble-socket-path=" + sock,
	}, flags...)})
	a.waitPodInterfaces(t, map[string]string{"shop/hba": podA.hostIf, "default/hbb": podB.hostIf})
	return a, podA, podB, hubbleCLI{bin: bin, server: "unix://" + sock}, sock
}

// TestHubble: the hubble CLI reads the agent's flows — socket-level
// verdicts with the policy that allowed them, the default deny, a spoofed
// packet dropped on the pod's interface — filtered as the CLI asks, past
// and followed, and they are the verdicts apiary monitor shows.
func TestHubble(t *testing.T) {
	t.Parallel()
	a, podA, podB, h, _ := startHubbleAgent(t, "--hubble-event-buffer-capacity=1000", "--enable-socket-lb")
	listen(t, hbGw4+":8080", hbGw4+":8081", hbGw4+":8082")
	mon := startProcess(t, "apiary monitor", nil, apiaryBin, "monitor", "-o", "json", "--server", "http://"+a.addr)
	// The monitor's stream starts with what comes after it connects.
	testenv.Eventually(t, waitTimeout, "apiary monitor connects", func() (bool, string) {
		podB.run(t, true, connectEnv+"="+hbGw4+":8080")
		return strings.Contains(mon.log.String(), "default/hbb"), mon.log.Tail(3)
	})

	testenv.Eventually(t, waitTimeout, "hba reaches the node on 8080", func() (bool, string) {
		got := podA.run(t, true, connectEnv+"="+hbGw4+":8080")
		return strings.HasPrefix(got, "ok"), got
	})
	if got := podA.run(t, true, connectEnv+"="+hbGw4+":8081"); got != "EPERM" {
		t.Fatalf("hba to 8081: %s, want EPERM", got)
	}
	podA.run(t, true, pktMACEnv+"="+hostMACOf(t, podA), pktSendEnv+"="+hbFake4+">"+hbGw4+":7002:forged")

	// Each kind of flow is there, as the reference's flows say it.
	var all []hubbleFlow
	var allowed, denied, spoofed *hubbleFlow
	testenv.Eventually(t, waitTimeout, "hubble observe shows the allowed, denied and spoofed flows", func() (bool, string) {
		all = h.observe(t, "--last", "1000")
		allowed, denied, spoofed = nil, nil, nil
		for i, f := range all {
			switch {
			case f.Flow.Source.PodName == "hba" && f.dstPort() == 8080 && f.Flow.Verdict == "FORWARDED":
				allowed = &all[i]
			case f.Flow.Source.PodName == "hba" && f.dstPort() == 8081 && f.Flow.Verdict == "DROPPED":
				denied = &all[i]
			case f.Flow.IP.Source == hbFake4 && f.Flow.Verdict == "DROPPED":
				spoofed = &all[i]
			}
		}
		return allowed != nil && denied != nil && spoofed != nil, fmt.Sprint(all)
	})
	if e := allowed.Flow; e.Source.Namespace != hubbleNS || e.TrafficDirection != "EGRESS" || e.NodeName != "e2e-node" ||
		e.EventType.Type != 5 || e.Source.Identity == 0 || !containsStr(e.Source.Labels, "k8s:app=hba") ||
		len(e.EgressAllowedBy) != 1 || e.EgressAllowedBy[0].Name != "hba-egress" || e.EgressAllowedBy[0].Namespace != hubbleNS ||
		e.EgressAllowedBy[0].Kind != "CiliumNetworkPolicy" || e.Source.workload() != "Deployment/hba" {
		t.Errorf("allowed flow: %+v", e)
	}
	if e := denied.Flow; e.DropReasonDesc != "POLICY_DENIED" || e.EventType.Type != 5 || e.TrafficDirection != "EGRESS" {
		t.Errorf("denied flow: %+v", e)
	}
	if e := spoofed.Flow; e.DropReasonDesc != "INVALID_SOURCE_IP" || e.EventType.Type != 1 ||
		e.Source.PodName != "hba" || e.Source.Namespace != hubbleNS {
		t.Errorf("spoofed flow: %+v", e)
	}

	// The same verdicts apiary monitor showed, at the same instants.
	testenv.Eventually(t, waitTimeout, "apiary monitor shows the denied verdict hubble shows", func() (bool, string) {
		for line := range strings.Lines(mon.log.String()) {
			var v struct {
				Time                              time.Time
				Endpoint, Dst, Verdict, Direction string
			}
			if json.Unmarshal([]byte(line), &v) == nil && v.Endpoint == "shop/hba" && v.Dst == hbGw4+":8081" && v.Verdict == "denied" {
				return v.Time.Equal(denied.Flow.Time), fmt.Sprintf("monitor %s, hubble %s", v.Time, denied.Flow.Time)
			}
		}
		return false, mon.log.Tail(5)
	})

	t.Run("status", func(t *testing.T) {
		out := h.run(t, "status")
		if !strings.Contains(out, "Healthcheck") || !strings.Contains(out, "Ok") || !strings.Contains(out, "/1,000") {
			t.Errorf("hubble status:\n%s", out)
		}
	})
	t.Run("last", func(t *testing.T) {
		got := h.observe(t, "--last", "2")
		// The two most recent, oldest first (flows may have come since
		// all was read, none before).
		if len(got) != 2 || got[0].Flow.Time.After(got[1].Flow.Time) || got[1].Flow.Time.Before(all[len(all)-1].Flow.Time) {
			t.Errorf("--last 2: %v; all: %v", got, all)
		}
		if first := h.observe(t, "--first", "1"); len(first) != 1 || !first[0].Flow.Time.Equal(all[0].Flow.Time) {
			t.Errorf("--first 1: %v, want %v", first, all[0])
		}
	})
	t.Run("namespace", func(t *testing.T) {
		got := h.observe(t, "--last", "1000", "--namespace", hubbleNS)
		if len(got) < 3 {
			t.Errorf("--namespace %s: %v", hubbleNS, got)
		}
		for _, f := range got {
			if f.Flow.Source.Namespace != hubbleNS && f.Flow.Destination.Namespace != hubbleNS {
				t.Errorf("--namespace %s: %v", hubbleNS, f)
			}
		}
		for _, f := range h.observe(t, "--last", "1000", "--namespace", "default") {
			if f.Flow.Source.PodName == "hba" {
				t.Errorf("--namespace default: %v", f)
			}
		}
	})
	t.Run("pod", func(t *testing.T) {
		got := h.observe(t, "--last", "1000", "--pod", "default/hbb")
		if len(got) == 0 {
			t.Error("--pod default/hbb: nothing")
		}
		for _, f := range got {
			if f.Flow.Source.PodName != "hbb" && f.Flow.Destination.PodName != "hbb" {
				t.Errorf("--pod default/hbb: %v", f)
			}
		}
	})
	t.Run("verdict", func(t *testing.T) {
		got := h.observe(t, "--last", "1000", "--verdict", "DROPPED")
		if len(got) < 2 {
			t.Errorf("--verdict DROPPED: %v", got)
		}
		for _, f := range got {
			if f.Flow.Verdict != "DROPPED" {
				t.Errorf("--verdict DROPPED: %v", f)
			}
		}
	})
	t.Run("type", func(t *testing.T) {
		pv := h.observe(t, "--last", "1000", "--type", "policy-verdict")
		drops := h.observe(t, "--last", "1000", "--type", "drop")
		for _, f := range pv {
			if f.Flow.EventType.Type != 5 {
				t.Errorf("--type policy-verdict: %v", f)
			}
		}
		if len(drops) == 0 || len(pv) == 0 {
			t.Errorf("--type drop: %v; --type policy-verdict: %v", drops, pv)
		}
		for _, f := range drops {
			if f.Flow.EventType.Type != 1 {
				t.Errorf("--type drop: %v", f)
			}
		}
	})
	t.Run("port and ip", func(t *testing.T) {
		got := h.observe(t, "--last", "1000", "--to-port", "8081", "--from-ip", hbA4)
		if len(got) == 0 {
			t.Error("--to-port 8081 --from-ip: nothing")
		}
		for _, f := range got {
			if f.dstPort() != 8081 || f.Flow.IP.Source != hbA4 {
				t.Errorf("--to-port 8081 --from-ip %s: %v", hbA4, f)
			}
		}
	})
	t.Run("label", func(t *testing.T) {
		got := h.observe(t, "--last", "1000", "--from-label", "app=hba")
		if len(got) == 0 {
			t.Error("--from-label app=hba: nothing")
		}
		for _, f := range got {
			if f.Flow.Source.PodName != "hba" {
				t.Errorf("--from-label app=hba: %v", f)
			}
		}
	})
	t.Run("workload", func(t *testing.T) {
		// hba's ReplicaSet is the Deployment hba's; hbb is the DaemonSet hbb's.
		got := h.observe(t, "--last", "1000", "--from-workload", "Deployment/hba")
		if len(got) < 3 {
			t.Errorf("--from-workload Deployment/hba: %v", got)
		}
		for _, f := range got {
			if f.Flow.Source.PodName != "hba" || f.Flow.Source.workload() != "Deployment/hba" {
				t.Errorf("--from-workload Deployment/hba: %v %s", f, f.Flow.Source.workload())
			}
		}
		got = h.observe(t, "--last", "1000", "--workload", "hbb")
		if len(got) == 0 {
			t.Error("--workload hbb: nothing")
		}
		for _, f := range got {
			if f.Flow.Source.workload() != "DaemonSet/hbb" && f.Flow.Destination.workload() != "DaemonSet/hbb" {
				t.Errorf("--workload hbb: %v", f)
			}
		}
		if got := h.observe(t, "--last", "1000", "--from-workload", "ReplicaSet/hba-7c9d5"); len(got) != 0 {
			t.Errorf("--from-workload ReplicaSet/hba-7c9d5: %v", got)
		}
	})
	t.Run("bad filter", func(t *testing.T) {
		cmd := exec.Command(h.bin, "observe", "--server", h.server, "--interface", "eth0")
		if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "not supported") {
			t.Errorf("--interface: %v: %s", err, out)
		}
	})
	t.Run("service", func(t *testing.T) {
		// The socket LB translates the ClusterIP to the backend; the
		// flow is to the backend, of the Service.
		testenv.Eventually(t, waitTimeout, "hba reaches shop/web's ClusterIP", func() (bool, string) {
			got := podA.run(t, true, connectEnv+"="+hbSvc4+":80")
			return strings.HasPrefix(got, "ok"), got
		})
		got := h.observe(t, "--last", "1000", "--to-service", hubbleNS+"/web", "--type", "policy-verdict")
		if len(got) == 0 {
			t.Fatal("--to-service shop/web: nothing")
		}
		for _, f := range got {
			if f.Flow.IP.Destination != hbGw4 || f.dstPort() != 8080 || f.Flow.DestinationService.Name != "web" ||
				f.Flow.DestinationService.Namespace != hubbleNS {
				t.Errorf("--to-service shop/web: %v %+v", f, f.Flow.DestinationService)
			}
		}
		// The translation itself, as the reference's trace-sock flows:
		// hba's socket to the frontend, then to the backend.
		var pre, post bool
		testenv.Eventually(t, waitTimeout, "hubble observe --type trace-sock shows the translation", func() (bool, string) {
			xl := h.observe(t, "--last", "1000", "--type", "trace-sock", "--from-pod", hubbleNS+"/hba")
			pre, post = false, false
			for _, f := range xl {
				if f.Flow.IP.Source != hbA4 || f.Flow.DestinationService.Name != "web" || f.Flow.DestinationService.Namespace != hubbleNS ||
					f.Flow.EventType.Type != 7 || f.Flow.Source.workload() != "Deployment/hba" {
					t.Errorf("--type trace-sock: %v %+v", f, f.Flow)
				}
				switch {
				case f.Flow.SockXlatePoint == "SOCK_XLATE_POINT_PRE_DIRECTION_FWD":
					pre = pre || (f.Flow.Verdict == "TRACED" && f.Flow.IP.Destination == hbSvc4 && f.dstPort() == 80)
				case f.Flow.SockXlatePoint == "SOCK_XLATE_POINT_POST_DIRECTION_FWD":
					post = post || (f.Flow.Verdict == "TRANSLATED" && f.Flow.IP.Destination == hbGw4 && f.dstPort() == 8080)
				}
			}
			return pre && post, fmt.Sprintf("pre-xlate-fwd %t, post-xlate-fwd %t: %v", pre, post, xl)
		})
		// As the CLI prints them: the frontend by its Service's name.
		if out := h.run(t, "observe", "--last", "1000", "--type", "trace-sock", "--to-ip", hbSvc4); !strings.Contains(out,
			"shop/hba (ID:") || !strings.Contains(out, "-> shop/web:80 (unknown) pre-xlate-fwd TRACED (TCP)") {
			t.Errorf("hubble observe --type trace-sock --to-ip %s:\n%s", hbSvc4, out)
		}
	})
	t.Run("follow", func(t *testing.T) {
		f := startProcess(t, "hubble observe --follow", nil, h.bin, "observe", "--follow", "-o", "json",
			"--server", h.server, "--pod", hubbleNS+"/hba", "--to-port", "8082")
		testenv.Eventually(t, waitTimeout, "the follower sees a new flow", func() (bool, string) {
			podA.run(t, true, connectEnv+"="+hbGw4+":8082")
			for line := range strings.Lines(f.log.String()) {
				var hf hubbleFlow
				if json.Unmarshal([]byte(line), &hf) == nil && hf.dstPort() == 8082 && hf.Flow.Verdict == "DROPPED" {
					return true, ""
				}
			}
			return false, f.log.Tail(5)
		})
		for line := range strings.Lines(f.log.String()) {
			var hf hubbleFlow
			if json.Unmarshal([]byte(line), &hf) == nil && (hf.dstPort() != 8082 || hf.Flow.Source.PodName != "hba") {
				t.Errorf("follower with --to-port 8082: %v", hf)
			}
		}
	})
	t.Run("metrics", func(t *testing.T) {
		for _, series := range []string{
			`hubble_flows_processed_total{protocol="TCP",subtype="",type="PolicyVerdict",verdict="DROPPED"}`,
			`hubble_drop_total{protocol="UDP",reason="INVALID_SOURCE_IP"}`,
			`hubble_policy_verdicts_total{action="forwarded",direction="egress",match="l3-l4"}`,
		} {
			if n, err := a.labelledMetric(series); err != nil || n < 1 {
				t.Errorf("%s: %v %v", series, n, err)
			}
		}
	})
}

func containsStr(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

// TestHubbleStuckFollower: a follower that never reads does not hold up
// the agent: other followers get every new flow, past flows answer, and
// once the stuck one reads again it is told how many it lost.
func TestHubbleStuckFollower(t *testing.T) {
	// Not parallel: it uses TestHubble's pods (names, addresses).
	a, podA, podB, h, sock := startHubbleAgent(t, "--hubble-event-buffer-capacity=64")
	listen(t, hbGw4+":8080")
	// Fixed windows (no BDP estimation, which would let the client take
	// megabytes unread): a follower that does not read stops the server's
	// sends after 64 KiB.
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(1<<16), grpc.WithInitialConnWindowSize(1<<16))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stuck, err := observerpb.NewObserverClient(conn).GetFlows(ctx, &observerpb.GetFlowsRequest{Follow: true})
	if err != nil {
		t.Fatal(err)
	}
	// A reading follower, through the CLI.
	follower := startProcess(t, "hubble observe --follow", nil, h.bin, "observe", "--follow", "-o", "json",
		"--server", h.server, "--to-port", "8080")

	// Far more flows than the ring, the stream's windows and the socket
	// hold: 20,000 datagrams from hbb, each to another peer.
	for range 4 {
		podB.run(t, true, floodEnv+"=5000")
	}
	// Not all 20,000 need to arrive: on a loaded machine the datapath's
	// per-pod event budget drops some before the agent reads them. A few
	// thousand already overflow the ring (64) and the stream's 64 KiB.
	if n, err := a.labelledMetric(`hubble_flows_processed_total{protocol="UDP",subtype="",type="PolicyVerdict",verdict="FORWARDED"}`); err != nil || n < 2000 {
		t.Fatalf("flows of the flood: %v %v", n, err)
	}
	// The agent is not held up: a new flow reaches the reading follower.
	testenv.Eventually(t, waitTimeout, "the reading follower sees a flow after the flood", func() (bool, string) {
		podA.run(t, true, connectEnv+"="+hbGw4+":8080")
		return strings.Contains(follower.log.String(), `"destination_port":8080`), follower.log.Tail(3)
	})
	if got := h.observe(t, "--last", "5"); len(got) != 5 {
		t.Errorf("--last 5 after the flood: %v", got)
	}
	// The stuck follower, reading at last, learns what it lost: read up
	// to the flows that came after the flood, adding up the losses.
	var lost uint64
	deadline := time.Now().Add(waitTimeout)
	for time.Now().Before(deadline) {
		resp, err := stuck.Recv()
		if err != nil {
			t.Fatalf("stuck follower: %v", err)
		}
		if le := resp.GetLostEvents(); le != nil {
			if le.GetSource() != flowpb.LostEventSource_HUBBLE_RING_BUFFER {
				t.Errorf("lost events from %v", le.GetSource())
			}
			lost += le.GetNumEventsLost()
		}
		if resp.GetFlow().GetL4().GetTCP().GetDestinationPort() == 8080 {
			break
		}
	}
	// Of the flood's 20,000 flows, all but what the windows, the socket
	// and the ring held were lost to it, not queued for it.
	if lost < 10000 {
		t.Errorf("the stuck follower was told it lost %d flows, want most of the flood's 20,000", lost)
	}
	t.Logf("the stuck follower lost %d flows", lost)
}

// TestHubbleDNS: the DNS proxy's queries are Hubble's L7 DNS flows — the
// query, and the answer with its rcode and addresses, or the refused
// query dropped — and `hubble observe --protocol dns` finds them.
func TestHubbleDNS(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	bin := testenv.RequireHubble(t, repoRoot)
	digBin := testenv.RequireProgram(t, "dig")
	resolver, allowedIP, _ := startResolver(t)
	root := testenv.Cgroup(t)
	cgA, _, _ := mkCgroups(t, root)
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(t, filepath.Join(configDir, "dns.yaml"), fmt.Sprintf(dnsPolicy, resolver))
	sock := filepath.Join(t.TempDir(), "hubble.sock")
	proxy := net.JoinHostPort("127.0.0.1", fmt.Sprint(freePort(t)))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root,
		"--dns-proxy-addr=" + proxy, "--dns-upstream=127.0.0.1:1",
		"--dns-trusted-resolvers=" + resolver,
		"--enable-hubble", "--hubble-socket-path=" + sock,
	}})
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny"})
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")
	h := hubbleCLI{bin: bin, server: "unix://" + sock}

	dig := func(name string) string {
		out, err := digIn(cgA, digBin, resolver, name, false)
		if err != nil {
			t.Fatalf("dig %s: %v: %s", name, err, out)
		}
		status, _ := answerOf(out)
		return status
	}
	if got := dig("www.allowed.test"); got != "NOERROR" {
		t.Fatalf("dig www.allowed.test: %s", got)
	}
	if got := dig("www.denied.test"); got != "REFUSED" {
		t.Fatalf("dig www.denied.test: %s", got)
	}

	var query, answer, refused bool
	var flows []hubbleFlow
	testenv.Eventually(t, waitTimeout, "hubble observe --protocol dns shows the queries", func() (bool, string) {
		flows = h.observe(t, "--last", "100", "--protocol", "dns")
		query, answer, refused = false, false, false
		for _, f := range flows {
			l7 := f.Flow.L7
			if l7 == nil || l7.DNS == nil {
				t.Errorf("--protocol dns: %v", f)
				continue
			}
			switch {
			case l7.DNS.Query == "www.allowed.test." && l7.Type == "REQUEST" && f.Flow.Verdict == "FORWARDED":
				query = f.Flow.Source.PodName == "client-a" && f.Flow.IP.Destination == resolver && f.dstPort() == 53
			case l7.DNS.Query == "www.allowed.test." && l7.Type == "RESPONSE":
				answer = l7.DNS.Rcode == 0 && containsStr(l7.DNS.IPs, allowedIP) && f.Flow.Destination.PodName == "client-a"
			case l7.DNS.Query == "www.denied.test." && l7.Type == "REQUEST":
				refused = f.Flow.Verdict == "DROPPED"
			}
		}
		return query && answer && refused, fmt.Sprintf("query %t answer %t refused %t: %v", query, answer, refused, flows)
	})
	if got := h.observe(t, "--last", "100", "--protocol", "dns", "--verdict", "DROPPED"); len(got) != 1 || got[0].Flow.L7.DNS.Query != "www.denied.test." {
		t.Errorf("--protocol dns --verdict DROPPED: %v", got)
	}
	if n, err := a.labelledMetric(`hubble_dns_responses_total{ips_returned="1",qtypes="A",rcode="No Error"}`); err != nil || n < 1 {
		t.Errorf("hubble_dns_responses_total: %v %v", n, err)
	}
}

// hubbleFQDNPolicy lets client-a ask the resolver anything and reach
// *.example.test on TCP 8080.
const hubbleFQDNPolicy = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: fqdn-client, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toCIDR: [%s/32]
    toPorts:
    - ports: [{port: "53", protocol: ANY}]
      rules: {dns: [{matchPattern: "*"}]}
  - toFQDNs: [{matchPattern: "*.example.test"}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
`

// TestHubbleToFQDN: after a pod resolved api.example.test through the DNS
// proxy (dnsmasq on a loopback address answering it), its connection to
// the answer's address carries the name, and `hubble observe --to-fqdn
// '*.example.test'` finds that connection and no other flow.
func TestHubbleToFQDN(t *testing.T) {
	t.Parallel()
	testenv.RequireRoot(t)
	bin := testenv.RequireHubble(t, repoRoot)
	digBin := testenv.RequireProgram(t, "dig")
	dnsmasq := testenv.RequireProgram(t, "dnsmasq", "/usr/sbin")
	x := 1 + rand.IntN(250)
	resolver, exampleIP, otherIP := fmt.Sprintf("127.54.%d.1", x), fmt.Sprintf("127.54.%d.2", x), fmt.Sprintf("127.54.%d.3", x)
	startProcess(t, "dnsmasq", nil, dnsmasq,
		"--keep-in-foreground", "--conf-file=/dev/null", "--pid-file",
		"--no-resolv", "--no-hosts", "--listen-address="+resolver, "--bind-interfaces",
		"--port=53", "--log-queries", "--log-facility=-", "--local-ttl=300",
		"--address=/example.test/"+exampleIP, "--address=/other.test/"+otherIP)
	testenv.Eventually(t, waitTimeout, "dnsmasq to answer on "+resolver, func() (bool, string) {
		out, err := digIn("", digBin, resolver, "api.example.test", false)
		return err == nil && strings.Contains(out, exampleIP), out
	})
	listen(t, exampleIP+":8080", otherIP+":8080")
	root := testenv.Cgroup(t)
	cgA, _, _ := mkCgroups(t, root)
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "pods.yaml"), policyPods)
	writeFile(t, filepath.Join(configDir, "dns.yaml"), fmt.Sprintf(hubbleFQDNPolicy, resolver))
	sock := filepath.Join(t.TempDir(), "hubble.sock")
	proxy := net.JoinHostPort("127.0.0.1", fmt.Sprint(freePort(t)))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--node-name=e2e-node", "--cgroup-root=" + root,
		"--dns-proxy-addr=" + proxy, "--dns-upstream=127.0.0.1:1",
		"--dns-trusted-resolvers=" + resolver,
		"--enable-hubble", "--hubble-socket-path=" + sock,
	}})
	a.waitEndpointPolicy(t, map[string]string{"default/client-a": "off default-deny"})
	a.waitLog(t, "Intercepting the DNS of endpoints with DNS rules")
	h := hubbleCLI{bin: bin, server: "unix://" + sock}

	for name, ip := range map[string]string{"api.example.test": exampleIP, "www.other.test": otherIP} {
		out, err := digIn(cgA, digBin, resolver, name, false)
		if status, ips := answerOf(out); err != nil || status != "NOERROR" || len(ips) != 1 || ips[0] != ip {
			t.Fatalf("dig %s from client-a: %v: %s", name, err, out)
		}
	}
	if got := connectFrom(t, cgA, exampleIP+":8080", ""); got != "ok: hello from "+exampleIP+":8080" {
		t.Fatalf("client-a to api.example.test's %s: %s", exampleIP, got)
	}
	if got := connectFrom(t, cgA, otherIP+":8080", ""); got != "EPERM" {
		t.Fatalf("client-a to www.other.test's %s: %s, want EPERM", otherIP, got)
	}

	var got []hubbleFlow
	testenv.Eventually(t, waitTimeout, "hubble observe --to-fqdn '*.example.test' shows the connection", func() (bool, string) {
		got = h.observe(t, "--last", "1000", "--to-fqdn", "*.example.test")
		return len(got) > 0, fmt.Sprint(h.observe(t, "--last", "1000"))
	})
	for _, f := range got {
		if f.Flow.IP.Destination != exampleIP || f.dstPort() != 8080 || f.Flow.Verdict != "FORWARDED" ||
			f.Flow.Source.PodName != "client-a" || !containsStr(f.Flow.DestinationNames, "api.example.test") {
			t.Errorf("--to-fqdn '*.example.test': %v names %v", f, f.Flow.DestinationNames)
		}
	}
	// The flows the pattern leaves out are there: the queries, the denied
	// connection to www.other.test's address.
	var denied bool
	for _, f := range h.observe(t, "--last", "1000", "--from-pod", "default/client-a") {
		denied = denied || (f.Flow.IP.Destination == otherIP && f.Flow.Verdict == "DROPPED")
	}
	if !denied {
		t.Error("no denied flow to www.other.test's address")
	}
}

// TestHubbleLoad: 1,000 flows a second for a minute (-short: ten seconds)
// with three followers reading: each follower keeps up (it gets the flows
// of the last second, losing none), and the agent's memory does not grow
// with the flows seen (the ring is bounded).
func TestHubbleLoad(t *testing.T) {
	duration := time.Minute
	if testing.Short() {
		duration = 10 * time.Second
	}
	a, _, podB, _, sock := startHubbleAgent(t)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	type count struct {
		flows, lost uint64
		last        time.Time
	}
	counts := make([]chan count, 3)
	for i := range counts {
		s, err := observerpb.NewObserverClient(conn).GetFlows(ctx, &observerpb.GetFlowsRequest{Follow: true})
		if err != nil {
			t.Fatal(err)
		}
		counts[i] = make(chan count, 1)
		go func() {
			var c count
			for {
				resp, err := s.Recv()
				if err != nil {
					counts[i] <- c
					return
				}
				if le := resp.GetLostEvents(); le != nil {
					c.lost += le.GetNumEventsLost()
				}
				if f := resp.GetFlow(); f != nil {
					c.flows++
					c.last = f.GetTime().AsTime()
				}
			}
		}()
	}
	rss := func() int {
		data, err := exec.Command("grep", "VmRSS", fmt.Sprintf("/proc/%d/status", a.pid())).Output()
		if err != nil {
			t.Fatal(err)
		}
		var kb int
		fmt.Sscanf(strings.TrimPrefix(strings.TrimSpace(string(data)), "VmRSS:"), "%d", &kb)
		return kb
	}
	start := time.Now()
	var rssWarm int
	for sec := 0; time.Since(start) < duration; sec++ {
		next := start.Add(time.Duration(sec+1) * time.Second)
		podB.run(t, true, floodEnv+"=1000")
		if sec == 4 {
			rssWarm = rss() // the ring full, the caches warm
		}
		time.Sleep(time.Until(next))
	}
	end := time.Now()
	rssEnd := rss()
	seen, err := a.labelledMetric(`hubble_flows_processed_total{protocol="UDP",subtype="",type="PolicyVerdict",verdict="FORWARDED"}`)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // the last flows on their way to the followers
	cancel()
	for i, ch := range counts {
		c := <-ch
		t.Logf("follower %d: %d flows, %d lost, the last at %s", i, c.flows, c.lost, c.last.Format(time.StampMilli))
		if c.lost > 0 || float64(c.flows) < seen || c.last.Before(end.Add(-2*time.Second)) {
			t.Errorf("follower %d fell behind: %d flows of %.0f, %d lost, the last at %s (the flood ended %s)",
				i, c.flows, seen, c.lost, c.last.Format(time.StampMilli), end.Format(time.StampMilli))
		}
	}
	t.Logf("%.0f flows in %s (%.0f/s); agent RSS %d KiB after 5 s, %d KiB at the end", seen, end.Sub(start).Round(time.Second),
		seen/end.Sub(start).Seconds(), rssWarm, rssEnd)
	if seen < 900*duration.Seconds() {
		t.Errorf("only %.0f flows in %s", seen, duration)
	}
	if rssEnd > rssWarm+32*1024 {
		t.Errorf("agent RSS grew from %d KiB to %d KiB", rssWarm, rssEnd)
	}
}
