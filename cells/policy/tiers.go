package policy

import (
	"slices"

	"github.com/apiary-net/apiary/tables"
)

// ClusterNetworkPolicy tiers: how the Admin and Baseline tiers'
// contributions decide an entry (docs/policy.md).

// tierLayer returns the layer of a rule's tier.
func tierLayer(tier string) uint8 {
	switch tier {
	case tables.TierAdmin:
		return layerAdmin
	case tables.TierBaseline:
		return layerBaseline
	}
	return layerRules
}

// hasTiered says whether a group of a peer identity has contributions of
// ClusterNetworkPolicy rules: its entries are then computed by
// recomputeTiered.
func (ep *endpoint) hasTiered(gk groupKey, keys []portKey) bool {
	for _, pk := range keys {
		for _, c := range ep.contribs[entryKey{gk.identity, gk.dir, pk}] {
			if c.tier == layerAdmin || c.tier == layerBaseline {
				return true
			}
		}
	}
	return false
}

// recomputeTiered returns the entries of a group of a peer identity that
// ClusterNetworkPolicy rules contribute to, sorted by port. Each decides
// alone (final), with every layer folded in: the group's own
// contributions and those of identity 0 in the same direction, since the
// datapath looks up identity 0 no more once a final entry matched. The
// keys are the group's and those of identity 0 inside one of them, so
// that the longest-prefix match finds, for any port, the key whose
// covering contributions are exactly those that apply to the port; each
// key's decision is then that of the layers in order (decideTiered).
func (ep *endpoint) recomputeTiered(gk groupKey, keys []portKey, audited func(policy string) bool) []portEntry {
	zero := ep.groups[groupKey{0, gk.dir}]
	all := slices.Clone(keys)
	for _, k0 := range zero {
		if !slices.Contains(all, k0) && slices.ContainsFunc(keys, func(k portKey) bool { return k.covers(k0) }) {
			all = append(all, k0)
		}
	}
	out := make([]portEntry, 0, len(all))
	var cs []contrib
	for _, pk := range all {
		cs = cs[:0]
		for _, k := range keys {
			if k.covers(pk) {
				for _, c := range ep.contribs[entryKey{gk.identity, gk.dir, k}] {
					cs = append(cs, c.contrib)
				}
			}
		}
		for _, k := range zero {
			if k.covers(pk) {
				for _, c := range ep.contribs[entryKey{0, gk.dir, k}] {
					cs = append(cs, c.contrib)
				}
			}
		}
		out = append(out, portEntry{pk, ep.decideTiered(cs, gk.dir, audited)})
	}
	// A key of identity 0 that decides as the longest key covering it
	// adds nothing: the lookup would find that one instead, to the same
	// effect. (An Admin rule of every port over a NetworkPolicy of many
	// ports to any peer would otherwise copy those ports into every
	// peer's group.)
	if len(all) > len(keys) {
		kept := out[:0:0]
		for i, pe := range out {
			if i >= len(keys) {
				var parent *portEntry
				for j := range out[:len(all)] {
					c := &out[j]
					if c.port != pe.port && c.port.covers(pe.port) && (parent == nil || parent.port.covers(c.port)) {
						parent = c
					}
				}
				if parent != nil && parent.v.equal(pe.v) {
					continue
				}
			}
			kept = append(kept, pe)
		}
		out = kept
	}
	slices.SortFunc(out, func(a, b portEntry) int { return comparePorts(a.port, b.port) })
	return out
}

// decideTiered is the decision of the contributions that apply to a
// connection, layer by layer (the API's order): the first Admin tier rule
// (lowest priority, then policy name, then rule index) decides if it is
// Accept or Deny, and hands over if Pass; then NetworkPolicy and CNP
// rules (deny wins over allow), and their default deny when one puts the
// direction into it (the entry passes: the datapath's default deny, and
// its allow by address, decide as they would without the tiers); then the
// first Baseline tier rule; then the default (the entry passes too).
// Where an invalid policy keeps the direction closed, Accept rules are
// left out.
func (ep *endpoint) decideTiered(cs []contrib, dir uint8, audited func(policy string) bool) entryValue {
	var admin, base *contrib
	var denies, allows []string
	podAddrs := false
	// A direction an invalid policy keeps closed takes no Accept of a
	// tier: the API makes a broken Deny or Pass rule "deny all" at its
	// priority, which the entries cannot place, so no Accept overrides
	// the fail-closed default deny.
	failClosed := (dir == dirIngress && len(ep.failIngress) > 0) || (dir == dirEgress && len(ep.failEgress) > 0)
	for i := range cs {
		c := &cs[i]
		if failClosed && (c.tier == layerAdmin || c.tier == layerBaseline) && !c.deny && !c.pass {
			continue
		}
		switch c.tier {
		case layerAdmin:
			if admin == nil || c.before(admin) {
				admin = c
			}
		case layerBaseline:
			if base == nil || c.before(base) {
				base = c
			}
		case layerRules:
			if c.deny {
				if !slices.Contains(denies, c.policy) {
					denies = append(denies, c.policy)
				}
			} else {
				if !slices.Contains(allows, c.policy) {
					allows = append(allows, c.policy)
				}
				podAddrs = podAddrs || c.podAddrs
			}
		}
	}
	passed := ""
	if admin != nil {
		switch {
		case admin.pass:
			passed = admin.label
		case admin.deny:
			return entryValue{final: true, deny: true, drop: true, audit: audited(admin.policy), policies: []string{admin.label}}
		default:
			return entryValue{final: true, policies: []string{admin.label}}
		}
	}
	// named prefixes the first of the deciding policies with the Pass
	// that handed over to them.
	named := func(ps []string) []string {
		slices.Sort(ps)
		if passed != "" {
			ps[0] = passed + passArrow + ps[0]
		}
		return ps
	}
	switch {
	case len(denies) > 0:
		audit := true
		for _, p := range denies {
			audit = audit && audited(p)
		}
		return entryValue{final: true, deny: true, audit: audit, policies: named(denies)}
	case len(allows) > 0:
		return entryValue{final: true, podAddrs: podAddrs, policies: named(allows)}
	case !ep.rulesDeny[dir] && base != nil && !base.pass:
		if base.deny {
			return entryValue{final: true, deny: true, drop: true, audit: audited(base.policy), policies: named([]string{base.label})}
		}
		return entryValue{final: true, policies: named([]string{base.label})}
	}
	v := entryValue{pass: true}
	if passed != "" {
		v.policies = []string{passed}
	}
	return v
}
