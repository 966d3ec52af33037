package operator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/cilium/hive/cell"
	corev1 "k8s.io/api/core/v1"
	k8serrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/apiary-net/apiary/apis/v1alpha1"
	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/tables"
)

// retryInterval is how soon a failed create is retried.
const retryInterval = time.Second

// maxBatch bounds the events taken before the controller writes.
const maxBatch = 1000

// idState is one Identity the controller knows of.
type idState struct {
	key             string // labels key
	resourceVersion string
}

// controller is one leadership term's identity controller. It is a single
// goroutine: the maps need no lock.
type controller struct {
	params
	client  *v1alpha1.Client
	metrics *metrics
	now     func() time.Time
	// filter decides which labels make identities, as the agents'.
	filter *endpoints.LabelFilter

	pods     map[k8s.Key]string // pod -> key of its label set ("" for none)
	nsLabels map[string]map[string]string
	podsByNS map[string]map[k8s.Key]*corev1.Pod

	users       map[string]int           // label set key -> pods using it
	labels      map[string]tables.Labels // label set key -> labels
	unusedSince map[string]time.Time     // label sets with Identities and no pods

	ids      map[uint32]*idState
	byLabels map[string]map[uint32]struct{}
	// taken are numbers a create found in use before their watch event.
	taken map[uint32]struct{}
	next  uint32

	// pending label sets may lack an Identity.
	pending map[string]struct{}
	lastErr error
}

func newController(p params, client *v1alpha1.Client, m *metrics) *controller {
	filter, err := endpoints.NewLabelFilter(p.Config.IdentityLabels)
	if err != nil {
		panic(err) // Config.validate checked it
	}
	return &controller{
		params: p, client: client, metrics: m, now: time.Now, filter: filter,
		pods: map[k8s.Key]string{}, nsLabels: map[string]map[string]string{}, podsByNS: map[string]map[k8s.Key]*corev1.Pod{},
		users: map[string]int{}, labels: map[string]tables.Labels{}, unusedSince: map[string]time.Time{},
		ids: map[uint32]*idState{}, byLabels: map[string]map[uint32]struct{}{}, taken: map[uint32]struct{}{},
		next: identity.MinCluster, pending: map[string]struct{}{},
	}
}

// wantsIdentity says whether a pod needs a workload identity: not one on
// the host's network (that is the host's), nor one that has finished.
func wantsIdentity(pod *corev1.Pod) bool {
	return !pod.Spec.HostNetwork && pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed
}

func (c *controller) run(ctx context.Context, h cell.Health) error {
	pods, nss, ids := c.Pods.Events(ctx), c.Namespaces.Events(ctx), c.Identities.Events(ctx)
	podsSynced, nsSynced, idsSynced := false, false, false
	onPod := k8s.TrackSync(&podsSynced, c.podChanged)
	onNamespace := k8s.TrackSync(&nsSynced, c.namespaceChanged)
	onIdentity := k8s.TrackSync(&idsSynced, c.identityChanged)
	// One timer ends the wait for the next GC or, when a create failed,
	// for the retry, whichever comes first.
	wake := time.NewTimer(c.Config.IdentityGCInterval)
	defer wake.Stop()
	nextGC := time.Now().Add(c.Config.IdentityGCInterval)
	synced := false
	for {
		if !synced && podsSynced && nsSynced && idsSynced {
			synced = true
			// Identities nobody uses at start count as unused from now.
			now := c.now()
			for _, s := range c.ids {
				if c.users[s.key] == 0 {
					if _, ok := c.unusedSince[s.key]; !ok {
						c.unusedSince[s.key] = now
					}
				}
			}
			// Next-after-last across restarts: continue after the highest
			// number in use.
			for id := range c.ids {
				if id+1 > c.next && id < identity.MaxCluster {
					c.next = id + 1
				}
			}
			c.Log.Info("Synced", "pods", len(c.pods), "identities", len(c.ids), "labelSets", len(c.labels))
		}
		again := false
		if synced {
			again, c.lastErr = c.ensure(ctx)
		}
		c.report(h, synced)

		wait := time.Until(nextGC)
		if again {
			wait = min(wait, retryInterval)
		}
		wake.Reset(wait)
		if _, ok := k8s.ReceiveBatch3(ctx, wake.C, maxBatch, pods, onPod, nss, onNamespace, ids, onIdentity); !ok {
			return nil
		}
		if now := time.Now(); !now.Before(nextGC) {
			nextGC = now.Add(c.Config.IdentityGCInterval)
			if synced {
				c.collect(ctx)
				c.metrics.gcRuns.Inc()
				// A full reconcile on the same interval.
				for key := range c.users {
					c.pending[key] = struct{}{}
				}
			}
		}
	}
}

func (c *controller) report(h cell.Health, synced bool) {
	c.metrics.identities.Set(float64(len(c.ids)))
	c.metrics.labelSetsUsed.Set(float64(len(c.users)))
	switch {
	case !synced:
		h.OK("Leading: waiting for Pods, Namespaces and Identities to sync")
	case c.lastErr != nil:
		h.Degraded(fmt.Sprintf("Leading: %d label sets lack an Identity", len(c.pending)), c.lastErr)
	default:
		h.OK(fmt.Sprintf("Leading: %d Identities, %d label sets in use", len(c.ids), len(c.users)))
	}
}

// use moves a pod from one label set to another ("" is none).
func (c *controller) use(old, new string) {
	if old == new {
		return
	}
	if old != "" {
		c.users[old]--
		if c.users[old] == 0 {
			delete(c.users, old)
			if len(c.byLabels[old]) > 0 {
				c.unusedSince[old] = c.now()
			} else {
				delete(c.labels, old)
			}
		}
	}
	if new != "" {
		c.users[new]++
		delete(c.unusedSince, new)
		if len(c.byLabels[new]) == 0 {
			c.pending[new] = struct{}{}
		}
	}
}

func (c *controller) setPod(key k8s.Key, pod *corev1.Pod) {
	newKey := ""
	if pod != nil && wantsIdentity(pod) {
		l := endpoints.SecurityLabels(pod, c.nsLabels[key.Namespace], c.filter)
		newKey = l.Key()
		c.labels[newKey] = l
	}
	c.use(c.pods[key], newKey)
	if pod == nil {
		delete(c.pods, key)
		if m := c.podsByNS[key.Namespace]; m != nil {
			delete(m, key)
			if len(m) == 0 {
				delete(c.podsByNS, key.Namespace)
			}
		}
		return
	}
	c.pods[key] = newKey
	if c.podsByNS[key.Namespace] == nil {
		c.podsByNS[key.Namespace] = map[k8s.Key]*corev1.Pod{}
	}
	c.podsByNS[key.Namespace][key] = pod
}

func (c *controller) podChanged(ev k8s.Event[*corev1.Pod]) {
	if ev.Kind == k8s.Delete {
		c.setPod(ev.Key, nil)
		return
	}
	c.setPod(ev.Key, ev.Object)
}

func (c *controller) namespaceChanged(ev k8s.Event[*corev1.Namespace]) {
	ns := ev.Key.Name
	if ev.Kind == k8s.Delete {
		delete(c.nsLabels, ns)
	} else {
		c.nsLabels[ns] = endpoints.NamespaceLabels(ev.Object)
	}
	for key, pod := range c.podsByNS[ns] {
		c.setPod(key, pod)
	}
}

func (c *controller) identityChanged(ev k8s.Event[*v1alpha1.Identity]) {
	n, err := ev.Object.Number()
	if err != nil || n < identity.MinCluster || n > identity.MaxCluster {
		c.Log.Warn("Ignoring Identity whose name is not a cluster identity number", "name", ev.Key.Name)
		return
	}
	c.forget(n)
	if ev.Kind == k8s.Delete {
		return
	}
	l := tables.NewLabels(ev.Object.SecurityLabels...)
	key := l.Key()
	c.ids[n] = &idState{key: key, resourceVersion: ev.Object.ResourceVersion}
	delete(c.taken, n)
	if c.byLabels[key] == nil {
		c.byLabels[key] = map[uint32]struct{}{}
	}
	c.byLabels[key][n] = struct{}{}
	if _, ok := c.labels[key]; !ok {
		c.labels[key] = l
	}
	if c.users[key] == 0 {
		if _, ok := c.unusedSince[key]; !ok {
			c.unusedSince[key] = c.now()
		}
	}
}

// forget drops what the controller knows of Identity n.
func (c *controller) forget(n uint32) {
	old, ok := c.ids[n]
	if !ok {
		return
	}
	delete(c.ids, n)
	delete(c.byLabels[old.key], n)
	if len(c.byLabels[old.key]) == 0 {
		delete(c.byLabels, old.key)
		delete(c.unusedSince, old.key)
		if c.users[old.key] > 0 {
			c.pending[old.key] = struct{}{} // deleted under its pods' feet
		} else {
			delete(c.labels, old.key)
		}
	}
}

// ensure creates an Identity for every pending label set in use that has
// none. It never creates a second one for a label set: the controller
// records its own creates at once, before their watch events.
func (c *controller) ensure(ctx context.Context) (retry bool, err error) {
	var errs []error
	for _, key := range slices.Sorted(maps.Keys(c.pending)) {
		if c.users[key] == 0 || len(c.byLabels[key]) > 0 {
			delete(c.pending, key)
			continue
		}
		if err := c.create(ctx, key); err != nil {
			if !errors.Is(err, errTaken) {
				errs = append(errs, err)
			}
			retry = true
			if ctx.Err() != nil {
				break
			}
			continue
		}
		delete(c.pending, key)
	}
	return retry, errors.Join(errs...)
}

// errTaken says that the number tried was taken by an Identity the watch
// has not delivered yet. That Identity may be of the same label set (made by
// a previous leader), so the label set waits for the watch to catch up
// instead of trying the next number at once, which could duplicate it.
var errTaken = errors.New("number taken meanwhile")

// create allocates a free number next-after-last and creates its Identity.
// A number someone else took meanwhile is skipped from then on, and the
// label set retried after retryInterval (errTaken).
func (c *controller) create(ctx context.Context, key string) error {
	labels := c.labels[key]
	n, err := c.allocate()
	if err != nil {
		return fmt.Errorf("label set %s: %w", labels, err)
	}
	obj, err := c.client.Create(ctx, v1alpha1.NewIdentity(n, labels))
	switch {
	case k8serrors.IsAlreadyExists(err):
		c.taken[n] = struct{}{}
		c.Log.Info("Identity number taken meanwhile; waiting for the watch", "identity", n, "labels", labels)
		return errTaken
	case err != nil:
		c.metrics.apiErrors.WithLabelValues("create").Inc()
		return fmt.Errorf("create Identity %d for %s: %w", n, labels, err)
	}
	c.metrics.created.Inc()
	c.Log.Info("Created Identity", "identity", n, "labels", labels)
	c.identityChanged(k8s.Event[*v1alpha1.Identity]{Kind: k8s.Upsert, Key: k8s.Key{Name: obj.Name}, Object: obj})
	return nil
}

// collect deletes the Identities of label sets no pod has used for the
// grace period. Duplicates of a label set in use stay: an agent may use
// either.
func (c *controller) collect(ctx context.Context) {
	now := c.now()
	for _, key := range slices.Sorted(maps.Keys(c.unusedSince)) {
		if c.users[key] > 0 || now.Sub(c.unusedSince[key]) < c.Config.IdentityGCGracePeriod {
			continue
		}
		for _, n := range slices.Sorted(maps.Keys(c.byLabels[key])) {
			s := c.ids[n]
			err := c.client.Delete(ctx, strconv.FormatUint(uint64(n), 10), s.resourceVersion)
			switch {
			case err == nil || k8serrors.IsNotFound(err):
				c.metrics.deleted.Inc()
				c.Log.Info("Deleted unused Identity", "identity", n, "labels", c.labels[key])
				c.forget(n)
			case k8serrors.IsConflict(err):
				// Re-created meanwhile; the watch brings the new version.
			default:
				c.metrics.apiErrors.WithLabelValues("delete").Inc()
				c.Log.Warn("Deleting unused Identity failed; next interval retries", "identity", n, "error", err)
			}
		}
	}
}

// allocate returns the first free number after the one handed out last,
// wrapping, so that a number just deleted is not reused at once (agents
// may still hold it for the old label set).
func (c *controller) allocate() (uint32, error) {
	size := identity.MaxCluster - identity.MinCluster + 1
	for range size {
		n := c.next
		c.next++
		if c.next > identity.MaxCluster {
			c.next = identity.MinCluster
		}
		_, used := c.ids[n]
		_, taken := c.taken[n]
		if !used && !taken {
			return n, nil
		}
	}
	return 0, &identity.ExhaustedError{Scope: tables.ScopeCluster, First: identity.MinCluster, Last: identity.MaxCluster}
}
