// Package endpoints owns the endpoints table: the Pods running on this node
// with their security labels and identity. It also labels the IPs of every
// Pod it hears of (on any node) with the Pod's security labels, so that
// they resolve to workload identities in the ipcache.
//
// A Pod's security labels are its labels as k8s:<key>=<value>, its
// namespace as k8s:io.kubernetes.pod.namespace=<ns>, and its namespace's
// labels as k8s:io.cilium.k8s.namespace.labels.<key>=<value>, less those
// the identity label filter leaves out (LabelFilter, --identity-labels).
//
// A local pod's endpoint also carries the pod's UID, its named container
// ports and its kubelet cgroup under --cgroup-root (see cgroup.go), which
// policy enforcement needs.
package endpoints

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"

	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/internal/wake"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the read-only endpoints table.
var Cell = cell.Module(
	"endpoints",
	"Pods on this node and their identities",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(tables.NewEndpointsTable),
	cell.Provide(statedb.RWTable[*tables.Endpoint].ToTable),
	cell.Invoke(registerController),
)

// Label keys and prefixes of security labels.
const (
	NamespaceLabel       = "io.kubernetes.pod.namespace"
	NamespaceLabelPrefix = "io.cilium.k8s.namespace.labels."
)

// Config is the endpoints cell's configuration.
type Config struct {
	// IdentityLabels are patterns added to the identity label filter
	// (see LabelFilter).
	IdentityLabels []string
}

var defaultConfig = Config{IdentityLabels: []string{}}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.StringSlice(IdentityLabelsFlag, def.IdentityLabels, IdentityLabelsHelp)
}

// SecurityLabels returns the security labels of pod in a namespace with
// the labels nsLabels: those filter keeps.
func SecurityLabels(pod *corev1.Pod, nsLabels map[string]string, filter *LabelFilter) tables.Labels {
	return SelectableLabels(pod, nsLabels, filter, nil)
}

// SelectableLabels is SecurityLabels with, besides, the pod's labels of
// the keys in selected whatever the filter says: the keys policies whose
// API selects pods by every label name (tables.Policy.SelectedLabelKeys).
func SelectableLabels(pod *corev1.Pod, nsLabels map[string]string, filter *LabelFilter, selected map[string]struct{}) tables.Labels {
	out := make([]string, 0, len(pod.Labels)+len(nsLabels)+1)
	add := func(key, value string) {
		if filter.Keep(tables.SourceK8s, key) {
			out = append(out, tables.SourceK8s+":"+key+"="+value)
		}
	}
	for k, v := range pod.Labels {
		if _, ok := selected[k]; ok && !filter.Keep(tables.SourceK8s, k) {
			out = append(out, tables.SourceK8s+":"+k+"="+v)
			continue
		}
		add(k, v)
	}
	for k, v := range nsLabels {
		add(NamespaceLabelPrefix+k, v)
	}
	add(NamespaceLabel, pod.Namespace)
	return tables.NewLabels(out...)
}

// NamespaceNameLabel is the label the API server gives every namespace:
// its name. Policies select a namespace by name with it.
const NamespaceNameLabel = "kubernetes.io/metadata.name"

// NamespaceLabels returns the labels of ns that its pods' security labels
// carry: its own, with NamespaceNameLabel set to its name as the API
// server sets it (a namespace from --config-dir may lack it).
func NamespaceLabels(ns *corev1.Namespace) map[string]string {
	if ns.Labels[NamespaceNameLabel] == ns.Name {
		return ns.Labels
	}
	out := make(map[string]string, len(ns.Labels)+1)
	for k, v := range ns.Labels {
		out[k] = v
	}
	out[NamespaceNameLabel] = ns.Name
	return out
}

// podIPs returns the addresses of a pod that holds them: not one on the
// host's network (those are the node's), nor one that has terminated.
func podIPs(pod *corev1.Pod) []netip.Addr {
	if pod.Spec.HostNetwork || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		return nil
	}
	var out []netip.Addr
	add := func(s string) {
		if a, err := netip.ParseAddr(s); err == nil && !slices.Contains(out, a.Unmap()) {
			out = append(out, a.Unmap())
		}
	}
	for _, ip := range pod.Status.PodIPs {
		add(ip.IP)
	}
	add(pod.Status.PodIP)
	return out
}

type controllerParams struct {
	cell.In

	Log        *slog.Logger
	Config     Config
	DB         *statedb.DB
	Jobs       job.Group
	Node       node.Config
	Root       cgroups.Root
	Endpoints  statedb.RWTable[*tables.Endpoint]
	IPCache    statedb.Table[*tables.IPCacheEntry]
	Identities statedb.Table[*tables.Identity]
	Prefixes   ipcache.Prefixes
	Pods       k8s.Resource[*corev1.Pod]
	Namespaces k8s.Resource[*corev1.Namespace]
	// Policies name the pod label keys identities must carry whatever
	// the label filter says (tables.Policy.SelectedLabelKeys); absent,
	// none.
	Policies statedb.Table[*tables.Policy] `optional:"true"`
	// PoliciesSynced is waited for before the pods are labelled, so that
	// their first identities carry the keys policies select by.
	PoliciesSynced *selectors.PoliciesSynced `optional:"true"`
}

type podState struct {
	pod    *corev1.Pod
	ips    []netip.Addr
	labels tables.Labels
	uid    string
	// ports are the named container ports of a local pod.
	ports []tables.NamedPort
	// cgroup is where a local pod's cgroup was found (see cgroup.go).
	cgroup cgroupRef
	// seen orders the pods by when the controller first heard of them
	// (see claims.go).
	seen uint64
}

type controller struct {
	controllerParams

	// filter decides which labels make identities (--identity-labels).
	filter *LabelFilter
	// selected are the pod label keys policies select by that identities
	// carry although the filter leaves them out (see SelectableLabels).
	selected map[string]struct{}

	// markInitialized marks the endpoints table initialized.
	markInitialized func(statedb.WriteTxn)

	pods     map[k8s.Key]*podState
	nsLabels map[string]map[string]string
	// local counts the pods on this node.
	local int
	// changes to the prefixes, applied by flush.
	changes []ipcache.Change
	// dirty are the local pods (or pods that were local) whose endpoint
	// writeEndpoints must recompute; ipcacheRev is the revision of the
	// ipcache table it has looked at. A round costs what changed since the
	// last, not all pods: a burst of pods comes in many small rounds.
	dirty      map[k8s.Key]struct{}
	ipcacheRev statedb.Revision
	// cg follows the local pods' cgroups.
	cg cgroupTracker
	// now is the clock of the cgroup rechecks (a test's own in tests).
	now func() time.Time
	// claims are the pods claiming each pod address (see claims.go);
	// seen counts the pods heard of.
	claims addressClaims
	seen   uint64
	// badUID are the local pods whose UID cannot name a cgroup.
	badUID map[k8s.Key]struct{}
}

func registerController(p controllerParams) error {
	if _, err := NewLabelFilter(p.Config.IdentityLabels); err != nil {
		return err
	}
	c := newController(p)
	synced := p.Prefixes.RegisterInitializer("pods")
	wtxn := p.DB.WriteTxn(p.Endpoints)
	c.markInitialized = p.Endpoints.RegisterInitializer(wtxn, "pods-resolved")
	wtxn.Commit()
	p.Jobs.Add(job.OneShot("pods", func(ctx context.Context, h cell.Health) error {
		return c.run(ctx, h, synced)
	}))
	return nil
}

// newController returns the controller of p, whose --identity-labels
// registerController has checked.
func newController(p controllerParams) *controller {
	filter, err := NewLabelFilter(p.Config.IdentityLabels)
	if err != nil {
		panic(err) // checked before
	}
	return &controller{
		controllerParams: p, filter: filter, pods: map[k8s.Key]*podState{}, nsLabels: map[string]map[string]string{},
		dirty: map[k8s.Key]struct{}{}, cg: newCgroupTracker(), now: time.Now, claims: newAddressClaims(),
		badUID: map[k8s.Key]struct{}{},
	}
}

// owner returns the prefixes owner of a pod.
func owner(key k8s.Key) string {
	return tables.PodOwner(key.Namespace, key.Name)
}

// hostIdentity is reserved:host's, the identity of a host-network pod.
const hostIdentity = 1

// ownerKey is the inverse of owner.
func ownerKey(o string) (k8s.Key, bool) {
	ns, name, ok := tables.PodOfOwner(o)
	return k8s.Key{Namespace: ns, Name: name}, ok
}

const maxBatch = 1000

func (c *controller) run(ctx context.Context, h cell.Health, synced func()) error {
	pods, namespaces := c.Pods.Events(ctx), c.Namespaces.Events(ctx)
	podsSynced, nsSynced, initDone, tableInit := false, false, false, false
	onPod := k8s.TrackSync(&podsSynced, c.podChanged)
	onNamespace := k8s.TrackSync(&nsSynced, c.namespaceChanged)
	// One timer for every cgroup recheck; stopped while none is due.
	recheck := time.NewTimer(recheckResolved)
	defer recheck.Stop()
	recheck.Stop()
	c.ensureRoot(c.now())
	if c.PoliciesSynced != nil {
		// Pods labelled before the policies are known would get an
		// identity without the labels policies select by, then another:
		// a moment in which a Deny selecting by such a label misses.
		select {
		case <-c.PoliciesSynced.Done():
		case <-ctx.Done():
			return nil
		}
	}
	for {
		// A change of the pod label keys policies select by relabels
		// pods, flushed with the rest.
		policiesWatch := c.updateSelected(c.DB.ReadTxn())
		if err := c.flush(); err != nil {
			return err
		}
		if !initDone && podsSynced && nsSynced {
			initDone = true
			synced()
		}
		now := c.now()
		c.recheckCgroups(now)
		rtxn := c.DB.ReadTxn()
		_, ipcacheWatch := c.IPCache.AllWatch(rtxn)
		ipcacheInit, ipcacheInitWatch := c.IPCache.Initialized(rtxn)
		if err := c.writeEndpoints(); err != nil {
			return err
		}
		// The table is complete once the pods have synced and their
		// identities resolved: the ipcache was initialized before this
		// round wrote the endpoints.
		stopWait := func() {}
		if !tableInit {
			if initDone && ipcacheInit {
				tableInit = true
				wtxn := c.DB.WriteTxn(c.Endpoints)
				c.markInitialized(wtxn)
				wtxn.Commit()
			} else {
				ipcacheWatch, stopWait = wake.Either(ipcacheWatch, ipcacheInitWatch)
			}
		}
		ipcacheWatch, stopPolicies := wake.Either(ipcacheWatch, policiesWatch)
		msg := fmt.Sprintf("%d pods, %d on this node", len(c.pods), c.local) + c.cgroupHealth()
		if problems := c.problems(); problems != "" {
			h.Degraded(msg+"; "+problems, errors.New(problems))
		} else {
			h.OK(msg)
		}

		if next, ok := c.nextRecheck(); ok {
			recheck.Reset(max(next.Sub(now), 0))
		} else {
			recheck.Stop()
		}
		// Take a batch of events, or wait for the ipcache to change or a
		// recheck to be due.
		ok := receive(ctx, ipcacheWatch, recheck.C, pods, onPod, namespaces, onNamespace)
		stopWait()
		stopPolicies()
		if !ok {
			return nil
		}
	}
}

// receive is k8s.ReceiveBatch2 with a second wake channel, the recheck
// timer's: it waits for a pod or namespace event, a change of the ipcache
// or the timer, then takes the events that are ready, up to maxBatch. It
// returns false when the controller is to stop.
func receive[W any](ctx context.Context, wake <-chan W, timer <-chan time.Time,
	pods <-chan k8s.Event[*corev1.Pod], onPod func(k8s.Event[*corev1.Pod]),
	namespaces <-chan k8s.Event[*corev1.Namespace], onNamespace func(k8s.Event[*corev1.Namespace]),
) bool {
	select {
	case <-ctx.Done():
		return false
	case <-wake:
		return true
	case <-timer:
		return true
	case ev, open := <-pods:
		if !open {
			return false
		}
		onPod(ev)
	case ev, open := <-namespaces:
		if !open {
			return false
		}
		onNamespace(ev)
	}
	_, ok := k8s.DrainBatch2(maxBatch-1, pods, onPod, namespaces, onNamespace)
	return ok
}

// isLocal says whether s (nil: no pod) is a pod on this node.
func (c *controller) isLocal(s *podState) bool {
	return s != nil && s.pod.Spec.NodeName == c.Node.NodeName
}

func (c *controller) podChanged(ev k8s.Event[*corev1.Pod]) {
	old := c.pods[ev.Key]
	if c.isLocal(old) {
		c.local--
		c.dirty[ev.Key] = struct{}{}
	}
	delete(c.badUID, ev.Key)
	if ev.Kind == k8s.Delete {
		delete(c.pods, ev.Key)
		c.trackCgroup(ev.Key, old, nil, c.now())
		c.relabel(ev.Key, old, nil)
		return
	}
	s := &podState{
		pod: ev.Object, ips: podIPs(ev.Object),
		labels: SelectableLabels(ev.Object, c.nsLabels[ev.Key.Namespace], c.filter, c.selected),
		uid:    string(ev.Object.UID),
	}
	if old != nil {
		s.seen = old.seen
	} else {
		c.seen++
		s.seen = c.seen
	}
	c.pods[ev.Key] = s
	if c.isLocal(s) {
		c.local++
		c.dirty[ev.Key] = struct{}{}
		// Kept for the endpoints only, so for local pods.
		s.ports = namedPorts(ev.Object)
		if !validUID(s.uid) {
			c.badUID[ev.Key] = struct{}{}
		}
	}
	c.trackCgroup(ev.Key, old, s, c.now())
	c.relabel(ev.Key, old, s)
}

func (c *controller) namespaceChanged(ev k8s.Event[*corev1.Namespace]) {
	ns := ev.Key.Name
	if ev.Kind == k8s.Delete {
		delete(c.nsLabels, ns)
	} else {
		c.nsLabels[ns] = NamespaceLabels(ev.Object)
	}
	for key, old := range c.pods {
		if key.Namespace != ns {
			continue
		}
		c.relabelPod(key, old)
	}
}

// relabelPod recomputes the labels of the pod key, whose state is old.
func (c *controller) relabelPod(key k8s.Key, old *podState) {
	s := *old
	s.labels = SelectableLabels(old.pod, c.nsLabels[key.Namespace], c.filter, c.selected)
	if s.labels.Equal(old.labels) {
		return
	}
	c.pods[key] = &s
	if c.isLocal(&s) {
		c.dirty[key] = struct{}{}
	}
	c.relabel(key, old, &s)
}

// updateSelected takes the pod label keys the policies select by
// (tables.Policy.SelectedLabelKeys) and relabels the pods when the keys
// the filter leaves out among them changed. It returns a channel closed
// when the policies change.
func (c *controller) updateSelected(rtxn statedb.ReadTxn) <-chan struct{} {
	if c.Policies == nil {
		return nil
	}
	rows, watch := c.Policies.AllWatch(rtxn)
	selected := map[string]struct{}{}
	for row := range rows {
		for _, k := range row.SelectedLabelKeys {
			if !c.filter.Keep(tables.SourceK8s, k) {
				selected[k] = struct{}{}
			}
		}
	}
	if maps.Equal(selected, c.selected) {
		return watch
	}
	c.selected = selected
	for key, old := range c.pods {
		c.relabelPod(key, old)
	}
	return watch
}

// relabel queues the prefix changes from old to new (either may be nil):
// the addresses the pod holds get its labels (see claims.go).
func (c *controller) relabel(key k8s.Key, old, new *podState) {
	if old != nil {
		for _, ip := range old.ips {
			if new == nil || !slices.Contains(new.ips, ip) {
				c.unclaim(ip, key)
			}
		}
	}
	if new == nil {
		return
	}
	for _, ip := range new.ips {
		switch {
		case old == nil || !slices.Contains(old.ips, ip):
			c.claim(ip, key, new)
		case !old.labels.Equal(new.labels):
			if holder, _ := c.claims.holder(ip); holder == key {
				c.changes = append(c.changes, ipcache.Change{Prefix: tables.HostPrefix(ip), Owner: owner(key), Labels: new.labels})
			}
		}
	}
}

func (c *controller) flush() error {
	if len(c.changes) == 0 {
		return nil
	}
	if _, err := c.Prefixes.Update(c.changes...); err != nil {
		return fmt.Errorf("label pod IPs: %w", err)
	}
	c.changes = c.changes[:0]
	return nil
}

// writeEndpoints brings the endpoints of the dirty pods, and of the local
// pods whose ipcache entries changed, in line with the pods and the
// identities their IPs resolved to.
func (c *controller) writeEndpoints() error {
	// A round woken by the recheck timer often changes nothing: it takes
	// no write transaction then.
	if len(c.dirty) == 0 && c.IPCache.Revision(c.DB.ReadTxn()) == c.ipcacheRev {
		return nil
	}
	wtxn := c.DB.WriteTxn(c.Endpoints)
	defer wtxn.Abort()
	// Entries written since the last round, by revision: an endpoint takes
	// its identity from the entry of its first IP, whose owners name it.
	// (An entry deleted while its pod still owns the IP cannot be: the
	// prefix goes only with its last owner, and that is a pod change.)
	for entry := range c.IPCache.LowerBound(wtxn, statedb.ByRevision[*tables.IPCacheEntry](c.ipcacheRev+1)) {
		for _, o := range entry.Owners {
			if key, ok := ownerKey(o); ok && c.isLocal(c.pods[key]) {
				c.dirty[key] = struct{}{}
			}
		}
	}
	c.ipcacheRev = c.IPCache.Revision(wtxn)
	for key := range c.dirty {
		s := c.pods[key]
		old, _, found := c.Endpoints.Get(wtxn, tables.EndpointNameIndex.Query(key.String()))
		if !c.isLocal(s) {
			if found {
				if _, _, err := c.Endpoints.Delete(wtxn, old); err != nil {
					return err
				}
			}
			continue
		}
		e := c.endpoint(wtxn, key, s)
		if found && sameEndpoint(old, e) {
			continue
		}
		if _, _, err := c.Endpoints.Insert(wtxn, e); err != nil {
			return err
		}
	}
	wtxn.Commit()
	clear(c.dirty)
	return nil
}

// endpoint returns the endpoint of the local pod s with the identity the
// first IP it holds resolved to. Until the pod holds an IP (the kubelet
// reports it after the pod's containers have started; another pod may hold
// its address, see claims.go), the identity is that of its label set if
// one exists already (another pod of the workload has it), so that the pod
// is enforced from its first packet; else it waits, and policy keeps the
// pod denied meanwhile. A host-network pod is the host: it has no identity
// of its own.
func (c *controller) endpoint(txn statedb.ReadTxn, key k8s.Key, s *podState) *tables.Endpoint {
	e := &tables.Endpoint{
		Name: key.String(), IPs: append([]netip.Addr{}, s.ips...), Labels: s.labels,
		UID: s.uid, NamedPorts: slices.Clone(s.ports), Cgroup: s.cgroup.path, CgroupID: s.cgroup.id,
		HostNetwork: s.pod.Spec.HostNetwork, CgroupError: cgroupError(s), Workload: WorkloadOf(s.pod),
	}
	if e.HostNetwork {
		e.Identity, e.IdentitySource = hostIdentity, tables.SourceReserved
		return e
	}
	errs, first, holds := c.claimErrors(key, s)
	e.Error = strings.Join(errs, "; ")
	if !holds {
		if id, _, ok := c.Identities.Get(txn, tables.IdentityLabelsIndex.Query(s.labels.Key())); ok {
			e.Identity, e.IdentitySource = id.ID, id.Source
		}
		return e
	}
	entry, _, found := c.IPCache.Get(txn, tables.IPCachePrefixIndex.Query(tables.HostPrefix(first)))
	// Until the ipcache has resolved the pod's own labels the endpoint
	// waits; the entry's change brings it back.
	switch {
	case !found || !slices.Contains(entry.Owners, owner(key)):
	case entry.Error != "":
		e.Error = strings.Join(append(errs, entry.Error), "; ")
	default:
		e.Identity = entry.Identity
		if id, _, ok := c.Identities.Get(txn, tables.IdentityIDIndex.Query(entry.Identity)); ok {
			e.IdentitySource = id.Source
		}
	}
	return e
}

func sameEndpoint(a, b *tables.Endpoint) bool {
	return a.Name == b.Name && slices.Equal(a.IPs, b.IPs) && a.Labels.Equal(b.Labels) &&
		a.Identity == b.Identity && a.IdentitySource == b.IdentitySource && a.Error == b.Error &&
		a.UID == b.UID && slices.Equal(a.NamedPorts, b.NamedPorts) && a.Cgroup == b.Cgroup && a.CgroupID == b.CgroupID &&
		a.HostNetwork == b.HostNetwork && a.CgroupError == b.CgroupError &&
		(a.Workload == nil) == (b.Workload == nil) && (a.Workload == nil || *a.Workload == *b.Workload)
}

// problems says what is wrong with the pods, "" when nothing is: addresses
// claimed by several pods, local pods whose UID cannot name a cgroup.
func (c *controller) problems() string {
	var out []string
	if s := c.claimsHealth(); s != "" {
		out = append(out, s)
	}
	if len(c.badUID) > 0 {
		var badUID []string
		for key := range c.badUID {
			badUID = append(badUID, key.String())
		}
		slices.Sort(badUID)
		out = append(out, fmt.Sprintf("%d pods not enforced, their UID cannot name a cgroup: %s",
			len(badUID), strings.Join(badUID, ", ")))
	}
	return strings.Join(out, "; ")
}
