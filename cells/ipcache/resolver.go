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
// set.
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
	ipcache  statedb.RWTable[*tables.IPCacheEntry]
	alloc    *identity.Allocator
	// dualStack: world-ipv4/world-ipv6 instead of world.
	dualStack bool
	chunkSize int

	// lengths counts the distinct prefixes of each (family, length), so
	// that looking for the ancestors of a prefix skips the lengths nobody
	// uses.
	lengths [2][129]int
	present map[netip.Prefix]struct{}
	// hints are the identities the old ipcache map had, until the grace
	// period starts.
	hints map[netip.Prefix]uint32
	// failed are prefixes whose identity could not be allocated; they are
	// retried whenever identities are released and periodically.
	failed map[netip.Prefix]string
	// released is set when identities were released since failed prefixes
	// were last retried.
	released bool

	markInitialized func(statedb.WriteTxn)
	initialized     bool
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
		ipcacheRev, err := r.process(slices.SortedFunc(maps.Keys(dirty), comparePrefixes))
		if err != nil {
			return err
		}
		r.reportHealth(health)
		r.prefixes.resolved(resolvedProgress{PrefixesRev: r.table.Revision(rtxn), IPCacheRev: ipcacheRev})

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
	wtxn := r.db.WriteTxn(r.ipcache, r.alloc.Table())
	defer wtxn.Abort()
	moved, err := r.alloc.Renumber(wtxn)
	if err != nil {
		return fmt.Errorf("renumber identities: %w", err)
	}
	if len(moved) > 0 {
		for e := range r.ipcache.All(wtxn) {
			if n, ok := moved[e.Identity]; ok {
				c := e.Clone()
				c.Identity = n
				c.Status = reconciler.StatusPending()
				if _, _, err := r.ipcache.Insert(wtxn, c); err != nil {
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
	wtxn := r.db.WriteTxn(r.ipcache)
	r.markInitialized(wtxn)
	wtxn.Commit()
	r.initialized = true
	r.hints = nil
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

// process resolves the prefixes, in chunks, and returns the revision of the
// ipcache table after the last one. A chunk closes once it holds chunkSize
// relabels (prefixes that change identity), or maxChunkPrefixes prefixes of
// any kind: new and deleted prefixes never hold two identities, but a
// transaction over all of a bulk change would keep every other writer of
// ipcache and identities waiting for as long as it takes.
func (r *resolver) process(dirty []netip.Prefix) (Revision, error) {
	for len(dirty) > 0 {
		n, err := r.processChunk(dirty)
		if err != nil {
			return 0, err
		}
		dirty = dirty[n:]
	}
	return r.ipcache.Revision(r.db.ReadTxn()), nil
}

// maxChunkPrefixes bounds the prefixes one transaction resolves, whatever
// they are. Resolving a 20,000-CIDR policy in one transaction held ipcache
// and identities for 0.4-1.2 s on a loaded 2-core VM; 4,096 new or deleted
// prefixes take 25-130 ms there, a few hundred ms at worst.
const maxChunkPrefixes = 4096

// relabel is the new state of one prefix within a chunk.
type relabel struct {
	entry  *tables.IPCacheEntry
	labels tables.Labels
	hint   uint32
}

// processChunk resolves prefixes from the start of dirty until a chunk is
// full, and returns how many it took.
func (r *resolver) processChunk(dirty []netip.Prefix) (int, error) {
	wtxn := r.db.WriteTxn(r.ipcache, r.alloc.Table())
	defer wtxn.Abort()
	release := map[uint32]uint32{}
	// Entries that need an identity, grouped by label set so that each
	// identity is written once per chunk however many prefixes share it.
	groups := map[string][]*relabel{}
	var order []string
	relabels, taken := 0, 0
	for _, p := range dirty {
		if relabels >= r.chunkSize || taken >= maxChunkPrefixes {
			break
		}
		taken++
		old, _, hadOld := r.ipcache.Get(wtxn, tables.IPCachePrefixIndex.Query(p))
		labels, owners := r.resolve(wtxn, p)
		if len(owners) == 0 {
			delete(r.failed, p)
			if hadOld {
				if _, _, err := r.ipcache.Delete(wtxn, old); err != nil {
					return 0, err
				}
				if old.Identity != 0 {
					release[old.Identity]++
				}
			}
			continue
		}
		if hadOld && old.Identity != 0 && old.Labels.Equal(labels) {
			if !slices.Equal(old.Owners, owners) {
				e := old.Clone()
				e.Owners = owners
				if _, _, err := r.ipcache.Insert(wtxn, e); err != nil {
					return 0, err
				}
			}
			continue
		}
		if hadOld && old.Identity != 0 {
			relabels++
			release[old.Identity]++
		}
		key := labels.Key()
		if _, ok := groups[key]; !ok {
			order = append(order, key)
		}
		groups[key] = append(groups[key], &relabel{
			entry:  &tables.IPCacheEntry{Prefix: p, Labels: labels, Owners: owners, Status: reconciler.StatusPending()},
			labels: labels,
			hint:   r.hints[p],
		})
	}
	for _, key := range order {
		group := groups[key]
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
				delete(r.failed, e.Prefix)
			}
			if _, _, err := r.ipcache.Insert(wtxn, e); err != nil {
				return 0, err
			}
		}
	}
	// Old identities go last, after the new ones are taken, so that an
	// identity moving from one prefix to another within the chunk is never
	// deleted and recreated with a new number.
	for _, id := range slices.Sorted(maps.Keys(release)) {
		if err := r.alloc.ReleaseN(wtxn, id, release[id]); err != nil {
			return 0, err
		}
		r.released = r.released || len(r.failed) > 0
	}
	wtxn.Commit()
	return taken, nil
}

// resolve returns the labels of p and its owners (none: p is gone).
func (r *resolver) resolve(txn statedb.ReadTxn, p netip.Prefix) (tables.Labels, []string) {
	var (
		owners []string
		all    []string
	)
	for row := range r.table.Prefix(txn, tables.PrefixOwners(p)) {
		owners = append(owners, row.Owner)
		all = append(all, row.Labels...)
	}
	if len(owners) == 0 {
		return nil, nil
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
		}
	}
	return normalize(p, all, r.dualStack), owners
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
// and world labels; others get the world label of their family.
func normalize(p netip.Prefix, all []string, dualStack bool) tables.Labels {
	inCluster := false
	var (
		longest     netip.Prefix
		longestText string
	)
	out := make([]string, 0, len(all)+1)
	for _, l := range all {
		if slices.Contains(inClusterLabels, l) || strings.HasPrefix(l, tables.SourceK8s+":") {
			inCluster = true
		}
		if c, ok := tables.ParseCIDRLabel(l); ok {
			if !longest.IsValid() || c.Bits() > longest.Bits() {
				longest, longestText = c, l
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
