// Package selectors owns the policies and selectors tables: it decodes
// CiliumNetworkPolicy and CiliumClusterwideNetworkPolicy objects (from
// Kubernetes or --config-dir), keeps every distinct selector with the
// identities it selects, and labels the prefixes the policies name
// (owner "policy", reference-counted across policies) so that they get
// CIDR identities. See docs/identities.md.
package selectors

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the read-only policies and selectors tables and the
// Resources of the two policy kinds.
var Cell = cell.Module(
	"selectors",
	"Policies and the identities their selectors select",

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
	),
	cell.Invoke(registerController),
)

// OwnerPolicy owns the prefixes named by policies.
const OwnerPolicy = "policy"

type controllerParams struct {
	cell.In

	Log        *slog.Logger
	DB         *statedb.DB
	Jobs       job.Group
	Node       node.Config
	Policies   statedb.RWTable[*tables.Policy]
	Selectors  statedb.RWTable[*tables.Selector]
	Identities statedb.Table[*tables.Identity]
	Prefixes   ipcache.Prefixes
	CNPs       k8s.Resource[*CiliumNetworkPolicy]
	CCNPs      k8s.Resource[*CiliumClusterwideNetworkPolicy]
}

type controller struct {
	controllerParams

	cache    *selectorCache
	policies map[string]*parsedPolicy
	// cidrRefs counts the policies naming each prefix.
	cidrRefs map[netip.Prefix]int
	// dirtyPolicies and dirtyCIDRs changed since the last flush.
	dirtyPolicies map[string]struct{}
	dirtyCIDRs    map[netip.Prefix]struct{}
}

func registerController(p controllerParams) {
	c := &controller{
		controllerParams: p,
		cache:            newSelectorCache(),
		policies:         map[string]*parsedPolicy{},
		cidrRefs:         map[netip.Prefix]int{},
		dirtyPolicies:    map[string]struct{}{},
		dirtyCIDRs:       map[netip.Prefix]struct{}{},
	}
	synced := p.Prefixes.RegisterInitializer("policies")
	p.Jobs.Add(job.OneShot("policies", func(ctx context.Context, h cell.Health) error {
		return c.run(ctx, h, synced)
	}))
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

	cnps, ccnps := c.CNPs.Events(ctx), c.CCNPs.Events(ctx)
	cnpSynced, ccnpSynced, initDone := false, false, false
	onCNP := k8s.TrackSync(&cnpSynced, func(ev k8s.Event[*CiliumNetworkPolicy]) {
		name := "cnp/" + ev.Key.String()
		if ev.Kind == k8s.Delete {
			c.setPolicy(name, nil)
		} else {
			c.logUnknown(name, ev.Object.UnknownFields())
			c.setPolicy(name, parsePolicy(name, ev.Key.Namespace, ev.Object.Spec, ev.Object.Specs))
		}
	})
	onCCNP := k8s.TrackSync(&ccnpSynced, func(ev k8s.Event[*CiliumClusterwideNetworkPolicy]) {
		name := "ccnp/" + ev.Key.String()
		if ev.Kind == k8s.Delete {
			c.setPolicy(name, nil)
		} else {
			c.logUnknown(name, ev.Object.UnknownFields())
			c.setPolicy(name, parsePolicy(name, "", ev.Object.Spec, ev.Object.Specs))
		}
	})
	for {
		seq, idWatch := idChanges.Next(c.DB.ReadTxn())
		for change := range seq {
			if change.Deleted {
				c.cache.deleteIdentity(change.Object.ID)
			} else {
				c.cache.upsertIdentity(change.Object.ID, change.Object.Labels)
			}
		}
		if err := c.flush(); err != nil {
			return err
		}
		c.reportHealth(h)
		if !initDone && cnpSynced && ccnpSynced {
			initDone = true
			synced()
		}

		// Apply a batch of policy events, or wait for identities.
		if _, ok := k8s.ReceiveBatch2(ctx, idWatch, maxBatch, cnps, onCNP, ccnps, onCCNP); !ok {
			return nil // the context ended
		}
	}
}

// logUnknown logs the fields of a policy that apiary ignores (toPorts,
// ingressDeny, …): existing policies load unchanged, and a user who wonders
// why a field has no effect finds it in the debug log.
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
		for _, pfx := range old.cidrs {
			c.cidrRefs[pfx]--
			c.dirtyCIDRs[pfx] = struct{}{}
		}
		delete(c.policies, name)
	}
	c.dirtyPolicies[name] = struct{}{}
	if p == nil {
		return
	}
	c.policies[name] = p
	if p.err != nil {
		c.Log.Warn("Invalid policy", "policy", name, "error", p.errorText())
		return
	}
	for _, s := range p.selectors() {
		c.cache.addUser(s, name)
	}
	for _, pfx := range p.cidrs {
		c.cidrRefs[pfx]++
		c.dirtyCIDRs[pfx] = struct{}{}
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
	return []string{tables.CIDRLabel(p), world}
}

// flush writes what changed: prefixes first (so that their identities
// come), then policies and selectors.
func (c *controller) flush() error {
	if len(c.dirtyCIDRs) > 0 {
		changes := make([]ipcache.Change, 0, len(c.dirtyCIDRs))
		for pfx := range c.dirtyCIDRs {
			if c.cidrRefs[pfx] > 0 {
				changes = append(changes, ipcache.Upsert(pfx, OwnerPolicy, c.cidrLabels(pfx)...))
			} else {
				delete(c.cidrRefs, pfx)
				changes = append(changes, ipcache.Delete(pfx, OwnerPolicy))
			}
		}
		if _, err := c.Prefixes.Update(changes...); err != nil {
			return fmt.Errorf("label policy prefixes: %w", err)
		}
		clear(c.dirtyCIDRs)
	}
	dirtySelectors := c.cache.takeDirty()
	if len(c.dirtyPolicies) == 0 && len(dirtySelectors) == 0 {
		return nil
	}
	wtxn := c.DB.WriteTxn(c.Policies, c.Selectors)
	defer wtxn.Abort()
	for name := range c.dirtyPolicies {
		p, ok := c.policies[name]
		if !ok {
			if _, _, err := c.Policies.Delete(wtxn, &tables.Policy{Name: name}); err != nil {
				return err
			}
			continue
		}
		row := &tables.Policy{Name: name, Status: tables.PolicyOK, Subjects: []string{}, Peers: []string{}}
		if p.err != nil {
			row.Status, row.Error = tables.PolicyError, p.errorText()
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
		if _, _, err := c.Policies.Insert(wtxn, row); err != nil {
			return err
		}
	}
	for key, row := range dirtySelectors {
		if row == nil {
			if _, _, err := c.Selectors.Delete(wtxn, &tables.Selector{Selector: key}); err != nil {
				return err
			}
			continue
		}
		if old, _, found := c.Selectors.Get(wtxn, tables.SelectorIndex.Query(key)); found &&
			slices.Equal(old.Identities, row.Identities) && slices.Equal(old.Policies, row.Policies) {
			continue
		}
		if _, _, err := c.Selectors.Insert(wtxn, row); err != nil {
			return err
		}
	}
	wtxn.Commit()
	clear(c.dirtyPolicies)
	return nil
}

func (c *controller) reportHealth(h cell.Health) {
	var bad []string
	for name, p := range c.policies {
		if p.err != nil {
			bad = append(bad, name)
		}
	}
	if len(bad) == 0 {
		h.OK(fmt.Sprintf("%d policies, %d selectors", len(c.policies), len(c.cache.selectors)))
		return
	}
	slices.Sort(bad)
	h.Degraded(fmt.Sprintf("%d invalid policies: %s", len(bad), strings.Join(bad, ", ")),
		fmt.Errorf("%s: %s", bad[0], c.policies[bad[0]].errorText()))
}
