// Package operator is the identity operator: the one writer of the
// cluster's apiary.io Identities when agents run with
// --identity-management-mode=operator. It watches Pods, Namespaces and
// Identities, gives every label set pods use exactly one Identity (reusing
// an existing one before allocating a free number in 256–65535), and
// deletes Identities no pod has used for --identity-gc-grace-period,
// checked every --identity-gc-interval. Replicas elect a leader through a
// coordination.k8s.io Lease; only the leader writes. See docs/operator.md.
package operator

import (
	"crypto/rand"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"

	"github.com/apiary-net/apiary/apis/v1alpha1"
	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/k8s"
)

// Cell is the identity controller with its leader election. It needs the
// Kubernetes client and k8s.SourcesCell (Pods, Namespaces).
var Cell = cell.Module(
	"operator",
	"Cluster identities - one Identity per label set - GC and leader election",

	cell.Config(defaultConfig),
	cell.Provide(
		func(p k8s.ResourceParams) k8s.Resource[*v1alpha1.Identity] {
			return k8s.NewResource(p, v1alpha1.IdentityKind)
		},
	),
	cell.Invoke(register),
)

// Config is the operator's configuration.
type Config struct {
	// IdentityGCInterval is how often unused Identities are collected and
	// every label set is reconciled.
	IdentityGCInterval time.Duration
	// IdentityGCGracePeriod is how long an Identity must have been unused
	// before it is collected.
	IdentityGCGracePeriod time.Duration
	// IdentityLabels are patterns added to the identity label filter
	// (endpoints.LabelFilter); the agents' must be the same.
	IdentityLabels []string
	// LeaderElectionNamespace and LeaderElectionLease name the Lease.
	LeaderElectionNamespace string
	LeaderElectionLease     string
	// LeaderElectionIdentity names this replica; empty: hostname, pid and a random suffix.
	LeaderElectionIdentity string
	// Lease timing, as client-go's leaderelection.
	LeaderElectionLeaseDuration time.Duration
	LeaderElectionRenewDeadline time.Duration
	LeaderElectionRetryPeriod   time.Duration
}

var defaultConfig = Config{
	IdentityGCInterval:          10 * time.Minute,
	IdentityGCGracePeriod:       time.Minute,
	IdentityLabels:              []string{},
	LeaderElectionNamespace:     "kube-system",
	LeaderElectionLease:         "apiary-operator",
	LeaderElectionLeaseDuration: 15 * time.Second,
	LeaderElectionRenewDeadline: 10 * time.Second,
	LeaderElectionRetryPeriod:   2 * time.Second,
}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.Duration("identity-gc-interval", def.IdentityGCInterval,
		"How often Identities no pod uses are collected and every label set is reconciled")
	fs.Duration("identity-gc-grace-period", def.IdentityGCGracePeriod,
		"How long an Identity must have been unused before it is collected")
	fs.StringSlice(endpoints.IdentityLabelsFlag, def.IdentityLabels, endpoints.IdentityLabelsHelp)
	fs.String("leader-election-namespace", def.LeaderElectionNamespace, "Namespace of the leader election Lease")
	fs.String("leader-election-lease", def.LeaderElectionLease, "Name of the leader election Lease")
	fs.String("leader-election-identity", def.LeaderElectionIdentity, "Name of this replica in the Lease; empty: hostname, process id and a random suffix")
	fs.Duration("leader-election-lease-duration", def.LeaderElectionLeaseDuration, "How long a Lease holds without renewal before another replica may take over")
	fs.Duration("leader-election-renew-deadline", def.LeaderElectionRenewDeadline, "How long the leader keeps trying to renew before it gives up leading")
	fs.Duration("leader-election-retry-period", def.LeaderElectionRetryPeriod, "How often replicas try to acquire or renew the Lease")
}

func (c Config) validate() error {
	if _, err := endpoints.NewLabelFilter(c.IdentityLabels); err != nil {
		return err
	}
	switch {
	case c.IdentityGCInterval <= 0:
		return fmt.Errorf("--identity-gc-interval=%s must be positive", c.IdentityGCInterval)
	case c.IdentityGCGracePeriod < 0:
		return fmt.Errorf("--identity-gc-grace-period=%s is negative", c.IdentityGCGracePeriod)
	case c.LeaderElectionLeaseDuration <= c.LeaderElectionRenewDeadline:
		return fmt.Errorf("--leader-election-lease-duration=%s must exceed --leader-election-renew-deadline=%s",
			c.LeaderElectionLeaseDuration, c.LeaderElectionRenewDeadline)
	case c.LeaderElectionRetryPeriod <= 0 || c.LeaderElectionRenewDeadline <= c.LeaderElectionRetryPeriod:
		return fmt.Errorf("--leader-election-renew-deadline=%s must exceed --leader-election-retry-period=%s",
			c.LeaderElectionRenewDeadline, c.LeaderElectionRetryPeriod)
	case c.LeaderElectionNamespace == "" || c.LeaderElectionLease == "":
		return fmt.Errorf("--leader-election-namespace and --leader-election-lease must be set")
	}
	return nil
}

type params struct {
	cell.In

	Log        *slog.Logger
	Config     Config
	Jobs       job.Group
	Clientset  *k8s.Clientset
	Registry   prometheus.Registerer
	Pods       k8s.Resource[*corev1.Pod]
	Namespaces k8s.Resource[*corev1.Namespace]
	Identities k8s.Resource[*v1alpha1.Identity]
}

func register(p params) error {
	if err := p.Config.validate(); err != nil {
		return err
	}
	if !p.Clientset.IsEnabled() {
		return fmt.Errorf("the operator needs Kubernetes: set --kubeconfig or run it in a cluster")
	}
	client, err := v1alpha1.NewClient(p.Clientset)
	if err != nil {
		return err
	}
	m, err := newMetrics(p.Registry)
	if err != nil {
		return err
	}
	id := p.Config.LeaderElectionIdentity
	if id == "" {
		host, _ := os.Hostname()
		// The random part keeps two replicas apart even when they share a
		// host name and pid (two hives in one test process).
		id = host + "_" + strconv.Itoa(os.Getpid()) + "_" + rand.Text()[:8]
	}
	e := &elector{params: p, client: client, metrics: m, identity: id}
	p.Jobs.Add(job.OneShot("leader-election", e.run))
	return nil
}
