package policy

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/tables"
)

// progress is how far the controller has read the selectors table: every
// selectors row up to rev is in the policy tables.
type progress struct {
	mu      sync.Mutex
	rev     statedb.Revision
	changed chan struct{}
}

func newProgress() *progress { return &progress{changed: make(chan struct{})} }

func (p *progress) set(rev statedb.Revision) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if rev <= p.rev {
		return
	}
	p.rev = rev
	close(p.changed)
	p.changed = make(chan struct{})
}

func (p *progress) get() (statedb.Revision, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rev, p.changed
}

// gate implements fqdn.Gate: it holds a DNS answer until connecting to its
// addresses is decided by the policy map as the policies say.
type gate struct {
	db         *statedb.DB
	ipcache    statedb.Table[*tables.IPCacheEntry]
	identities statedb.Table[*tables.Identity]
	selectors  statedb.Table[*tables.Selector]
	entries    statedb.Table[*tables.PolicyEntry]
	endpoints  statedb.Table[*tables.EndpointPolicy]
	progress   *progress
	mode       string
}

// Wait returns once, for every address of ips, the FQDN selectors of its
// identity select it, the controller has computed the entries that
// follow, and those entries of the identity are in the policy map; or
// with ctx's error.
func (g *gate) Wait(ctx context.Context, ips []netip.Addr) error {
	if g.mode == ModeNever {
		return nil
	}
	for {
		rtxn := g.db.ReadTxn()
		watch, why := g.pending(rtxn, ips)
		if watch == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("policy not in place: %s: %w", why, ctx.Err())
		case <-watch:
		}
	}
}

// pending returns a channel to wait on and why, or nil when nothing is
// pending.
func (g *gate) pending(rtxn statedb.ReadTxn, ips []netip.Addr) (<-chan struct{}, string) {
	ids := map[uint32]struct{}{}
	for _, ip := range ips {
		entry, _, found := g.ipcache.Get(rtxn, tables.IPCachePrefixIndex.Query(tables.HostPrefix(ip)))
		if !found || entry.Identity == 0 {
			continue // the ipcache's own wait covers this
		}
		ids[entry.Identity] = struct{}{}
	}
	for id := range ids {
		ident, _, found := g.identities.Get(rtxn, tables.IdentityIDIndex.Query(id))
		if !found {
			continue
		}
		for _, label := range ident.Labels {
			if !strings.HasPrefix(label, tables.SourceFQDN+":") {
				continue
			}
			sel, _, watch, found := g.selectors.GetWatch(rtxn, tables.SelectorIndex.Query(label))
			if !found {
				if _, _, ok := tables.SplitEndpointFQDNLabel(label); ok {
					// One endpoint's: the selectors cell makes it
					// from the identity.
					return watch, fmt.Sprintf("selector %s not made yet", label)
				}
				continue // no policy uses it (any more)
			}
			if !slices.Contains(sel.Identities, id) {
				return watch, fmt.Sprintf("selector %s does not select identity %d yet", label, id)
			}
		}
	}
	if rev, changed := g.progress.get(); rev < g.selectors.Revision(rtxn) {
		return changed, "entries not computed yet"
	}
	// An endpoint's row is pending from the change of any of its entries
	// until the reconciler has written them all. Only node-local
	// identities carry FQDN labels, so only their entries follow from
	// FQDN selectors (and only theirs are indexed by identity).
	for id := range ids {
		if id < tables.MinLocalIdentity || id > tables.MaxLocalIdentity {
			continue
		}
		for e := range g.entries.List(rtxn, tables.PolicyEntryIdentityIndex.Query(id)) {
			row, _, watch, found := g.endpoints.GetWatch(rtxn, tables.EndpointPolicyNameIndex.Query(e.Endpoint))
			if found && row.Status.Kind != reconciler.StatusKindDone {
				return watch, fmt.Sprintf("entry %s not in the map yet", e.Key())
			}
		}
	}
	return nil, ""
}
