package socketlb

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/lb"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// AffinityGCInterval is the shortest time between two sweeps of the
// affinity maps, and how long a sweep waits after a change of the
// frontends, so that the load balancer has written it to the maps.
const AffinityGCInterval = time.Second

// walkBatch is the batch size for reading the maps.
const walkBatch = 4096

// affinityGC removes the entries of lb4_affinity and lb6_affinity that
// lead nowhere any more: their backend has no lb_affinity_match entry for
// their service, because the service is gone, its affinity was turned off
// or the backend left it. The programs never follow such an entry, and
// overwrite it on the client's next connection; the LRU would evict it
// eventually. Sweeping keeps the maps to the services that have affinity,
// so that a service that goes leaves nothing behind.
//
// It writes no entry, and deletes only entries the datapath created: only
// the socket programs insert into the affinity maps, while the agent's
// own decisions (lb_affinity_match) are the LB reconciler's, which the
// sweep only reads. That is the rule for writers of BPF maps outside
// reconcilers (docs/architecture.md).
type affinityGC struct {
	log       *slog.Logger
	db        *statedb.DB
	frontends statedb.Table[*tables.Frontend]
	lbMaps    lb.Maps
	a         *attacher
	interval  time.Duration
}

func newAffinityGC(log *slog.Logger, db *statedb.DB, frontends statedb.Table[*tables.Frontend], maps lb.Maps, a *attacher) *affinityGC {
	return &affinityGC{log: log, db: db, frontends: frontends, lbMaps: maps, a: a, interval: AffinityGCInterval}
}

// run sweeps once the programs are attached, and then whenever the
// frontends table has changed, at most once per interval and only when the
// load balancer has reconciled every frontend: lb_affinity_match says
// which backends are valid only once the change is in it. A deleted
// frontend leaves no trace to wait for in the table; the interval that
// follows every change gives the load balancer the time to delete it.
func (g *affinityGC) run(ctx context.Context, health cell.Health) error {
	health.OK("Waiting for the programs to be attached")
	select {
	case <-g.a.attached:
	case <-ctx.Done():
		return nil
	}
	health.OK("Waiting for the frontends")
	for {
		txn := g.db.ReadTxn()
		initialized, initWatch := g.frontends.Initialized(txn)
		all, watch := g.frontends.AllWatch(txn)
		if initialized && reconciled(all) {
			removed, total, err := g.sweep()
			switch {
			case err != nil:
				g.log.Error("Sweeping the affinity maps", "error", err)
				health.Degraded("Sweeping the affinity maps failed", err)
			case removed > 0:
				g.log.Info("Removed stale affinity entries", "removed", removed, "entries", total)
				health.OK(fmt.Sprintf("Removed %d stale affinity entries of %d", removed, total))
			default:
				g.log.Debug("No stale affinity entries", "entries", total)
				health.OK(fmt.Sprintf("Removed 0 stale affinity entries of %d", total))
			}
		}
		if initialized {
			initWatch = nil // closed already
		}
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		case <-initWatch:
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(g.interval):
		}
	}
}

// reconciled says whether no frontend waits for the load balancer.
func reconciled(all iter.Seq2[*tables.Frontend, statedb.Revision]) bool {
	for f := range all {
		if f.Status.Kind == reconciler.StatusKindPending {
			return false
		}
	}
	return true
}

// sweep removes the stale entries of both affinity maps and says how many
// it removed, of how many. The affinity maps are read before
// lb_affinity_match, so that an entry is removed only if its backend was
// no longer valid after the entry was written. (One that the programs
// replace between the read and the delete is lost: that client chooses
// anew once.)
func (g *affinityGC) sweep() (removed, total int, err error) {
	g.a.mu.Lock()
	defer g.a.mu.Unlock()
	aff4, aff6 := g.a.own[bpf.LB4AffinityMap], g.a.own[bpf.LB6AffinityMap]
	if aff4 == nil || aff6 == nil {
		return 0, 0, nil // detached since
	}
	s4, err := readAffinity(aff4, bpf.LB4AffinityMap, func(k bpf.LB4AffinityKey) bpf.Be16 { return k.RevNat })
	if err != nil {
		return 0, 0, err
	}
	s6, err := readAffinity(aff6, bpf.LB6AffinityMap, func(k bpf.LB6AffinityKey) bpf.Be16 { return k.RevNat })
	if err != nil {
		return 0, 0, err
	}

	valid := map[bpf.LBAffinityMatchKey]struct{}{}
	err = g.lbMaps.Maps(func(m reconcilers.LBMaps) error {
		return bpf.Walk(m.AffinityMatch, walkBatch, func(keys []bpf.LBAffinityMatchKey, _ []uint8) error {
			for _, k := range keys {
				valid[k] = struct{}{}
			}
			return nil
		})
	})
	if err != nil {
		return 0, 0, fmt.Errorf("read %s: %w", bpf.LBAffinityMatchMap, err)
	}

	n4, err4 := s4.removeInvalid(valid)
	n6, err6 := s6.removeInvalid(valid)
	return n4 + n6, len(s4.keys) + len(s6.keys), errors.Join(err4, err6)
}

// affinityEntries are the keys of an affinity map, each with the backend
// and service it stands for.
type affinityEntries[K any] struct {
	m     *ebpf.Map
	name  string
	keys  []K
	pairs []bpf.LBAffinityMatchKey
}

func readAffinity[K any](m *ebpf.Map, name string, revNat func(K) bpf.Be16) (*affinityEntries[K], error) {
	e := &affinityEntries[K]{m: m, name: name}
	err := bpf.Walk(m, walkBatch, func(keys []K, values []bpf.LBAffinityValue) error {
		for i, k := range keys {
			e.keys = append(e.keys, k)
			e.pairs = append(e.pairs, bpf.LBAffinityMatchKey{BackendID: values[i].BackendID, RevNat: revNat(k)})
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	return e, nil
}

// removeInvalid deletes the entries whose backend and service are not in
// valid, and says how many it deleted.
func (e *affinityEntries[K]) removeInvalid(valid map[bpf.LBAffinityMatchKey]struct{}) (int, error) {
	var n int
	for i, k := range e.keys {
		if _, ok := valid[e.pairs[i]]; ok {
			continue
		}
		// Gone already (evicted) is fine.
		if err := e.m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return n, fmt.Errorf("delete from %s: %w", e.name, err)
		}
		n++
	}
	return n, nil
}
