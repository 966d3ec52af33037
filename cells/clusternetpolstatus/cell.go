// Package clusternetpolstatus reports on every ClusterNetworkPolicy
// whether this node enforces it: a status condition of its own,
// "Ready-On-Node-<node>", written to the object's status.conditions in the
// API server (the network-policy-api leaves the conditions to the
// implementation), and shown in the clusternetpol-status table, which is
// all there is for a policy of --config-dir.
//
// The data flows one way: the policies table (the selectors cell's
// parse of each policy) is read, never written, and the selectors cell
// ignores an object whose spec and annotations did not change, so the
// status written back wakes neither the selectors nor the policy
// computation (see docs/policy.md, Status conditions).
package clusternetpolstatus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/util/retry"

	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the read-only clusternetpol-status table and writes the
// conditions.
var Cell = cell.Module(
	"clusternetpol-status",
	"Status conditions of ClusterNetworkPolicies",

	cell.ProvidePrivate(tables.NewClusterNetpolStatusTable),
	cell.Provide(statedb.RWTable[*tables.ClusterNetpolStatus].ToTable),
	cell.Invoke(register),
)

// Reasons of the condition.
const (
	// ReasonEnforced: the policy is valid and enforced on the node.
	ReasonEnforced = "Enforced"
	// ReasonInvalid: apiary cannot enforce the policy as written (a
	// field it refuses or does not implement); the message says which.
	ReasonInvalid = "Invalid"
)

// Written values of the table (besides an error).
const (
	WrittenYes       = "yes"
	WrittenNotInAPI  = "not in the API server"
	WrittenNoAPI     = "no API server"
	writtenPending   = "pending"
	retryAfterFailed = 5 * time.Second
)

// RBAC the agent needs for the conditions (deploy/rbac-agent.yaml, tested
// against these): it reads the object, then updates its status
// subresource.
var (
	ObjectVerbs    = []string{"get"}
	StatusVerbs    = []string{"update"}
	StatusResource = "clusternetworkpolicies/status"
)

// ConditionType is the condition type the agent of node owns.
func ConditionType(node string) string { return "Ready-On-Node-" + node }

type params struct {
	cell.In

	Log      *slog.Logger
	DB       *statedb.DB
	Jobs     job.Group
	Node     node.Config
	Policies statedb.Table[*tables.Policy]
	Table    statedb.RWTable[*tables.ClusterNetpolStatus]
	// Client is nil or disabled without an API server (--config-dir
	// alone).
	Client *k8s.Clientset `optional:"true"`
}

func register(p params) {
	p.Jobs.Add(job.OneShot("conditions", func(ctx context.Context, h cell.Health) error {
		return run(ctx, p, h)
	}))
}

// desired is the condition of a policies row.
func desired(row *tables.Policy, nodeName string) *tables.ClusterNetpolStatus {
	s := &tables.ClusterNetpolStatus{Name: row.Name, Type: ConditionType(nodeName), Status: string(metav1.ConditionTrue),
		Reason: ReasonEnforced, Message: "enforced by apiary on node " + nodeName}
	if row.Status != tables.PolicyOK {
		s.Status, s.Reason = string(metav1.ConditionFalse), ReasonInvalid
		what := "not enforced (--" + selectors.InvalidModeFlag + "=" + selectors.InvalidIgnore + ")"
		if row.FailClosed {
			what = "the pods it selects are denied in the directions it has rules in (fail closed)"
		}
		s.Message = fmt.Sprintf("apiary on node %s cannot enforce it: %s; %s", nodeName, row.Error, what)
	}
	return s
}

func run(ctx context.Context, p params, h cell.Health) error {
	api := p.Client.IsEnabled() && p.Client.Dynamic != nil
	// written are the conditions the API server holds as far as this job
	// knows, by policy name.
	written := map[string]*tables.ClusterNetpolStatus{}
	var retryC <-chan time.Time
	for {
		rtxn := p.DB.ReadTxn()
		want := map[string]*tables.ClusterNetpolStatus{}
		rows, watch := p.Policies.AllWatch(rtxn)
		for row := range rows {
			if strings.HasPrefix(row.Name, selectors.ClusterNetpolPrefix) {
				want[row.Name] = desired(row, p.Node.NodeName)
			}
		}
		failed := 0
		var firstErr error
		for _, name := range slices.Sorted(maps.Keys(want)) {
			w := want[name]
			switch {
			case !api:
				w.Written = WrittenNoAPI
			case sameCondition(written[name], w):
				w.Written = written[name].Written
			default:
				w.Written = writeCondition(ctx, p.Client, strings.TrimPrefix(name, selectors.ClusterNetpolPrefix), w)
				if w.Written != WrittenYes && w.Written != WrittenNotInAPI {
					failed++
					firstErr = cmpOr(firstErr, fmt.Errorf("%s: %s", name, w.Written))
					p.Log.Warn("Could not write the ClusterNetworkPolicy's status condition, retrying",
						"policy", name, "error", w.Written)
				}
			}
		}
		for name := range written {
			if _, ok := want[name]; !ok {
				delete(written, name)
			}
		}
		for name, w := range want {
			if w.Written == WrittenYes || w.Written == WrittenNotInAPI {
				written[name] = w
			} else {
				delete(written, name)
			}
		}
		if err := writeTable(p, want); err != nil {
			return err
		}
		retryC = nil
		if failed > 0 {
			// Reported, not degraded: /healthz is the DaemonSet's
			// liveness probe, and a condition the API server refuses
			// (RBAC, a CRD without the status subresource) must not
			// restart the agent, which enforces the policies anyway.
			h.OK(fmt.Sprintf("%d ClusterNetworkPolicies; %d conditions not written, retrying: %v", len(want), failed, firstErr))
			retryC = time.After(retryAfterFailed)
		} else {
			h.OK(fmt.Sprintf("%d ClusterNetworkPolicies", len(want)))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		case <-retryC:
		}
	}
}

func cmpOr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// sameCondition reports whether a (written before) says what b does.
func sameCondition(a, b *tables.ClusterNetpolStatus) bool {
	return a != nil && a.Type == b.Type && a.Status == b.Status && a.Reason == b.Reason && a.Message == b.Message
}

// writeCondition sets the condition on the object called name in the API
// server, and returns what became of it (WrittenYes, WrittenNotInAPI or
// the error). Only this node's condition changes; a conflict with another
// node's write is retried on the object as it is then.
func writeCondition(ctx context.Context, c *k8s.Clientset, name string, s *tables.ClusterNetpolStatus) string {
	res := c.Dynamic.Resource(selectors.ClusterNetpolGroupVersion.WithResource("clusternetworkpolicies"))
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		obj, err := res.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		var conds []metav1.Condition
		raw, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
		for _, item := range raw {
			var cond metav1.Condition
			if m, ok := item.(map[string]any); ok && k8s.FromUnstructured(m, &cond) == nil {
				conds = append(conds, cond) // a malformed entry is dropped
			}
		}
		want := metav1.Condition{Type: s.Type, Status: metav1.ConditionStatus(s.Status), Reason: s.Reason,
			Message: s.Message, ObservedGeneration: obj.GetGeneration()}
		if cur := meta.FindStatusCondition(conds, s.Type); cur != nil && cur.Status == want.Status &&
			cur.Reason == want.Reason && cur.Message == want.Message && cur.ObservedGeneration == want.ObservedGeneration {
			return nil // already so (a restart): nothing to write
		}
		meta.SetStatusCondition(&conds, want)
		raw = make([]any, 0, len(conds))
		for _, cond := range conds {
			u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&cond)
			if err != nil {
				return err
			}
			raw = append(raw, u)
		}
		if err := unstructured.SetNestedSlice(obj.Object, raw, "status", "conditions"); err != nil {
			return err
		}
		_, err = res.UpdateStatus(ctx, obj, metav1.UpdateOptions{FieldManager: "apiary"})
		return err
	})
	switch {
	case err == nil:
		return WrittenYes
	case apierrors.IsNotFound(err):
		return WrittenNotInAPI
	case errors.Is(err, context.Canceled):
		return writtenPending
	}
	return err.Error()
}

// writeTable makes the table hold want, writing only rows that changed.
func writeTable(p params, want map[string]*tables.ClusterNetpolStatus) error {
	wtxn := p.DB.WriteTxn(p.Table)
	defer wtxn.Abort()
	for row := range p.Table.All(wtxn) {
		if _, ok := want[row.Name]; !ok {
			if _, _, err := p.Table.Delete(wtxn, row); err != nil {
				return err
			}
		}
	}
	for _, w := range want {
		if old, _, found := p.Table.Get(wtxn, tables.ClusterNetpolStatusNameIndex.Query(w.Name)); found && *old == *w {
			continue
		}
		if _, _, err := p.Table.Insert(wtxn, w); err != nil {
			return err
		}
	}
	wtxn.Commit()
	return nil
}
