//go:build cluster

package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"

	"github.com/apiary-net/apiary/internal/testenv"
)

// ghostNode is a Node object with no kubelet behind it, standing for
// another node of the cluster; ghostAddr, its InternalIP, is an address
// of the node's bridge subnet that nothing answers.
const (
	ghostNode = "apiary-ghost-node"
	ghostAddr = "10.253.0.250"
)

// nodeRow is what the test reads of a nodes row.
type nodeRow struct {
	Name      string   `json:"name"`
	Local     bool     `json:"local"`
	Addresses []string `json:"addresses"`
	Conflicts []string `json:"conflicts"`
}

// nodesTable returns the agent's nodes table by name.
func nodesTable(t *testing.T) (map[string]nodeRow, error) {
	t.Helper()
	code, body, err := httpGet(agentAPI + "/statedb/dump/nodes")
	if err != nil || code != http.StatusOK {
		return nil, fmt.Errorf("GET /statedb/dump/nodes: %d %v %s", code, err, body)
	}
	var all map[string][]nodeRow
	if err := json.Unmarshal([]byte(body), &all); err != nil {
		return nil, fmt.Errorf("GET /statedb/dump/nodes: %v: %s", err, body)
	}
	out := map[string]nodeRow{}
	for _, r := range all["nodes"] {
		out[r.Name] = r
	}
	return out, nil
}

// testRemoteNode: the agent, installed from deploy/ (RBAC for nodes),
// knows its own node from the Node object; another Node object's
// InternalIP becomes remote-node, so a pod whose egress allows everything
// but remote-node gets EPERM connecting to it, and once that Node is
// deleted no longer does.
func testRemoteNode(t *testing.T, n *node, w *workloads) {
	ctx := context.Background()
	testenv.Eventually(t, waitTimeout, "node "+nodeName+" local in the nodes table", func() (bool, string) {
		rows, err := nodesTable(t)
		if err != nil {
			return false, err.Error()
		}
		r := rows[nodeName]
		return r.Local && slices.Contains(r.Addresses, nodeIP), fmt.Sprintf("%+v", rows)
	})

	n.createPolicy(t, `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: other-not-remote-node, namespace: `+ns+`}
spec:
  endpointSelector: {matchLabels: {app: other}}
  egress: [{toEntities: [all]}]
  egressDeny: [{toEntities: [remote-node]}]
`)
	cnps := n.dynamic(t).Resource(schema.GroupVersionResource{Group: "cilium.io", Version: "v2", Resource: "ciliumnetworkpolicies"}).Namespace(ns)
	t.Cleanup(func() { cnps.Delete(ctx, "other-not-remote-node", metav1.DeleteOptions{}) })
	addr := ghostAddr + ":8080"
	// Nothing answers: the world's connection times out.
	wantConnect(t, w.other, addr, "timeout")

	ghost := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: ghostNode},
		Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{
			{Type: corev1.NodeInternalIP, Address: ghostAddr},
			{Type: corev1.NodeHostName, Address: ghostNode},
		}},
	}
	created, err := n.cs.CoreV1().Nodes().Create(ctx, ghost, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deleteGhostNode(t, n) })
	if len(created.Status.Addresses) == 0 {
		created.Status = ghost.Status
		if _, err := n.cs.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, waitTimeout, ghostNode+" remote in the nodes table", func() (bool, string) {
		rows, err := nodesTable(t)
		if err != nil {
			return false, err.Error()
		}
		r, ok := rows[ghostNode]
		return ok && !r.Local && slices.Contains(r.Addresses, ghostAddr), fmt.Sprintf("%+v", rows)
	})
	wantConnect(t, w.other, addr, "EPERM")

	deleteGhostNode(t, n)
	testenv.Eventually(t, waitTimeout, "the ghost node's address no longer remote-node", func() (bool, string) {
		got := connect(t, w.other, addr)
		return !strings.HasPrefix(got, "EPERM"), got
	})
	if err := cnps.Delete(ctx, "other-not-remote-node", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// deleteGhostNode deletes the ghost Node and the DaemonSet pods bound to
// it, and has the DaemonSet counted again. The DaemonSet controller has no
// handler for a deleted Node: its status counts the ghost until some other
// event makes it sync (the pod garbage collector removing the orphaned
// pod, after 40 s of quarantine and more, or never when no pod was made),
// so later subtests that wait for the DaemonSet to be ready would wait on
// that instead.
func deleteGhostNode(t *testing.T, n *node) {
	t.Helper()
	ctx := context.Background()
	if err := n.cs.CoreV1().Nodes().Delete(ctx, ghostNode, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatalf("delete node %s: %v", ghostNode, err)
	}
	zero := int64(0)
	testenv.Eventually(t, waitTimeout, "no pod on "+ghostNode+" and the agent DaemonSet counting one node", func() (bool, string) {
		pods, err := n.cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + ghostNode})
		if err != nil {
			return false, err.Error()
		}
		for _, p := range pods.Items {
			err := n.cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
			if err != nil && !apierrors.IsNotFound(err) {
				return false, fmt.Sprintf("delete pod %s/%s: %v", p.Namespace, p.Name, err)
			}
		}
		ds, err := n.cs.AppsV1().DaemonSets("kube-system").Get(ctx, "apiary-agent", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		st := ds.Status
		if len(pods.Items) == 0 && st.DesiredNumberScheduled != 1 {
			// No pod event left to make the controller count again:
			// a change of the DaemonSet's own metadata (not its
			// template, so no rollout) does.
			patch := fmt.Sprintf(`{"metadata":{"annotations":{"apiary.test/recount":%q}}}`, time.Now().Format(time.RFC3339Nano))
			if _, err := n.cs.AppsV1().DaemonSets("kube-system").Patch(ctx, "apiary-agent", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
				return false, err.Error()
			}
		}
		return len(pods.Items) == 0 && st.DesiredNumberScheduled == 1 && st.CurrentNumberScheduled == 1,
			fmt.Sprintf("%d pods on %s; DaemonSet status %+v", len(pods.Items), ghostNode, st)
	})
}

// dynamic returns a dynamic client of the cluster.
func (n *node) dynamic(t *testing.T) dynamic.Interface {
	t.Helper()
	dyn, err := dynamic.NewForConfig(n.admin)
	if err != nil {
		t.Fatal(err)
	}
	return dyn
}
