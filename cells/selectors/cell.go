// Package selectors owns the policies and selectors tables: it decodes
// CiliumNetworkPolicy, CiliumClusterwideNetworkPolicy and NetworkPolicy
// objects (from Kubernetes or --config-dir), keeps every distinct selector with the
// identities it selects, and labels the prefixes the policies name
// (owner "policy", reference-counted across policies) so that they get
// CIDR identities. See docs/identities.md.
package selectors

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	networkingv1 "k8s.io/api/networking/v1"

	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/internal/wake"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the read-only policies and selectors tables and the
// Resources of the three policy kinds.
var Cell = cell.Module(
	"selectors",
	"Policies and the identities their selectors select",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(
		tables.NewPoliciesTable,
		tables.NewSelectorsTable,
	),
	cell.Provide(
		statedb.RWTable[*tables.Policy].ToTable,
		statedb.RWTable[*tables.Selector].ToTable,
		func(p k8s.ResourceParams) k8s.Resource[*CiliumNetworkPolicy] { return k8s.NewResource(p, CNPKind) },
		func(p k8s.ResourceParams) k8s.Resource[*CiliumClusterwideNetworkPolicy] {
			return k8s.NewResource(p, CCNPKind)
		},
		func(p k8s.ResourceParams) k8s.Resource[*networkingv1.NetworkPolicy] {
			return k8s.NewResource(p, NetworkPolicyKind)
		},
		func(p k8s.ResourceParams) k8s.Resource[*ClusterNetworkPolicy] {
			return k8s.NewResource(p, ClusterNetpolKind)
		},
		newPoliciesSynced,
	),
	cell.Invoke(registerController),
)

// PoliciesSynced says when the policies table holds the rows of every
// policy the sources had at start (before the table is initialized,
// which waits for the ipcache). The endpoints cell waits for it before
// labelling pods, so that a pod's first identity already carries the
// labels policies select by (tables.Policy.SelectedLabelKeys).
type PoliciesSynced struct {
	ch   chan struct{}
	once sync.Once
}

func newPoliciesSynced() *PoliciesSynced { return &PoliciesSynced{ch: make(chan struct{})} }

// Done is closed once the policies have synced.
func (s *PoliciesSynced) Done() <-chan struct{} { return s.ch }

func (s *PoliciesSynced) mark() { s.once.Do(func() { close(s.ch) }) }

// OwnerPolicy owns the prefixes named by policies.
const OwnerPolicy = "policy"

type controllerParams struct {
	cell.In

	Log        *slog.Logger
	Config     Config
	DB         *statedb.DB
	Jobs       job.Group
	Node       node.Config
	Policies   statedb.RWTable[*tables.Policy]
	Selectors  statedb.RWTable[*tables.Selector]
	Identities statedb.Table[*tables.Identity]
	IPCache    statedb.Table[*tables.IPCacheEntry]
	Prefixes   ipcache.Prefixes
	CNPs       k8s.Resource[*CiliumNetworkPolicy]
	CCNPs      k8s.Resource[*CiliumClusterwideNetworkPolicy]
	NetPols    k8s.Resource[*networkingv1.NetworkPolicy]
	// ClusterNetpols are policy.networking.k8s.io ClusterNetworkPolicies.
	ClusterNetpols k8s.Resource[*ClusterNetworkPolicy]
	// Synced is marked once the policies of every source are written.
	Synced *PoliciesSynced
	// NodesTable are the cluster's nodes with their labels
	// (cells/clusternodes), which ClusterNetworkPolicy nodes peers
	// select; absent, nodes peers select nothing.
	NodesTable statedb.Table[*tables.Node] `optional:"true"`
}

type controller struct {
	controllerParams

	// markPolicies and markSelectors mark the tables initialized.
	markPolicies, markSelectors func(statedb.WriteTxn)

	cache *selectorCache
	// nodePeers are the ClusterNetworkPolicy nodes peers and what they
	// labelled.
	nodePeers *nodePeers
	// endpointFQDN keeps the selectors of one endpoint's FQDN labels.
	endpointFQDN *endpointFQDN
	policies     map[string]*parsedPolicy
	// invalid are the policies with errors, for the health report, which
	// runs after every batch and so must not look at every policy.
	invalid map[string]struct{}
	// cidrRefs counts the policies naming each prefix.
	cidrRefs map[netip.Prefix]int
	// podNetRefs counts the policies naming each prefix as a
	// ClusterNetworkPolicy networks peer (each also in cidrRefs).
	podNetRefs map[netip.Prefix]int
	// nodesRev is the nodes table's revision nodePeers last saw.
	nodesRev uint64
	// dirtyPolicies and dirtyCIDRs changed since the last flush.
	dirtyPolicies map[string]struct{}
	dirtyCIDRs    map[netip.Prefix]struct{}
}

func registerController(p controllerParams) error {
	if err := p.Config.validate(); err != nil {
		return err
	}
	c := &controller{
		controllerParams: p,
		cache:            newSelectorCache(),
		nodePeers:        newNodePeers(),
		endpointFQDN:     newEndpointFQDN(),
		policies:         map[string]*parsedPolicy{},
		invalid:          map[string]struct{}{},
		cidrRefs:         map[netip.Prefix]int{},
		podNetRefs:       map[netip.Prefix]int{},
		dirtyPolicies:    map[string]struct{}{},
		dirtyCIDRs:       map[netip.Prefix]struct{}{},
	}
	synced := p.Prefixes.RegisterInitializer("policies")
	wtxn := p.DB.WriteTxn(p.Policies, p.Selectors)
	c.markPolicies = p.Policies.RegisterInitializer(wtxn, "policies-synced")
	c.markSelectors = p.Selectors.RegisterInitializer(wtxn, "identities-selected")
	wtxn.Commit()
	p.Jobs.Add(job.OneShot("policies", func(ctx context.Context, h cell.Health) error {
		return c.run(ctx, h, synced)
	}))
	return nil
}

// failClosed says whether invalid policies are enforced as their
// fail-closed specs.
func (c *controller) failClosed() bool {
	return c.Config.PolicyInvalidMode == InvalidDeny
}

// maxBatch bounds how many events are applied before the tables are
// written, so that a burst (the initial listing) is written in a few
// transactions while a single change is written at once.
const maxBatch = 1000

func (c *controller) run(ctx context.Context, h cell.Health, synced func()) error {
	wtxn := c.DB.WriteTxn(c.Identities)
	idChanges, err := c.Identities.Changes(wtxn)
	wtxn.Commit()
	if err != nil {
		return fmt.Errorf("watch identities: %w", err)
	}
	defer idChanges.Close()

	cnps, ccnps, netpols := c.CNPs.Events(ctx), c.CCNPs.Events(ctx), c.NetPols.Events(ctx)
	clusterNetpols := c.ClusterNetpols.Events(ctx)
	cnpSynced, ccnpSynced, netpolSynced, initDone := false, false, false, false
	clusterNetpolSynced := false
	onCNP := k8s.TrackSync(&cnpSynced, func(ev k8s.Event[*CiliumNetworkPolicy]) {
		name := "cnp/" + ev.Key.String()
		if ev.Kind == k8s.Delete {
			c.setPolicy(name, nil)
		} else {
			c.logUnknown(name, ev.Object.UnknownFields())
			c.setPolicy(name, parsePolicy(name, ev.Key.Namespace, ev.Object.Spec, ev.Object.Specs, ev.Object.UnsupportedFields()).
				withAudit(ev.Object.Annotations))
		}
	})
	onCCNP := k8s.TrackSync(&ccnpSynced, func(ev k8s.Event[*CiliumClusterwideNetworkPolicy]) {
		name := "ccnp/" + ev.Key.String()
		if ev.Kind == k8s.Delete {
			c.setPolicy(name, nil)
		} else {
			c.logUnknown(name, ev.Object.UnknownFields())
			c.setPolicy(name, parsePolicy(name, "", ev.Object.Spec, ev.Object.Specs, ev.Object.UnsupportedFields()).
				withAudit(ev.Object.Annotations))
		}
	})
	onNetpol := k8s.TrackSync(&netpolSynced, func(ev k8s.Event[*networkingv1.NetworkPolicy]) {
		name := NetpolPrefix + ev.Key.String()
		if ev.Kind == k8s.Delete {
			c.setPolicy(name, nil)
		} else {
			c.setPolicy(name, parseNetworkPolicy(name, ev.Object).withAudit(ev.Object.Annotations))
		}
	})
	// clusterNetpolSeen are the inputs of each ClusterNetworkPolicy last
	// parsed: an update that changes neither (the status conditions
	// written back, cells/clusternetpolstatus) is no change of the
	// policy, and must not rewrite its row and wake the policy
	// computation.
	clusterNetpolSeen := map[string]clusterNetpolInput{}
	onClusterNetpol := k8s.TrackSync(&clusterNetpolSynced, func(ev k8s.Event[*ClusterNetworkPolicy]) {
		name := ClusterNetpolPrefix + ev.Key.String()
		if ev.Kind == k8s.Delete {
			delete(clusterNetpolSeen, name)
			c.setPolicy(name, nil)
			return
		}
		in := clusterNetpolInputOf(ev.Object)
		if old, ok := clusterNetpolSeen[name]; ok && old.equal(in) {
			return
		}
		clusterNetpolSeen[name] = in
		c.setPolicy(name, parseClusterNetpol(name, ev.Object).withAudit(ev.Object.Annotations))
	})
	tablesInit := false
	for {
		rtxn := c.DB.ReadTxn()
		ipcacheInit, ipcacheInitWatch := c.IPCache.Initialized(rtxn)
		seq, idWatch := idChanges.Next(rtxn)
		for change := range seq {
			if change.Deleted {
				if change.Object.ID == hostIdentity {
					c.nodePeers.hostBase = nil
				}
				c.cache.deleteIdentity(change.Object.ID)
				c.endpointFQDN.update(c.cache, change.Object.ID, nil)
			} else {
				labels := change.Object.Labels
				if change.Object.ID == hostIdentity {
					// The host carries the nodes: labels of the nodes
					// peers selecting this node (see flushNodes).
					c.nodePeers.hostBase = labels
					labels = c.nodePeers.hostIdentityLabels()
				}
				c.cache.upsertIdentity(change.Object.ID, labels)
				c.endpointFQDN.update(c.cache, change.Object.ID, change.Object.Labels)
			}
		}
		var nodesWatch <-chan struct{}
		if c.NodesTable != nil {
			var nodesRev uint64
			nodesRev = c.NodesTable.Revision(rtxn)
			if nodesRev != c.nodesRev || c.nodePeers.dirty {
				c.nodesRev = nodesRev
				if err := c.flushNodes(rtxn); err != nil {
					return err
				}
			}
			_, nodesWatch = c.NodesTable.AllWatch(rtxn)
		}
		if err := c.flush(); err != nil {
			return err
		}
		c.reportHealth(h)
		if !initDone && cnpSynced && ccnpSynced && netpolSynced && clusterNetpolSynced {
			initDone = true
			synced()
			c.Synced.mark()
		}
		// The selectors are complete once the policies have synced and
		// every identity the ipcache had when it was initialized (so
		// those of every prefix known at start) has been matched.
		stopWait := func() {}
		if !tablesInit {
			if initDone && ipcacheInit {
				tablesInit = true
				wtxn := c.DB.WriteTxn(c.Policies, c.Selectors)
				c.markPolicies(wtxn)
				c.markSelectors(wtxn)
				wtxn.Commit()
			} else {
				idWatch, stopWait = wake.Either(idWatch, ipcacheInitWatch)
			}
		}

		// Apply a batch of policy events, or wait for identities or
		// nodes.
		idWatch, stopNodes := wake.Either(idWatch, nodesWatch)
		_, ok := k8s.ReceiveBatch4(ctx, idWatch, maxBatch, cnps, onCNP, ccnps, onCCNP, netpols, onNetpol, clusterNetpols, onClusterNetpol)
		stopWait()
		stopNodes()
		if !ok {
			return nil // the context ended
		}
	}
}

// logUnknown logs the fields of a policy that apiary ignores, outside its
// rules (description, nodeSelector, …): such policies load unchanged, and a
// user who wonders why a field has no effect finds it in the debug log.
// Unknown fields inside rules are errors instead (see parsePolicy).
func (c *controller) logUnknown(name string, fields []string) {
	if len(fields) > 0 {
		c.Log.Debug("Ignoring policy fields apiary does not implement", "policy", name, "fields", strings.Join(fields, ", "))
	}
}

// setPolicy replaces the policy called name (nil: deletes it).
func (c *controller) setPolicy(name string, p *parsedPolicy) {
	if old, ok := c.policies[name]; ok {
		for _, s := range old.selectors() {
			c.cache.removeUser(s.String(), name)
		}
		if old.err == nil {
			c.nodePeers.release(old)
		}
		for _, pfx := range old.cidrs {
			c.cidrRefs[pfx]--
			c.dirtyCIDRs[pfx] = struct{}{}
		}
		for _, pfx := range old.podNets {
			if c.podNetRefs[pfx]--; c.podNetRefs[pfx] <= 0 {
				delete(c.podNetRefs, pfx)
			}
		}
		delete(c.policies, name)
		delete(c.invalid, name)
	}
	c.dirtyPolicies[name] = struct{}{}
	if p == nil {
		return
	}
	c.policies[name] = p
	if p.err != nil {
		c.invalid[name] = struct{}{}
		if !c.failClosed() {
			c.Log.Warn("Invalid policy, ignored", "policy", name, "error", p.errorText())
			return
		}
		// Its subjects must select what they select for the policy to
		// fail closed on those endpoints.
		c.Log.Warn("Invalid policy: the pods it selects are denied in its directions", "policy", name, "error", p.errorText())
		for _, s := range p.subjects {
			c.cache.addUser(s, name)
		}
		return
	}
	for _, s := range p.selectors() {
		c.cache.addUser(s, name)
	}
	c.nodePeers.acquire(p)
	for _, pfx := range p.cidrs {
		c.cidrRefs[pfx]++
		c.dirtyCIDRs[pfx] = struct{}{}
	}
	for _, pfx := range p.podNets {
		c.podNetRefs[pfx]++
	}
}

// cidrLabels are the labels a policy prefix gets.
func (c *controller) cidrLabels(p netip.Prefix) []string {
	world := tables.LabelWorld
	if c.Node.EnableIPv6 {
		world = tables.LabelWorldIPv4
		if p.Addr().Is6() {
			world = tables.LabelWorldIPv6
		}
	}
	if c.podNetRefs[p] > 0 {
		// Pods inside it take it down (ipcache normalize).
		return []string{tables.CIDRLabel(p), tables.PodNetLabel(p), world}
	}
	return []string{tables.CIDRLabel(p), world}
}

// writeChunk bounds the rows one write transaction of the controller
// writes: prefix changes per Prefixes.Update, policy and selector rows per
// transaction on the policies and selectors tables. A policy of 20,000
// CIDRs is written in ten transactions of each kind, and other writers of
// those tables (the DNS proxy and the endpoints labelling prefixes, say)
// get in between them instead of waiting for the whole policy.
const writeChunk = 2000

// testHookCommitted, when set (by tests), is called after each chunk is
// committed, with the table written ("prefixes" or "selectors"), the
// chunk's number from 1 and the number of chunks.
var testHookCommitted func(table string, chunk, chunks int)

// flush writes what changed: prefixes first (so that their identities
// come), then policies and selectors.
func (c *controller) flush() error {
	if err := c.flushPrefixes(); err != nil {
		return err
	}
	return c.flushRows()
}

// flushPrefixes writes the changes of the policy prefixes, in chunks of
// writeChunk. Added prefixes go longest first and removed ones shortest
// first, added before removed: a prefix of another owner inside a policy's
// CIDRs then gets its final cidr: label with the first chunk that changes
// it, so it changes identity at most once however the change is split, as
// it would in one transaction.
func (c *controller) flushPrefixes() error {
	if len(c.dirtyCIDRs) == 0 {
		return nil
	}
	var upserts, deletes []netip.Prefix
	for pfx := range c.dirtyCIDRs {
		if c.cidrRefs[pfx] > 0 {
			upserts = append(upserts, pfx)
		} else {
			delete(c.cidrRefs, pfx)
			deletes = append(deletes, pfx)
		}
	}
	sortPrefixChanges(upserts, deletes)
	changes := make([]ipcache.Change, 0, len(upserts)+len(deletes))
	for _, pfx := range upserts {
		changes = append(changes, ipcache.Upsert(pfx, OwnerPolicy, c.cidrLabels(pfx)...))
	}
	for _, pfx := range deletes {
		changes = append(changes, ipcache.Delete(pfx, OwnerPolicy))
	}
	chunks := (len(changes) + writeChunk - 1) / writeChunk
	i := 0
	for chunk := range slices.Chunk(changes, writeChunk) {
		i++
		if _, err := c.Prefixes.Update(chunk...); err != nil {
			return fmt.Errorf("label policy prefixes: %w", err)
		}
		if testHookCommitted != nil {
			testHookCommitted("prefixes", i, chunks)
		}
	}
	clear(c.dirtyCIDRs)
	return nil
}

// sortPrefixChanges puts the prefixes to add longest first and those to
// remove shortest first (see flushPrefixes).
func sortPrefixChanges(upserts, deletes []netip.Prefix) {
	slices.SortFunc(upserts, func(a, b netip.Prefix) int { return cmp.Or(b.Bits()-a.Bits(), a.Addr().Compare(b.Addr())) })
	slices.SortFunc(deletes, func(a, b netip.Prefix) int { return cmp.Or(a.Bits()-b.Bits(), a.Addr().Compare(b.Addr())) })
}

// rowWrite is one write of flushRows: a row to insert, or the key of one
// to delete.
type rowWrite struct {
	policy         *tables.Policy
	selector       *tables.Selector
	deletePolicy   string
	deleteSelector string
}

// flushRows writes the changed policy and selector rows, in transactions
// of at most writeChunk rows. So that every commit in between is
// consistent (each selector a policies row names is in the selectors
// table, listing that policy), the writes go in this order:
//
//  1. rows of deleted policies go;
//  2. selector rows get their new identities and policies, but keep the
//     policies whose old row still names them (changed policies that no
//     longer use them);
//  3. rows of new and changed policies are written;
//  4. the selectors kept in step 2 for changed policies lose them (or go).
//
// Adding a big policy thus writes its selectors first and its row last;
// removing one deletes its row first and its selectors after. Selector
// rows follow identities as before: asynchronously, so a reader may see a
// selector before the identities it selects.
func (c *controller) flushRows() error {
	dirtySelectors := c.cache.takeDirty()
	if len(c.dirtyPolicies) == 0 && len(dirtySelectors) == 0 {
		return nil
	}
	rtxn := c.DB.ReadTxn() // the table as it is: only this controller writes it
	names := slices.Sorted(maps.Keys(c.dirtyPolicies))
	var writes, last []rowWrite
	// Changed policies: their old row stays until step 3.
	changed := map[string]struct{}{}
	for _, name := range names {
		if _, ok := c.policies[name]; !ok {
			writes = append(writes, rowWrite{deletePolicy: name})
		} else if _, _, found := c.Policies.Get(rtxn, tables.PolicyNameIndex.Query(name)); found {
			changed[name] = struct{}{}
		}
	}
	for _, key := range slices.Sorted(maps.Keys(dirtySelectors)) {
		row := dirtySelectors[key]
		old, _, found := c.Selectors.Get(rtxn, tables.SelectorIndex.Query(key))
		var keep []string
		if found {
			for _, p := range old.Policies {
				if _, ok := changed[p]; ok && (row == nil || !slices.Contains(row.Policies, p)) {
					keep = append(keep, p)
				}
			}
		}
		switch {
		case len(keep) > 0:
			interim := &tables.Selector{Selector: key, Identities: old.Identities, Policies: keep}
			if row != nil {
				interim.Identities = row.Identities
				interim.Policies = slices.Sorted(slices.Values(append(slices.Clone(row.Policies), keep...)))
				last = append(last, rowWrite{selector: row})
			} else {
				last = append(last, rowWrite{deleteSelector: key})
			}
			writes = append(writes, rowWrite{selector: interim})
		case row == nil:
			if found {
				writes = append(writes, rowWrite{deleteSelector: key})
			}
		case found && slices.Equal(old.Identities, row.Identities) && slices.Equal(old.Policies, row.Policies):
		default:
			writes = append(writes, rowWrite{selector: row})
		}
	}
	for _, name := range names {
		if p, ok := c.policies[name]; ok {
			writes = append(writes, rowWrite{policy: policyRow(name, p, c.failClosed())})
		}
	}
	writes = append(writes, last...)

	chunks := (len(writes) + writeChunk - 1) / writeChunk
	i := 0
	for chunk := range slices.Chunk(writes, writeChunk) {
		i++
		if err := c.writeRows(chunk); err != nil {
			return err
		}
		if testHookCommitted != nil {
			testHookCommitted("selectors", i, chunks)
		}
	}
	clear(c.dirtyPolicies)
	return nil
}

// writeRows applies writes in one write transaction.
func (c *controller) writeRows(writes []rowWrite) error {
	wtxn := c.DB.WriteTxn(c.Policies, c.Selectors)
	defer wtxn.Abort()
	for _, w := range writes {
		var err error
		switch {
		case w.policy != nil:
			_, _, err = c.Policies.Insert(wtxn, w.policy)
		case w.selector != nil:
			_, _, err = c.Selectors.Insert(wtxn, w.selector)
		case w.deletePolicy != "":
			_, _, err = c.Policies.Delete(wtxn, &tables.Policy{Name: w.deletePolicy})
		default:
			_, _, err = c.Selectors.Delete(wtxn, &tables.Selector{Selector: w.deleteSelector})
		}
		if err != nil {
			return err
		}
	}
	wtxn.Commit()
	return nil
}

// policyRow is the policies row of p; failClosed says whether an invalid
// policy's fail-closed specs are enforced.
func policyRow(name string, p *parsedPolicy, failClosed bool) *tables.Policy {
	row := &tables.Policy{Name: name, Status: tables.PolicyOK, Subjects: []string{}, Peers: []string{}, Audit: p.audit,
		SelectedLabelKeys: p.labelKeys}
	if p.err != nil {
		row.Status, row.Error = tables.PolicyError, p.errorText()
		row.Specs, row.FailClosed = p.failClosed, failClosed && len(p.failClosed) > 0
	}
	for _, s := range p.subjects {
		row.Subjects = append(row.Subjects, s.String())
	}
	for _, s := range p.peers {
		row.Peers = append(row.Peers, s.String())
	}
	for _, pfx := range p.cidrs {
		row.CIDRs = append(row.CIDRs, pfx.String())
	}
	// Shared with the parsed policy: rows are immutable once written, and
	// the parsed policy never changes.
	if p.err == nil {
		row.Specs = p.specs
	}
	return row
}

func (c *controller) reportHealth(h cell.Health) {
	if len(c.invalid) == 0 {
		h.OK(fmt.Sprintf("%d policies, %d selectors", len(c.policies), len(c.cache.selectors)))
		return
	}
	bad := slices.Sorted(maps.Keys(c.invalid))
	what := "ignored (--" + InvalidModeFlag + "=" + InvalidIgnore + ")"
	if c.failClosed() {
		what = "the pods they select are denied in their directions"
	}
	h.Degraded(fmt.Sprintf("%d invalid policies, %s: %s", len(bad), what, strings.Join(bad, ", ")),
		fmt.Errorf("%s: %s", bad[0], c.policies[bad[0]].errorText()))
}
