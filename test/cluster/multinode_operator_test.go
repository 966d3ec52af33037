//go:build cluster

package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/apiary-net/apiary/internal/testenv"
)

// ipcacheIDs returns the identity of every /32 or /128 prefix in the
// node's agent's ipcache table, by address.
func (w *workerNode) ipcacheIDs() (map[string]uint32, error) {
	body, err := w.agentGet("/statedb/dump/ipcache")
	if err != nil {
		return nil, err
	}
	var all map[string][]struct {
		Prefix   string `json:"prefix"`
		Identity uint32 `json:"identity"`
	}
	if err := json.Unmarshal([]byte(body), &all); err != nil {
		return nil, fmt.Errorf("ipcache of %s: %v", w.name, err)
	}
	out := map[string]uint32{}
	for _, e := range all["ipcache"] {
		addr, _, _ := strings.Cut(e.Prefix, "/")
		out[addr] = e.Identity
	}
	return out, nil
}

// endpointRows returns the node's agent's endpoints table by pod.
func (w *workerNode) endpointRows() (map[string]endpointRow, error) {
	body, err := w.agentGet("/statedb/dump/endpoints")
	if err != nil {
		return nil, err
	}
	var all map[string][]endpointRow
	if err := json.Unmarshal([]byte(body), &all); err != nil {
		return nil, fmt.Errorf("endpoints of %s: %v", w.name, err)
	}
	out := map[string]endpointRow{}
	for _, r := range all["endpoints"] {
		out[r.Name] = r
	}
	return out, nil
}

// testOperatorModeAcrossNodes: identity-management-mode switched to
// operator in the config map and the agents rolled out (docs/kubernetes.md,
// "Migrating"): each pod's own node has its identity from the operator's
// Identities (source cluster), and every node gives the pod's address that
// same number; the ingress CNP still holds across nodes.
func testOperatorModeAcrossNodes(t *testing.T, n *node, p *mnPods) {
	ctx := context.Background()
	testenv.Eventually(t, 2*waitTimeout, "an operator replica Ready", func() (bool, string) {
		pods, err := n.cs.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=apiary-operator"})
		if err != nil {
			return false, err.Error()
		}
		for _, p := range pods.Items {
			if podReady(&p) {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%d operator pods, none Ready", len(pods.Items))
	})
	patch := `{"data":{"identity-management-mode":"operator"}}`
	if _, err := n.cs.CoreV1().ConfigMaps("kube-system").Patch(ctx, "apiary-config", types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	n.rollOut(t, "operator", nil)
	var pods []*corev1.Pod
	for _, set := range [][]*corev1.Pod{p.server, p.client, p.other} {
		pods = append(pods, set...)
	}
	testenv.Eventually(t, 2*waitTimeout, "every pod's identity the operator's, the same on every node", func() (bool, string) {
		ids := map[string]map[string]uint32{}
		eps := map[string]map[string]endpointRow{}
		for _, w := range p.workers {
			var err error
			if ids[w.name], err = w.ipcacheIDs(); err != nil {
				return false, err.Error()
			}
			if eps[w.name], err = w.endpointRows(); err != nil {
				return false, err.Error()
			}
		}
		var report []string
		ok := true
		for _, pod := range pods {
			own := eps[pod.Spec.NodeName][ns+"/"+pod.Name]
			line := fmt.Sprintf("%s on %s: %d (%s);", pod.Name, pod.Spec.NodeName, own.Identity, own.IdentitySource)
			if own.IdentitySource != "cluster" || own.Identity == 0 {
				ok = false
			}
			for _, w := range p.workers {
				id := ids[w.name][pod.Status.PodIP]
				line += fmt.Sprintf(" %s says %d", w.name, id)
				if id != own.Identity {
					ok = false
				}
			}
			report = append(report, line)
		}
		return ok, strings.Join(report, "\n")
	})
	if ids, err := p.workers[0].ipcacheIDs(); err == nil {
		for _, pod := range pods {
			t.Logf("%s on %s: identity %d on every node", pod.Name, pod.Spec.NodeName, ids[pod.Status.PodIP])
		}
	}
	across(len(p.server), func(i, j int) {
		addr := p.server[j].Status.PodIP + ":8080"
		p.wantConnect(t, p.client[i], addr, "ok: hello from "+p.server[j].Name)
		p.wantConnect(t, p.other[i], addr, "timeout")
	})
}
