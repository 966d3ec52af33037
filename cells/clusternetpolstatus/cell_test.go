package clusternetpolstatus_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"
	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/bpf/memmap"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/clusternetpolstatus"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

var gvr = selectors.ClusterNetpolGroupVersion.WithResource("clusternetworkpolicies")

type agent struct {
	db       *statedb.DB
	fake     *k8sfake.Clients
	policies statedb.Table[*tables.Policy]
	status   statedb.Table[*tables.ClusterNetpolStatus]
}

// startAgent runs the selectors and the status cells (maps in memory)
// over a fake API server that serves ClusterNetworkPolicies.
func startAgent(t *testing.T) *agent {
	t.Helper()
	kinds := k8s.NewKinds()
	if err := k8s.RegisterKind(kinds, selectors.ClusterNetpolKind); err != nil {
		t.Fatal(err)
	}
	a := &agent{fake: k8sfake.New(kinds)}
	h := hive.NewWithOptions(core.HiveOptions(),
		infra.Cell, k8sfake.NewCell(a.fake),
		cell.Provide(func() *bpffs.MemoryMaps { return &bpffs.MemoryMaps{Pins: memmap.NewPins(nil)} }),
		identity.Cell, ipcache.Cell, selectors.Cell, clusternetpolstatus.Cell,
		cell.Invoke(func(db *statedb.DB, pol statedb.Table[*tables.Policy], st statedb.Table[*tables.ClusterNetpolStatus]) {
			a.db, a.policies, a.status = db, pol, st
		}))
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	if err := fs.Parse([]string{
		"--api-addr=127.0.0.1:0", "--bpf-pin-dir=" + filepath.Join(t.TempDir(), "pins"), "--state-dir=" + t.TempDir(),
		"--config-dir=" + t.TempDir(), "--node-name=node-a", "--node-ips=192.168.1.10",
	}); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return a
}

func policyObject(t *testing.T, name, spec string) *unstructured.Unstructured {
	t.Helper()
	doc := "apiVersion: policy.networking.k8s.io/v1beta1\nkind: ClusterNetworkPolicy\nmetadata: {name: " + name + "}\nspec:\n  " +
		strings.Join(strings.Split(strings.Trim(spec, "\n"), "\n"), "\n  ")
	u := &unstructured.Unstructured{}
	if err := yaml.Unmarshal([]byte(doc), &u.Object); err != nil {
		t.Fatal(err)
	}
	return u
}

// condition returns the object's condition of node-a, or nil.
func (a *agent) condition(t *testing.T, name string) *metav1.Condition {
	t.Helper()
	u, err := a.fake.Dynamic.Resource(gvr).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		return nil
	}
	raw, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	var conds []metav1.Condition
	for _, item := range raw {
		var c metav1.Condition
		if err := k8s.FromUnstructured(item.(map[string]any), &c); err != nil {
			t.Fatal(err)
		}
		conds = append(conds, c)
	}
	return meta.FindStatusCondition(conds, clusternetpolstatus.ConditionType("node-a"))
}

func (a *agent) waitCondition(t *testing.T, name, status, reason, message string) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("%s: %s %s %q", name, status, reason, message), func() (bool, string) {
		c := a.condition(t, name)
		if c == nil {
			return false, "no condition"
		}
		return string(c.Status) == status && c.Reason == reason && strings.Contains(c.Message, message),
			fmt.Sprintf("%s %s %q", c.Status, c.Reason, c.Message)
	})
}

// waitPolicy waits for the policies row of name.
func (a *agent) waitPolicy(t *testing.T, name string) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, "policies row "+name, func() (bool, string) {
		_, _, found := a.policies.Get(a.db.ReadTxn(), tables.PolicyNameIndex.Query(name))
		return found, ""
	})
}

const valid = `
tier: Admin
priority: 10
subject: {namespaces: {}}
egress:
- {action: Accept, to: [{nodes: {}}]}
`

// Each agent writes its own condition to the object: True (Enforced) for
// a valid policy, False (Invalid, with the error and that it fails
// closed) for one apiary cannot enforce; the table shows the same. The
// write is an update of the object that changes neither spec nor
// annotations, which the selectors ignore: the policies row is not
// rewritten (so the policy computation is not woken), as a later real
// change of another policy shows.
func TestConditions(t *testing.T) {
	a := startAgent(t)
	ctx := context.Background()
	res := a.fake.Dynamic.Resource(gvr)
	// The first status write waits until the test has seen the policy's
	// row as the selectors wrote it from the object.
	gate := make(chan struct{})
	a.fake.Dynamic.Fake().PrependReactor("update", "clusternetworkpolicies", func(action k8stesting.Action) (bool, runtime.Object, error) {
		if action.GetSubresource() == "status" {
			<-gate
		}
		return false, nil, nil
	})
	// Another node's condition, which must be kept.
	other := policyObject(t, "a", valid)
	if err := unstructured.SetNestedSlice(other.Object, []any{map[string]any{
		"type": "Ready-On-Node-node-b", "status": "True", "reason": "Enforced", "message": "node-b",
		"lastTransitionTime": "2026-01-01T00:00:00Z",
	}}, "status", "conditions"); err != nil {
		t.Fatal(err)
	}
	if _, err := res.Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	a.waitPolicy(t, "clusternetpol/a")
	_, rev, _ := a.policies.Get(a.db.ReadTxn(), tables.PolicyNameIndex.Query("clusternetpol/a"))
	close(gate)
	a.waitCondition(t, "a", "True", clusternetpolstatus.ReasonEnforced, "enforced by apiary on node node-a")

	// Another policy, invalid: its row comes after the status update of
	// a, which the informer delivered before.
	if _, err := res.Create(ctx, policyObject(t, "b", `
tier: Admin
priority: 10
subject: {namespaces: {}}
ingress:
- {action: Deny, from: [{nodes: {}}]}
`), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	a.waitPolicy(t, "clusternetpol/b")
	a.waitCondition(t, "b", "False", clusternetpolstatus.ReasonInvalid,
		"cannot enforce it: spec.ingress[0].from[0].nodes: only egress rules have nodes peers; the pods it selects are denied")
	if _, r, _ := a.policies.Get(a.db.ReadTxn(), tables.PolicyNameIndex.Query("clusternetpol/a")); r != rev {
		t.Errorf("the status write rewrote the policies row of a (revision %d, was %d)", r, rev)
	}
	u, err := res.Get(ctx, "a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions"); len(conds) != 2 {
		t.Errorf("conditions of a: %v, want node-b's and node-a's", conds)
	}

	// The table says the same, and that it was written.
	testenv.Eventually(t, 10*time.Second, "table rows", func() (bool, string) {
		var got []string
		for row := range a.status.All(a.db.ReadTxn()) {
			got = append(got, fmt.Sprintf("%s %s %s %s %s", row.Name, row.Type, row.Status, row.Reason, row.Written))
		}
		want := "clusternetpol/a Ready-On-Node-node-a True Enforced yes; clusternetpol/b Ready-On-Node-node-a False Invalid yes"
		return strings.Join(got, "; ") == want, strings.Join(got, "; ")
	})

	// Fixing b turns its condition True.
	fixed := policyObject(t, "b", valid)
	cur, err := res.Get(ctx, "b", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	fixed.SetResourceVersion(cur.GetResourceVersion())
	if _, err := res.Update(ctx, fixed, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	a.waitCondition(t, "b", "True", clusternetpolstatus.ReasonEnforced, "enforced")
}

// A status write the API server refuses is shown in the table with the
// error and retried until it is written.
func TestConditionWriteRefused(t *testing.T) {
	a := startAgent(t)
	refuse := make(chan struct{})
	a.fake.Dynamic.Fake().PrependReactor("update", "clusternetworkpolicies", func(action k8stesting.Action) (bool, runtime.Object, error) {
		select {
		case <-refuse:
			return false, nil, nil
		default:
		}
		if action.GetSubresource() == "status" {
			return true, nil, apierrors.NewForbidden(gvr.GroupResource(), "a", errors.New("no RBAC"))
		}
		return false, nil, nil
	})
	if _, err := a.fake.Dynamic.Resource(gvr).Create(context.Background(), policyObject(t, "a", valid), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	written := func(want string) {
		t.Helper()
		testenv.Eventually(t, 15*time.Second, "Written "+want, func() (bool, string) {
			row, _, found := a.status.Get(a.db.ReadTxn(), tables.ClusterNetpolStatusNameIndex.Query("clusternetpol/a"))
			return found && strings.Contains(row.Written, want), fmt.Sprintf("%+v", row)
		})
	}
	written("forbidden")
	close(refuse)
	written(clusternetpolstatus.WrittenYes)
	a.waitCondition(t, "a", "True", clusternetpolstatus.ReasonEnforced, "enforced")
}
