package operator

import (
	"context"
	"fmt"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/go-logr/logr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"

	"github.com/apiary-net/apiary/apis/v1alpha1"
)

// LeaseVerbs are the verbs leader election uses on
// coordination.k8s.io Leases (deploy/'s RBAC is tested against them).
var LeaseVerbs = []string{"get", "create", "update"}

// elector runs the identity controller while this replica holds the Lease.
type elector struct {
	params
	client   *v1alpha1.Client
	metrics  *metrics
	identity string
}

// run campaigns for the Lease until ctx ends. Each term runs a fresh
// controller that starts from a full listing, so a replica that lost the
// Lease and wins it back has no stale state.
func (e *elector) run(ctx context.Context, h cell.Health) error {
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: e.Config.LeaderElectionNamespace, Name: e.Config.LeaderElectionLease},
		Client:     e.Clientset.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: e.identity},
	}
	for ctx.Err() == nil {
		h.OK(fmt.Sprintf("Standby: waiting for Lease %s/%s as %s", lock.LeaseMeta.Namespace, lock.LeaseMeta.Name, e.identity))
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock:            lock,
			LeaseDuration:   e.Config.LeaderElectionLeaseDuration,
			RenewDeadline:   e.Config.LeaderElectionRenewDeadline,
			RetryPeriod:     e.Config.LeaderElectionRetryPeriod,
			ReleaseOnCancel: true,
			Name:            e.Config.LeaderElectionLease,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(ctx context.Context) {
					e.Log.Info("Leading: managing Identities", "identity", e.identity)
					e.metrics.leader.Set(1)
					c := newController(e.params, e.client, e.metrics)
					if err := c.run(ctx, h); err != nil {
						e.Log.Error("Identity controller failed", "error", err)
						h.Degraded("Identity controller failed", err)
					}
				},
				OnStoppedLeading: func() {
					e.metrics.leader.Set(0)
					e.Log.Info("Stopped leading", "identity", e.identity)
				},
				OnNewLeader: func(id string) {
					if id != e.identity {
						e.Log.Info("Another replica leads", "leader", id)
						h.OK("Standby: " + id + " leads")
					}
				},
			},
		})
		if err != nil {
			return fmt.Errorf("leader election: %w", err)
		}
		// client-go logs through klog's contextual logger: route it into
		// the module's slog logger, as the informers do.
		le.Run(klog.NewContext(ctx, logr.FromSlogHandler(e.Log.Handler())))
		// Lost the Lease (or ctx ended): campaign again after a pause.
		select {
		case <-ctx.Done():
		case <-time.After(e.Config.LeaderElectionRetryPeriod):
		}
	}
	return nil
}
