package ipcache

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/tables"
)

// resolver turns the prefixes table into the ipcache table: for each
// prefix, the union of its owners' labels and of the labels of every
// shorter prefix containing it, normalised, with the identity of that label
// set. It writes the policy-prefixes table along: the prefixes an owner
// gives a cidr: label (those policies name), each with the labels only
// such owners give it and the prefixes containing it, as an address outside
// the cluster would have them. Where the ipcache gives a prefix the identity
// of a pod or the host, the policy-prefixes table keeps its CIDR identity,
// by which a NetworkPolicy ipBlock matches the pod's address.
//
// A change of a prefix re-resolves the prefix and the prefixes inside it,
// found with one range scan of the prefixes table (its keys sort by
// address, see tables.PrefixKey), never with a full scan. Changes are
// applied in chunks, each in its own write transaction that acquires the
// new identities and releases the old ones, so that a mass relabel never
// holds both identities of every prefix at once.
type resolver struct {
	log      *slog.Logger
	db       *statedb.DB
	prefixes *prefixes
	table    statedb.RWTable[*tables.PrefixLabels]
	// ipcache and policy are the tables written, the ipcache and
	// policy-prefixes.
	ipcache, policy view
	alloc           *identity.Allocator
	// dualStack: world-ipv4/world-ipv6 instead of world.
	dualStack bool
	chunkSize int

	// lengths counts the distinct prefixes of each (family, length), so
	// that looking for the ancestors of a prefix skips the lengths nobody
	// uses.
	lengths [2][129]int
	present map[netip.Prefix]struct{}
	// failed are prefixes whose identity could not be allocated; they are
	// retried whenever identities are released and periodically.
	failed map[netip.Prefix]string
	// released is set when identities were released since failed prefixes
	// were last retried.
	released bool

	markInitialized func(statedb.WriteTxn)
	initialized     bool
}

// view is a table the resolver writes, and the identities the map it is
// reconciled into had when the agent started (hints), kept until the grace
// period starts.
type view struct {
	table statedb.RWTable[*tables.IPCacheEntry]
	hints map[netip.Prefix]uint32
}

// retryInterval is how often prefixes without identity are retried.
const retryInterval = 5 * time.Second

func familyIndex(p netip.Prefix) int {
	if p.Addr().Is4() {
		return 0
	}
	return 1
}

func (r *resolver) run(ctx context.Context, health cell.Health) error {
	wtxn := r.db.WriteTxn(r.table)
	changes, err := r.table.Changes(wtxn)
	wtxn.Commit()
	if err != nil {
		return fmt.Errorf("watch prefixes: %w", err)
	}
	defer changes.Close()

	retry := time.NewTicker(retryInterval)
	defer retry.Stop()
	// Kept until it fires and renewed before renumbering, so that no
	// change of the cluster numbers is missed.
	renumber := r.alloc.RenumberWatch()
	for {
		rtxn := r.db.ReadTxn()
		seq, watch := changes.Next(rtxn)
		dirty := map[netip.Prefix]struct{}{}
		for change := range seq {
			dirty[change.Object.Prefix] = struct{}{}
		}
		r.updatePresence(rtxn, dirty)
		// Sorted, a prefix comes after the prefixes containing it, and one
		// inside the range scanned last was found by that scan.
		var scanned netip.Prefix
		for _, p := range slices.SortedFunc(maps.Keys(dirty), comparePrefixes) {
			if scanned.IsValid() && scanned.Addr().Is4() == p.Addr().Is4() && scanned.Bits() <= p.Bits() && scanned.Contains(p.Addr()) {
				continue
			}
			if r.addDescendants(rtxn, p, dirty) {
				scanned = p
			}
		}
		if r.released {
			// Released identities may make room for prefixes that had none.
			for p := range r.failed {
				dirty[p] = struct{}{}
			}
			r.released = false
		}
		progress, err := r.process(slices.SortedFunc(maps.Keys(dirty), comparePrefixes))
		if err != nil {
			return err
		}
		r.reportHealth(health)
		progress.PrefixesRev = r.table.Revision(rtxn)
		r.prefixes.resolved(progress)

		initWatch := (<-chan struct{})(nil)
		if !r.initialized {
			var init bool
			init, initWatch = r.table.Initialized(rtxn)
			if init {
				r.finishInit()
				initWatch = nil
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		case <-initWatch:
		case <-renumber:
			renumber = r.alloc.RenumberWatch()
			if err := r.renumber(); err != nil {
				return err
			}
			r.reportHealth(health)
		case <-retry.C:
			switch {
			case renumber != nil:
				// Numbers freed without a change of the cluster numbers
				// (restored ones released) may be wanted by label sets;
				// renumber retries the failed prefixes too.
				if err := r.renumber(); err != nil {
					return err
				}
				r.reportHealth(health)
			case len(r.failed) > 0:
				if _, err := r.process(slices.SortedFunc(maps.Keys(r.failed), comparePrefixes)); err != nil {
					return err
				}
				r.reportHealth(health)
			}
		}
	}
}

// renumber moves the entries of identities whose number changed (the
// operator mode: a temporary number replaced by the Identity's), in the
// same transaction as the identities, then retries the prefixes that had
// no identity, for which a number may have appeared.
func (r *resolver) renumber() error {
	wtxn := r.db.WriteTxn(r.ipcache.table, r.policy.table, r.alloc.Table())
	defer wtxn.Abort()
	moved, err := r.alloc.Renumber(wtxn)
	if err != nil {
		return fmt.Errorf("renumber identities: %w", err)
	}
	for _, t := range []statedb.RWTable[*tables.IPCacheEntry]{r.ipcache.table, r.policy.table} {
		if len(moved) == 0 {
			break
		}
		for e := range t.All(wtxn) {
			if n, ok := moved[e.Identity]; ok {
				c := e.Clone()
				c.Identity = n
				c.Status = reconciler.StatusPending()
				if _, _, err := t.Insert(wtxn, c); err != nil {
					return err
				}
			}
		}
	}
	wtxn.Commit()
	if len(r.failed) > 0 {
		if _, err := r.process(slices.SortedFunc(maps.Keys(r.failed), comparePrefixes)); err != nil {
			return err
		}
	}
	return nil
}

// finishInit marks the ipcache table initialized once every owner's
// initial prefixes are resolved: the reconciler may now prune the map of
// entries an earlier run left, and the restore grace period starts.
func (r *resolver) finishInit() {
	wtxn := r.db.WriteTxn(r.ipcache.table, r.policy.table)
	r.markInitialized(wtxn)
	wtxn.Commit()
	r.initialized = true
	r.ipcache.hints, r.policy.hints = nil, nil
	r.alloc.StartGracePeriod()
	r.log.Info("ipcache initialized", "prefixes", len(r.present))
}

func (r *resolver) reportHealth(h cell.Health) {
	if len(r.failed) == 0 {
		h.OK(fmt.Sprintf("%d prefixes resolved", len(r.present)))
		return
	}
	first := slices.MinFunc(slices.Collect(maps.Keys(r.failed)), comparePrefixes)
	h.Degraded(fmt.Sprintf("%d prefixes without identity", len(r.failed)),
		fmt.Errorf("%s: %s", first, r.failed[first]))
}

// updatePresence updates which prefixes exist after changes of dirty.
func (r *resolver) updatePresence(txn statedb.ReadTxn, dirty map[netip.Prefix]struct{}) {
	for p := range dirty {
		_, had := r.present[p]
		has := false
		for range r.table.Prefix(txn, tables.PrefixOwners(p)) {
			has = true
			break
		}
		switch {
		case has && !had:
			r.present[p] = struct{}{}
			r.lengths[familyIndex(p)][p.Bits()]++
		case had && !has:
			delete(r.present, p)
			r.lengths[familyIndex(p)][p.Bits()]--
		}
	}
}

// addDescendants adds the prefixes strictly inside p to dirty. They are the
// run of keys from p's key up to the first address outside p. It returns
// whether it scanned.
func (r *resolver) addDescendants(txn statedb.ReadTxn, p netip.Prefix, dirty map[netip.Prefix]struct{}) bool {
	if p.Bits() == p.Addr().BitLen() {
		return false // a single address has nothing inside
	}
	var last netip.Prefix
	for row := range r.table.LowerBound(txn, tables.PrefixLabelsIndex.Query(tables.PrefixOwner{Prefix: p})) {
		q := row.Prefix
		if q.Addr().Is4() != p.Addr().Is4() || !p.Contains(q.Addr()) {
			break
		}
		if q != last && q.Bits() > p.Bits() {
			dirty[q] = struct{}{}
		}
		last = q
	}
	return true
}

// process resolves the prefixes, in chunks, and returns the revisions of
// the ipcache and policy-prefixes tables after the last one. A chunk closes once it holds chunkSize
// relabels (prefixes that change identity), or maxChunkPrefixes prefixes of
// any kind: new and deleted prefixes never hold two identities, but a
// transaction over all of a bulk change would keep every other writer of
// ipcache and identities waiting for as long as it takes.
func (r *resolver) process(dirty []netip.Prefix) (resolvedProgress, error) {
	for len(dirty) > 0 {
		n, err := r.processChunk(dirty)
		if err != nil {
			return resolvedProgress{}, err
		}
		dirty = dirty[n:]
	}
	txn := r.db.ReadTxn()
	return resolvedProgress{IPCacheRev: r.ipcache.table.Revision(txn), PolicyRev: r.policy.table.Revision(txn)}, nil
}

// maxChunkPrefixes bounds the prefixes one transaction resolves, whatever
// they are. Resolving a 20,000-CIDR policy in one transaction held ipcache
// and identities for 0.4-1.2 s on a loaded 2-core VM; 4,096 new or deleted
// prefixes take 25-130 ms there, a few hundred ms at worst.
const maxChunkPrefixes = 4096

// relabel is the new state of one prefix of one table within a chunk.
type relabel struct {
	table  statedb.RWTable[*tables.IPCacheEntry]
	entry  *tables.IPCacheEntry
	labels tables.Labels
	hint   uint32
}

// chunk is what processChunk gathers: the entries that need an identity,
// grouped by label set so that each identity is written once per chunk
// however many prefixes (of either table) share it, and how many times
// each old identity is released.
type chunk struct {
	groups  map[string][]*relabel
	order   []string
	release map[uint32]uint32
}

// processChunk resolves prefixes from the start of dirty until a chunk is
// full, and returns how many it took.
func (r *resolver) processChunk(dirty []netip.Prefix) (int, error) {
	wtxn := r.db.WriteTxn(r.ipcache.table, r.policy.table, r.alloc.Table())
	defer wtxn.Abort()
	c := &chunk{groups: map[string][]*relabel{}, release: map[uint32]uint32{}}
	relabels, taken := 0, 0
	for _, p := range dirty {
		if relabels >= r.chunkSize || taken >= maxChunkPrefixes {
			break
		}
		taken++
		// Failed again below if it still gets no identity.
		delete(r.failed, p)
		res := r.resolve(wtxn, p)
		n, err := r.stage(wtxn, c, r.ipcache, p, res.labels, res.owners)
		if err != nil {
			return 0, err
		}
		m, err := r.stage(wtxn, c, r.policy, p, res.policyLabels, res.policyOwners)
		if err != nil {
			return 0, err
		}
		relabels += n + m
	}
	for _, key := range c.order {
		group := c.groups[key]
		hint := uint32(0)
		for _, rl := range group {
			if rl.hint != 0 {
				hint = rl.hint
				break
			}
		}
		id, err := r.alloc.AcquireN(wtxn, group[0].labels, hint, uint32(len(group)))
		for _, rl := range group {
			e := rl.entry
			if err != nil {
				e.Error = err.Error()
				r.failed[e.Prefix] = e.Error
			} else {
				e.Identity = id.ID
			}
			if _, _, err := rl.table.Insert(wtxn, e); err != nil {
				return 0, err
			}
		}
	}
	// Old identities go last, after the new ones are taken, so that an
	// identity moving from one prefix to another within the chunk is never
	// deleted and recreated with a new number.
	for _, id := range slices.Sorted(maps.Keys(c.release)) {
		if err := r.alloc.ReleaseN(wtxn, id, c.release[id]); err != nil {
			return 0, err
		}
		r.released = r.released || len(r.failed) > 0
	}
	wtxn.Commit()
	return taken, nil
}

// stage puts the new state of prefix p in the table of v into c: deleted
// without owners, unchanged (but for its owners) with the labels and an
// identity it has, else to be given the identity of labels. It returns 1
// for a relabel (p had an identity, now another).
func (r *resolver) stage(wtxn statedb.WriteTxn, c *chunk, v view, p netip.Prefix, labels tables.Labels, owners []string) (int, error) {
	old, _, hadOld := v.table.Get(wtxn, tables.IPCachePrefixIndex.Query(p))
	if len(owners) == 0 {
		if hadOld {
			if _, _, err := v.table.Delete(wtxn, old); err != nil {
				return 0, err
			}
			if old.Identity != 0 {
				c.release[old.Identity]++
			}
		}
		return 0, nil
	}
	if hadOld && old.Identity != 0 && old.Labels.Equal(labels) {
		if !slices.Equal(old.Owners, owners) {
			e := old.Clone()
			e.Owners = owners
			if _, _, err := v.table.Insert(wtxn, e); err != nil {
				return 0, err
			}
		}
		return 0, nil
	}
	n := 0
	if hadOld && old.Identity != 0 {
		n = 1
		c.release[old.Identity]++
	}
	key := labels.Key()
	if _, ok := c.groups[key]; !ok {
		c.order = append(c.order, key)
	}
	c.groups[key] = append(c.groups[key], &relabel{
		table:  v.table,
		entry:  &tables.IPCacheEntry{Prefix: p, Labels: labels, Owners: owners, Status: reconciler.StatusPending()},
		labels: labels,
		hint:   v.hints[p],
	})
	return n, nil
}

// resolved is what resolve says of a prefix: the labels and owners of its
// ipcache entry (no owners: p is gone), and those of its policy-prefixes
// entry (no owners: no owner gives p a cidr: label).
type resolved struct {
	labels, policyLabels tables.Labels
	owners, policyOwners []string
}

// resolve returns the labels and owners of p in either table.
func (r *resolver) resolve(txn statedb.ReadTxn, p netip.Prefix) resolved {
	var (
		res               resolved
		all, policyLabels []string
	)
	for row := range r.table.Prefix(txn, tables.PrefixOwners(p)) {
		res.owners = append(res.owners, row.Owner)
		all = append(all, row.Labels...)
		if hasCIDRLabel(row.Labels) {
			res.policyOwners = append(res.policyOwners, row.Owner)
			policyLabels = append(policyLabels, row.Labels...)
		}
	}
	if len(res.owners) == 0 {
		return res
	}
	fam := familyIndex(p)
	for bits := p.Bits() - 1; bits >= 0; bits-- {
		if r.lengths[fam][bits] == 0 {
			continue
		}
		parent := netip.PrefixFrom(p.Addr(), bits).Masked()
		if _, ok := r.present[parent]; !ok {
			// Present as of the changes read; one added since is dirty
			// in the next round, which re-resolves what it contains.
			continue
		}
		for row := range r.table.Prefix(txn, tables.PrefixOwners(parent)) {
			all = append(all, row.Labels...)
			if hasCIDRLabel(row.Labels) {
				policyLabels = append(policyLabels, row.Labels...)
			}
		}
	}
	res.labels = normalize(p, all, r.dualStack)
	switch {
	case len(res.policyOwners) == 0:
	case outsideCluster(res.labels):
		// The ipcache's identity is a CIDR one already (with fqdn:
		// labels, say): the same, not one more.
		res.policyLabels = res.labels
	default:
		res.policyLabels = normalize(p, policyLabels, r.dualStack)
	}
	return res
}

// outsideCluster reports whether normalized labels are those of an address
// outside the cluster: normalize gives them, and only them, a world label.
func outsideCluster(labels tables.Labels) bool {
	return labels.Has(tables.LabelWorld) || labels.Has(tables.LabelWorldIPv4) || labels.Has(tables.LabelWorldIPv6)
}

// hasCIDRLabel reports whether labels hold a cidr: label: an owner that
// gives one (a policy) names the prefix as a CIDR.
func hasCIDRLabel(labels tables.Labels) bool {
	return slices.ContainsFunc(labels, func(l string) bool {
		_, ok := tables.ParseCIDRLabel(l)
		return ok
	})
}

// inClusterLabels mark addresses of the cluster itself, which never carry
// world, cidr: or fqdn: labels: a pod or the host inside a policy's CIDR
// keeps its own identity.
var inClusterLabels = []string{
	tables.LabelHost, tables.LabelHealth, tables.LabelIngress, tables.LabelRemoteNode,
	tables.LabelKubeAPIServer, tables.LabelInit, tables.LabelUnmanaged,
}

// normalize makes the label set of prefix p from all the labels its owners
// and ancestors give: only the longest cidr: label stays (a selector of a
// shorter CIDR matches it anyway); in-cluster addresses lose cidr:, fqdn:
// and world labels; others get the world label of their family. A pod's
// address (a k8s: label) keeps the longest podnet: label, which a
// ClusterNetworkPolicy networks peer selects it by; every other address
// loses them (outside the cluster, its cidr: label is what the peer
// selects; the node and other nodes keep their reserved identities).
func normalize(p netip.Prefix, all []string, dualStack bool) tables.Labels {
	inCluster, pod := false, false
	var (
		longest, longestNet         netip.Prefix
		longestText, longestNetText string
	)
	out := make([]string, 0, len(all)+1)
	for _, l := range all {
		if slices.Contains(inClusterLabels, l) || strings.HasPrefix(l, tables.SourceK8s+":") {
			inCluster = true
		}
		pod = pod || strings.HasPrefix(l, tables.SourceK8s+":")
		if c, ok := tables.ParseCIDRLabel(l); ok {
			if !longest.IsValid() || c.Bits() > longest.Bits() {
				longest, longestText = c, l
			}
			continue
		}
		if c, ok := tables.ParsePodNetLabel(l); ok {
			if !longestNet.IsValid() || c.Bits() > longestNet.Bits() {
				longestNet, longestNetText = c, l
			}
			continue
		}
		switch l {
		case tables.LabelWorld, tables.LabelWorldIPv4, tables.LabelWorldIPv6:
			continue
		}
		out = append(out, l)
	}
	if inCluster {
		out = slices.DeleteFunc(out, func(l string) bool { return strings.HasPrefix(l, tables.SourceFQDN+":") })
		// reserved:remote-node comes from Node objects, which speak
		// for no pod and not for this node: where a pod (k8s: labels)
		// or this node's host has the address, a Node claiming it
		// does not relabel it (identity.ReservedFor would let
		// remote-node decide a pod's identity).
		if slices.ContainsFunc(out, func(l string) bool { return l == tables.LabelHost || strings.HasPrefix(l, tables.SourceK8s+":") }) {
			out = slices.DeleteFunc(out, func(l string) bool { return l == tables.LabelRemoteNode })
		}
		if pod && longestNetText != "" && !slices.ContainsFunc(out, func(l string) bool { return slices.Contains(inClusterLabels, l) }) {
			out = append(out, longestNetText)
		}
		return tables.NewLabels(out...)
	}
	if longestText != "" {
		out = append(out, longestText)
	}
	switch {
	case !dualStack:
		out = append(out, tables.LabelWorld)
	case p.Addr().Is4():
		out = append(out, tables.LabelWorldIPv4)
	default:
		out = append(out, tables.LabelWorldIPv6)
	}
	return tables.NewLabels(out...)
}

func comparePrefixes(a, b netip.Prefix) int {
	if c := a.Addr().Compare(b.Addr()); c != 0 {
		return c
	}
	return a.Bits() - b.Bits()
}
