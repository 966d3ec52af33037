//go:build cluster

package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/apiary-net/apiary/internal/testenv"
)

// TestMultiNodeLifecycle is the multi-node cluster living on: the agent's
// DaemonSet rolled out node by node while cross-node connections are
// checked all along, a Node object claiming a node's own address, a node
// joining the running cluster and leaving it. It takes minutes, so it
// runs only when APIARY_MULTINODE_LIFECYCLE is set (make
// conformance-multinode sets it); TestMultiNode is the fast subset.
func TestMultiNodeLifecycle(t *testing.T) {
	if os.Getenv("APIARY_MULTINODE_LIFECYCLE") == "" {
		t.Skip("APIARY_MULTINODE_LIFECYCLE is not set (make conformance-multinode)")
	}
	count := nodeCount(t)
	start := time.Now()
	n, workers := startMultiNode(t, count)
	t.Logf("%d nodes up in %s", count, time.Since(start).Round(time.Millisecond))
	pinDir := "/sys/fs/bpf/apiary"
	n.install(agentDirs{pinDir: pinDir, stateDir: workers[0].stateDir})
	n.waitAgentsReady(count)
	for _, w := range workers {
		w.waitChained(pinDir)
	}
	p := n.startMultiNodePods(workers)
	lc := &lifecycle{pinDir: pinDir}
	steps := []struct {
		name string
		run  func(t *testing.T, n *node, p *mnPods)
	}{
		{"IngressCNPByRemoteIdentity", testIngressAcrossNodes},
		{"RolloutHoldsEnforcement", testRolloutAcrossNodes},
		{"OperatorModeAcrossNodes", testOperatorModeAcrossNodes},
		{"NodeClaimingAnotherNodesAddress", testImposterNode},
		{"NodeJoins", lc.testNodeJoins},
		{"NodeLeaves", lc.testNodeLeaves},
	}
	for _, s := range steps {
		start := time.Now()
		ok := t.Run(s.name, func(t *testing.T) { s.run(t, n, p) })
		t.Logf("%s: %s", s.name, time.Since(start).Round(time.Millisecond))
		if !ok {
			return
		}
	}
}

// lifecycle is what the join and leave steps share: the node that joined.
type lifecycle struct {
	pinDir string
	joined *workerNode
	// client and other are the joined node's pods.
	client, other, server *corev1.Pod
}

// checkHeld checks once that every client reaches the server of every
// other node and no other pod does (the ingress CNP of
// testIngressAcrossNodes); it returns what went wrong.
func (p *mnPods) checkHeld(t *testing.T) []string {
	var bad []string
	across(len(p.server), func(i, j int) {
		addr := p.server[j].Status.PodIP + ":8080"
		if got := p.connect(t, p.client[i], addr); !strings.HasPrefix(got, "ok: hello from "+p.server[j].Name) {
			bad = append(bad, fmt.Sprintf("%s to %s (allowed): %s", p.client[i].Name, p.server[j].Name, got))
		}
		if got := p.connect(t, p.other[i], addr); strings.HasPrefix(got, "ok") {
			bad = append(bad, fmt.Sprintf("%s to %s (denied): %s", p.other[i].Name, p.server[j].Name, got))
		}
	})
	return bad
}

// agentPods returns the agent pods by node.
func (n *node) agentPods(t *testing.T) map[string]corev1.Pod {
	t.Helper()
	pods, err := n.cs.CoreV1().Pods("kube-system").List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=apiary-agent"})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]corev1.Pod{}
	for _, pod := range pods.Items {
		out[pod.Spec.NodeName] = pod
	}
	return out
}

// testRolloutAcrossNodes: a rollout of the agent's DaemonSet (a changed
// pod template, as kubectl rollout restart makes) replaces the agent on
// one node at a time; all the while, and on every round, the clients of
// every node reach the servers of the others and the other pods do not.
func testRolloutAcrossNodes(t *testing.T, n *node, p *mnPods) {
	rounds, roundsDown := n.rollOut(t, "restart", func() []string { return p.checkHeld(t) })
	if bad := p.checkHeld(t); len(bad) > 0 {
		t.Errorf("after the rollout: %s", strings.Join(bad, "; "))
	}
	t.Logf("%d rounds of checks during the rollout, %d of them with an agent not ready", rounds, roundsDown)
	if roundsDown == 0 {
		t.Errorf("no round of checks ran while an agent was down: the rollout went unobserved")
	}
}

// rollOut changes the agent DaemonSet's pod template (an annotation
// naming why) and waits until every agent pod has been replaced and is
// Ready. While it waits it calls check, if any, in rounds, and reports
// what a round found wrong; it returns the number of rounds and of those
// that ran while an agent was not ready.
func (n *node) rollOut(t *testing.T, why string, check func() []string) (rounds, roundsDown int) {
	t.Helper()
	ctx := context.Background()
	old := n.agentPods(t)
	patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"apiary.test/rollout":%q}}}}}`, why+" "+time.Now().Format(time.RFC3339Nano))
	if _, err := n.cs.AppsV1().DaemonSets("kube-system").Patch(ctx, "apiary-agent", types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(4 * waitTimeout)
	for {
		ds, err := n.cs.AppsV1().DaemonSets("kube-system").Get(ctx, "apiary-agent", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		now := n.agentPods(t)
		replaced := 0
		for node, pod := range now {
			if pod.UID != old[node].UID && podReady(&pod) {
				replaced++
			}
		}
		st := ds.Status
		if replaced == len(old) && st.ObservedGeneration == ds.Generation && st.UpdatedNumberScheduled == st.DesiredNumberScheduled &&
			st.NumberReady == st.DesiredNumberScheduled {
			return rounds, roundsDown
		}
		if time.Now().After(deadline) {
			t.Fatalf("the rollout (%s) did not finish: %d of %d agents replaced and ready; %+v", why, replaced, len(old), st)
		}
		if check == nil {
			time.Sleep(time.Second)
			continue
		}
		rounds++
		if st.NumberReady < st.DesiredNumberScheduled {
			roundsDown++
		}
		if bad := check(); len(bad) > 0 {
			t.Errorf("round %d of the rollout (%d of %d agents replaced, %d ready): %s", rounds, replaced, len(old), st.NumberReady, strings.Join(bad, "; "))
		}
	}
}

// agentGet asks the node's agent's API (on the node's loopback, where
// the DaemonSet's probes ask it) for path.
func (w *workerNode) agentGet(path string) (string, error) {
	out, err := exec.Command("ip", "netns", "exec", w.netns, "curl", "-sS", "-m", "5", agentAPI+path).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("GET %s on %s: %v: %s", path, w.name, err, out)
	}
	return string(out), nil
}

// nodeRows returns the nodes table of the node's agent by name.
func (w *workerNode) nodeRows() (map[string]nodeRow, error) {
	body, err := w.agentGet("/statedb/dump/nodes")
	if err != nil {
		return nil, err
	}
	var all map[string][]nodeRow
	if err := json.Unmarshal([]byte(body), &all); err != nil {
		return nil, fmt.Errorf("nodes of %s: %v: %s", w.name, err, body)
	}
	out := map[string]nodeRow{}
	for _, r := range all["nodes"] {
		out[r.Name] = r
	}
	return out, nil
}

// imposterNode is a Node object with no kubelet that claims the first
// node's address.
const imposterNode = "apiary-imposter"

// testImposterNode: a Node object claiming the first node's InternalIP is,
// to the first node's agent, a conflict, not remote-node (shown in its
// nodes table's Conflicts); to the others, whose address it is not, it is
// a remote node like any. Its pods' and the nodes' connections are as
// before.
func testImposterNode(t *testing.T, n *node, p *mnPods) {
	ctx := context.Background()
	first := p.workers[0]
	claimed := nodeIPOf(1)
	imp := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: imposterNode},
		Status:     corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: claimed}}},
	}
	created, err := n.cs.CoreV1().Nodes().Create(ctx, imp, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.deleteNode(t, imposterNode) })
	if len(created.Status.Addresses) == 0 {
		created.Status = imp.Status
		if _, err := n.cs.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, waitTimeout, first.name+"'s agent: "+imposterNode+" in conflict, its address left out", func() (bool, string) {
		rows, err := first.nodeRows()
		if err != nil {
			return false, err.Error()
		}
		r, ok := rows[imposterNode]
		return ok && len(r.Addresses) == 0 && strings.Contains(strings.Join(r.Conflicts, ";"), claimed+" is this node's address"), fmt.Sprintf("%+v", rows)
	})
	for _, w := range p.workers[1:] {
		testenv.Eventually(t, waitTimeout, w.name+"'s agent: "+imposterNode+" a remote node", func() (bool, string) {
			rows, err := w.nodeRows()
			if err != nil {
				return false, err.Error()
			}
			r, ok := rows[imposterNode]
			return ok && slices.Contains(r.Addresses, claimed) && len(r.Conflicts) == 0, fmt.Sprintf("%+v", rows)
		})
	}
	if bad := p.checkHeld(t); len(bad) > 0 {
		t.Errorf("with %s: %s", imposterNode, strings.Join(bad, "; "))
	}
	n.deleteNode(t, imposterNode)
	testenv.Eventually(t, waitTimeout, first.name+"'s agent: "+imposterNode+" gone", func() (bool, string) {
		rows, err := first.nodeRows()
		if err != nil {
			return false, err.Error()
		}
		_, ok := rows[imposterNode]
		return !ok, fmt.Sprintf("%+v", rows)
	})
}

// deleteNode deletes a Node and the pods bound to it (the pod garbage
// collector would take 40 s and more; see deleteGhostNode).
func (n *node) deleteNode(t *testing.T, name string) {
	t.Helper()
	ctx := context.Background()
	if err := n.cs.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatalf("delete node %s: %v", name, err)
	}
	zero := int64(0)
	testenv.Eventually(t, waitTimeout, "no pod on "+name, func() (bool, string) {
		pods, err := n.cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + name})
		if err != nil {
			return false, err.Error()
		}
		for _, p := range pods.Items {
			err := n.cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
			if err != nil && !apierrors.IsNotFound(err) {
				return false, fmt.Sprintf("delete pod %s/%s: %v", p.Namespace, p.Name, err)
			}
		}
		return len(pods.Items) == 0, fmt.Sprintf("%d pods on %s", len(pods.Items), name)
	})
}

// testNodeJoins: a node added to the running cluster (its namespaces,
// containerd and kubelet, routes to and from its pod CIDR) gets the
// agent from the DaemonSet; its pods are judged by the others, and the
// others' by it, under the ingress CNP; the first node's agent knows its
// address as remote-node.
func (lc *lifecycle) testNodeJoins(t *testing.T, n *node, p *mnPods) {
	bins := requirements(t)
	count := len(p.workers) + 1
	start := time.Now()
	w := n.newWorker(count)
	w.setupNetwork(count)
	for _, o := range p.workers {
		o.run("ip", "netns", "exec", o.netns, "ip", "route", "add", w.podCIDR, "via", w.ip)
	}
	w.makeNamespaces()
	w.startContainerd(bins)
	w.importImages(bins)
	w.startKubelet(bins)
	w.waitReady()
	t.Logf("node %s Ready in %s", w.name, time.Since(start).Round(time.Millisecond))
	n.waitAgentsReady(count)
	w.waitChained(lc.pinDir)
	t.Logf("apiary Ready on %s %s after it joined", w.name, time.Since(start).Round(time.Millisecond))
	p.netns[w.name] = w.netns
	lc.joined = w
	on := func(name, app string) *corev1.Pod {
		pod := testPod(fmt.Sprintf("%s-%d", name, count), map[string]string{"app": app})
		pod.Spec.NodeName = w.name
		return n.runPod(pod)
	}
	lc.client, lc.other, lc.server = on("client", "client"), on("other", "other"), on("server", "server")
	for _, s := range p.server {
		addr := s.Status.PodIP + ":8080"
		p.wantConnect(t, lc.client, addr, "ok: hello from "+s.Name)
		p.wantConnect(t, lc.other, addr, "timeout")
	}
	for i := range p.client {
		addr := lc.server.Status.PodIP + ":8080"
		p.wantConnect(t, p.client[i], addr, "ok: hello from "+lc.server.Name)
		p.wantConnect(t, p.other[i], addr, "timeout")
	}
	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: client-not-remote-node, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress: [{toEntities: [all]}]
  egressDeny: [{toEntities: [remote-node]}]
`)
	p.wantConnect(t, p.client[0], w.ip+":10250", "EPERM")
	p.wantConnect(t, lc.client, nodeIPOf(1)+":10250", "EPERM")
}

// testNodeLeaves: the joined node's kubelet stops and its Node is
// deleted (with its pods): the first node's agent drops it and its pods'
// addresses from its ipcache, and its address is no longer remote-node
// (the client's connection there is refused, not EPERM).
func (lc *lifecycle) testNodeLeaves(t *testing.T, n *node, p *mnPods) {
	if lc.joined == nil {
		t.Skip("no node joined")
	}
	w := lc.joined
	w.kubelet.stop(t)
	n.deleteNode(t, w.name)
	first := p.workers[0]
	testenv.Eventually(t, waitTimeout, first.name+"'s agent: "+w.name+" and its pods gone", func() (bool, string) {
		rows, err := first.nodeRows()
		if err != nil {
			return false, err.Error()
		}
		ipc, err := first.agentGet("/statedb/dump/ipcache")
		if err != nil {
			return false, err.Error()
		}
		_, known := rows[w.name]
		var left []string
		for _, pod := range []*corev1.Pod{lc.client, lc.other, lc.server} {
			if strings.Contains(ipc, `"`+pod.Status.PodIP+`/32"`) {
				left = append(left, pod.Name)
			}
		}
		return !known && len(left) == 0, fmt.Sprintf("%s known: %v; pods left in the ipcache: %v", w.name, known, left)
	})
	testenv.Eventually(t, waitTimeout, p.client[0].Name+" to "+w.name+"'s address: no longer remote-node", func() (bool, string) {
		got := p.connect(t, p.client[0], w.ip+":10250")
		return !strings.HasPrefix(got, "EPERM") && !strings.HasPrefix(got, "ask the pod"), got
	})
}
