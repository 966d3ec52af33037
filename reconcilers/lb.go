package reconcilers

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"slices"
	"sync"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// MaxServiceID and MaxBackendID bound the IDs the load balancer hands out;
// 0 is never used, as the datapath reads it as "none".
const (
	MaxServiceID = 0xFFFF - 1
	MaxBackendID = 0xFFFFFFFF - 1
)

// ErrLBIDsExhausted means every service or backend ID is in use.
var ErrLBIDsExhausted = errors.New("load-balancing IDs exhausted")

// LBConfig says where the load-balancing maps live and how big they are.
type LBConfig struct {
	// PinDir is the directory on bpffs the maps are pinned in.
	PinDir string
	// Maps opens them (nil: bpf.KernelMaps).
	Maps bpf.Opener
	// MaxEntries is the size of each map.
	MaxEntries uint32
	// MaxEntriesFlag names the flag that sets MaxEntries, for the error
	// that says a map is full.
	MaxEntriesFlag string
	// Preallocate creates the maps with all their entries allocated up
	// front: memory for MaxEntries entries from the start, in exchange for
	// updates that allocate nothing (about 2.5 times cheaper).
	Preallocate bool
}

// LB converges the frontends table into the load-balancing maps: IPv4
// frontends into lb4_services, lb4_backends and lb4_reverse_nat, IPv6 ones
// into their lb6_* twins, and the backends of frontends with session
// affinity into lb_affinity_match. Service and backend IDs are one space
// for both families, as in the reference, so that an ID names one
// frontend or backend whatever the map. It implements
// reconciler.Operations and reconciler.BatchOperations for
// *tables.Frontend.
//
// It keeps a mirror of what it wrote, restored from the pinned maps when it
// first runs, so that every change writes only the entries that differ: a
// restart with unchanged frontends writes nothing, and the IDs of frontends
// and backends stay the same. See lb_slots.go for the slot layout.
type LB struct {
	log      *slog.Logger
	cfg      LBConfig
	backends statedb.Table[*tables.Backend]

	// Ops counts the map operations by map and kind.
	Ops LBOpCounts

	mu   sync.Mutex
	maps *lbMaps
	// The mirror is keyed by family: IPv4 addresses packed into a uint64
	// (the common case, and the one benchmarked at 50,000 services),
	// IPv6 ones by their L4Addr.
	frontends4   map[addrKey]*feState
	frontends6   map[tables.L4Addr]*feState
	backends4    map[addrKey]*beState
	backends6    map[tables.L4Addr]*beState
	frontendByID map[uint16]*feState
	backendByID  map[uint32]*beState
	// orphans are backends no frontend uses whose deletion failed; the
	// next operation tries again.
	orphans       []*beState
	nextServiceID uint16
	nextBackendID uint32
	// drift, if set, makes Prune a resync: the maps are read and what
	// differs from the mirror is repaired.
	drift *Drift
	// prunedOnce is set once a prune has deleted the strays of the maps
	// as they were opened.
	prunedOnce bool
	// runs are idle runs with their buffers (see newRun).
	runs sync.Pool
}

// feState is what the maps hold for one frontend.
type feState struct {
	addr tables.L4Addr
	// id is the service ID; 0 for a wildcard frontend, which nothing
	// translates back to.
	id uint16
	// master is set when slot 0 exists; count, qcount, flags and affinity
	// (the timeout in its BackendID field) are its contents.
	master        bool
	count, qcount uint16
	flags         bpf.ServiceFlags
	affinity      uint32
	// slots[i] is the backend ID in slot i+1, 0 if the slot is missing.
	// Slots beyond count+qcount are left over from a crash and go at the
	// next update.
	slots []uint32
	// slotsFor are the ID and flags the slots were written with; a change
	// rewrites them all.
	slotsID    uint16
	slotsFlags bpf.ServiceFlags
	// held are the backend IDs this frontend counts a reference on, sorted.
	held []uint32
	// matched are the backend IDs that have an lb_affinity_match entry
	// with this frontend's ID, sorted.
	matched []uint32
	// revNat is set when the reverse NAT entry for id holds addr.
	revNat bool
	// unsure is set while an update of the frontend has failed partway:
	// its slots may hold the values of the new write or of the old one
	// (slotsID and slotsFlags are those of the last complete update), so
	// the resync leaves its service entries to the update's retry.
	unsure bool
	// wildcard is set when this frontend counts a reference on its
	// address's wildcard entry; refs counts them on a wildcard.
	wildcard bool
	refs     int32
}

// beState is what the maps hold for one backend.
type beState struct {
	id      uint32
	addr    tables.L4Addr
	refs    int32
	written bool
	state   bpf.BackendState
	// pending is the write of this backend's entry that the run being
	// planned holds, so that it goes out once however many frontends
	// need it; execute clears it.
	pending *lbOp
}

// NewLB returns the load-balancing reconciler operations. backends is read
// for each backend's state across all the services that use it.
func NewLB(log *slog.Logger, cfg LBConfig, backends statedb.Table[*tables.Backend]) *LB {
	return &LB{
		log:           log,
		cfg:           cfg,
		backends:      backends,
		frontends4:    map[addrKey]*feState{},
		frontends6:    map[tables.L4Addr]*feState{},
		backends4:     map[addrKey]*beState{},
		backends6:     map[tables.L4Addr]*beState{},
		frontendByID:  map[uint16]*feState{},
		backendByID:   map[uint32]*beState{},
		nextServiceID: 1,
		nextBackendID: 1,
	}
}

// Close closes the maps; they stay pinned.
func (l *LB) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.maps == nil {
		return nil
	}
	err := l.maps.close()
	l.maps = nil
	return err
}

// LBMaps are the open load-balancing maps (kernel maps in the agent; see
// bpf.KernelMap for what needs one).
type LBMaps struct {
	Services4, Backends4, RevNat4 bpf.Map
	Services6, Backends6, RevNat6 bpf.Map
	AffinityMatch                 bpf.Map
}

// All returns the maps in the order of bpf.LBMapNames.
func (m LBMaps) All() []bpf.Map {
	return []bpf.Map{m.Services4, m.Backends4, m.RevNat4, m.Services6, m.Backends6, m.RevNat6, m.AffinityMatch}
}

// Maps calls fn with the open maps, opening and restoring them first if
// this has not happened yet. fn must not keep them.
func (l *LB) Maps(fn func(LBMaps) error) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.ensureOpen(); err != nil {
		return err
	}
	return fn(l.maps.public())
}

// Update implements reconciler.Operations.
func (l *LB) Update(ctx context.Context, txn statedb.ReadTxn, _ statedb.Revision, f *tables.Frontend) error {
	batch := []reconciler.BatchEntry[*tables.Frontend]{{Object: f}}
	l.UpdateBatch(ctx, txn, batch)
	return batch[0].Result
}

// Delete implements reconciler.Operations.
func (l *LB) Delete(ctx context.Context, txn statedb.ReadTxn, _ statedb.Revision, f *tables.Frontend) error {
	batch := []reconciler.BatchEntry[*tables.Frontend]{{Object: f}}
	l.DeleteBatch(ctx, txn, batch)
	return batch[0].Result
}

// UpdateBatch implements reconciler.BatchOperations: the map writes of all
// the frontends go out in one batch operation per map and step, so that a
// burst of changes costs a few system calls instead of several per
// frontend.
func (l *LB) UpdateBatch(_ context.Context, txn statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.Frontend]) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.ensureOpen(); err != nil {
		for i := range batch {
			batch[i].Result = err
		}
		return
	}
	run := l.newRun()
	defer run.release()
	plans := make([]*lbPlan, len(batch))
	for i := range batch {
		plans[i] = l.planUpdate(run, txn, batch[i].Object)
	}
	l.planWildcardReleases(run)
	l.execute(run)
	for _, p := range plans {
		switch {
		case p.err == nil:
			l.finishUpdate(run, p)
		case p.fe != nil:
			p.fe.unsure = true
		}
	}
	l.executeReleases(run)
	for i, p := range plans {
		batch[i].Result = p.err
		batch[i].Object.ID = p.fe.id
	}
}

// DeleteBatch implements reconciler.BatchOperations.
func (l *LB) DeleteBatch(_ context.Context, _ statedb.ReadTxn, batch []reconciler.BatchEntry[*tables.Frontend]) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.ensureOpen(); err != nil {
		for i := range batch {
			batch[i].Result = err
		}
		return
	}
	run := l.newRun()
	defer run.release()
	plans := make([]*lbPlan, 0, len(batch))
	for i := range batch {
		if fe := l.frontend(batch[i].Object.Address); fe != nil {
			plans = append(plans, l.planDelete(run, fe))
		}
	}
	l.planWildcardReleases(run)
	l.execute(run)
	for _, p := range plans {
		if p.err == nil {
			l.finishDelete(run, p)
		}
	}
	l.executeReleases(run)
	j := 0
	for i := range batch {
		if j < len(plans) && plans[j].fe.addr == batch[i].Object.Address {
			batch[i].Result = plans[j].err
			j++
		}
	}
}

// Prune implements reconciler.Operations. It runs once every source of
// frontends has synced: it repairs drift of the maps (ResyncWith), then
// removes what the maps hold for frontends that no longer exist, backends
// no frontend uses, and entries that the mirror cannot explain (written by
// someone else, or left by a crash).
func (l *LB) Prune(_ context.Context, _ statedb.ReadTxn, desired iter.Seq2[*tables.Frontend, statedb.Revision]) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.ensureOpen(); err != nil {
		return err
	}
	// What a crash or an older agent left is deleted as stray, not
	// counted as drift: the first prune after opening the maps prunes
	// before it resyncs. Later the resync finds the strays itself.
	var strayErr error
	if l.drift != nil && !l.prunedOnce {
		strayErr = l.pruneStray()
	}
	resyncErr := l.resyncLocked()
	want := map[tables.L4Addr]struct{}{}
	used := map[tables.L4Addr]struct{}{}
	for f := range desired {
		want[f.Address] = struct{}{}
		if wantsWildcard(f) {
			want[wildcardOf(f.Address)] = struct{}{}
		}
		for _, b := range f.Backends {
			used[b.Address] = struct{}{}
		}
	}

	run := l.newRun()
	defer run.release()
	var plans []*lbPlan
	for fe := range l.allFrontends() {
		if _, ok := want[fe.addr]; ok {
			continue
		}
		if isWildcard(fe.addr) {
			// Its frontends are gone (or were never updated since a
			// restart restored it): their deletion releases it, or
			// this does.
			if fe.refs == 0 {
				run.wildcardReleases = append(run.wildcardReleases, fe)
			}
			continue
		}
		plans = append(plans, l.planDelete(run, fe))
	}
	// A wildcard a desired frontend wants stays, even if that frontend
	// has not been updated since a restart and holds no reference yet.
	run.wildcardReleases = slices.DeleteFunc(run.wildcardReleases, func(wc *feState) bool {
		_, ok := want[wc.addr]
		return ok
	})
	l.planWildcardReleases(run)
	l.execute(run)
	var errs []error
	for _, p := range plans {
		if p.err != nil {
			errs = append(errs, p.err)
			continue
		}
		l.finishDelete(run, p)
	}
	for _, be := range l.backendByID {
		if _, ok := used[be.addr]; !ok && be.refs == 0 && !slices.Contains(l.orphans, be) {
			l.orphans = append(l.orphans, be)
		}
	}
	l.executeReleases(run)
	if len(l.orphans) > 0 {
		errs = append(errs, fmt.Errorf("%d unused backends could not be deleted", len(l.orphans)))
	}
	if l.drift == nil || resyncErr != nil {
		strayErr = l.pruneStray()
	}
	l.prunedOnce = strayErr == nil
	return errors.Join(append(errs, strayErr, resyncErr)...)
}

// allocServiceID returns the next free service ID after the last one handed
// out, so that a released ID is not reused at once: connections still
// tracked under it would be translated to the wrong frontend.
func (l *LB) allocServiceID() (uint16, error) {
	id, ok := nextFreeID(&l.nextServiceID, MaxServiceID, len(l.frontendByID), func(id uint16) bool {
		_, used := l.frontendByID[id]
		return used
	})
	if !ok {
		return 0, fmt.Errorf("%w: all %d service IDs are in use", ErrLBIDsExhausted, MaxServiceID)
	}
	return id, nil
}

// allocBackendID is allocServiceID for backends.
func (l *LB) allocBackendID() (uint32, error) {
	id, ok := nextFreeID(&l.nextBackendID, MaxBackendID, len(l.backendByID), func(id uint32) bool {
		_, used := l.backendByID[id]
		return used
	})
	if !ok {
		return 0, fmt.Errorf("%w: all %d backend IDs are in use", ErrLBIDsExhausted, uint32(MaxBackendID))
	}
	return id, nil
}

// nextFreeID returns the first ID from *next on, wrapping from maxID to 1,
// that is not used, and moves *next past it. With inUse IDs taken, at most
// inUse+1 candidates need a look.
func nextFreeID[T uint16 | uint32](next *T, maxID T, inUse int, used func(T) bool) (T, bool) {
	if uint64(inUse) >= uint64(maxID) {
		return 0, false
	}
	for range inUse + 1 {
		id := *next
		*next++
		if *next == 0 || *next > maxID {
			*next = 1
		}
		if !used(id) {
			return id, true
		}
	}
	return 0, false
}

// backendFor returns the state of the backend at addr, giving it an ID if
// it has none.
func (l *LB) backendFor(addr tables.L4Addr) (*beState, error) {
	if be := l.backend(addr); be != nil {
		return be, nil
	}
	id, err := l.allocBackendID()
	if err != nil {
		return nil, err
	}
	be := &beState{id: id, addr: addr}
	l.setBackend(be)
	l.backendByID[id] = be
	return be, nil
}

// forgetBackend drops a backend whose entry is gone from the map.
func (l *LB) forgetBackend(be *beState) {
	if be.addr.Addr.Is4() {
		delete(l.backends4, keyOf(be.addr))
	} else {
		delete(l.backends6, be.addr)
	}
	delete(l.backendByID, be.id)
}

// frontend returns the mirror of the frontend at a, or nil.
func (l *LB) frontend(a tables.L4Addr) *feState {
	if a.Addr.Is4() {
		return l.frontends4[keyOf(a)]
	}
	return l.frontends6[a]
}

func (l *LB) setFrontend(fe *feState) {
	if fe.addr.Addr.Is4() {
		l.frontends4[keyOf(fe.addr)] = fe
	} else {
		l.frontends6[fe.addr] = fe
	}
}

func (l *LB) forgetFrontend(fe *feState) {
	if fe.addr.Addr.Is4() {
		delete(l.frontends4, keyOf(fe.addr))
	} else {
		delete(l.frontends6, fe.addr)
	}
	if fe.id != 0 && l.frontendByID[fe.id] == fe {
		delete(l.frontendByID, fe.id)
	}
}

// allFrontends yields the mirror's frontends of both families.
func (l *LB) allFrontends() iter.Seq[*feState] {
	return func(yield func(*feState) bool) {
		for _, fe := range l.frontends4 {
			if !yield(fe) {
				return
			}
		}
		for _, fe := range l.frontends6 {
			if !yield(fe) {
				return
			}
		}
	}
}

// backend returns the mirror of the backend at a, or nil.
func (l *LB) backend(a tables.L4Addr) *beState {
	if a.Addr.Is4() {
		return l.backends4[keyOf(a)]
	}
	return l.backends6[a]
}

func (l *LB) setBackend(be *beState) {
	if be.addr.Addr.Is4() {
		l.backends4[keyOf(be.addr)] = be
	} else {
		l.backends6[be.addr] = be
	}
}

// isWildcard says whether a is a wildcard entry's address (port 0,
// protocol ANY): it only refuses, so it has no ID, slots or reverse NAT.
func isWildcard(a tables.L4Addr) bool { return a.Port == 0 }

// wildcardOf returns the address of the wildcard entry of a's IP.
func wildcardOf(a tables.L4Addr) tables.L4Addr {
	return tables.L4Addr{Addr: a.Addr, Proto: tables.AnyProto}
}

// wantsWildcard says whether f's address gets a wildcard entry, which
// makes the socket LB refuse the ports of the address that no service
// exposes. Only cluster IPs do: they are virtual, allocated from the
// service range, so no host serves their other ports. External IPs, node
// addresses and load-balancer IPs may be real addresses of hosts (k3s's
// ServiceLB hands out node IPs), whose other ports must stay reachable.
func wantsWildcard(f *tables.Frontend) bool { return f.Type == tables.FrontendClusterIP }

// frontendFlags are the service flags of a frontend: its type and whether
// it has session affinity.
func frontendFlags(f *tables.Frontend) bpf.ServiceFlags {
	var flags bpf.ServiceFlags
	switch f.Type {
	case tables.FrontendExternalIP:
		flags = bpf.SvcFlagExternalIPs | bpf.SvcFlagRoutable
	case tables.FrontendLoadBalancer:
		flags = bpf.SvcFlagLoadBalancer | bpf.SvcFlagRoutable
	case tables.FrontendNodePort:
		flags = bpf.SvcFlagNodePort | bpf.SvcFlagRoutable
	}
	if affinityTimeout(f) != 0 {
		flags |= bpf.SvcFlagSessionAffinity
	}
	return flags
}

// affinityTimeout is the affinity timeout a frontend's service entry
// carries, within the 24 bits the datapath has for it.
func affinityTimeout(f *tables.Frontend) uint32 {
	return min(f.SessionAffinity, bpf.AffinityTimeoutMask)
}

// backendMapState is how the datapath encodes a backend state.
func backendMapState(s tables.BackendState) bpf.BackendState {
	switch s {
	case tables.BackendActive:
		return bpf.BackendActive
	case tables.BackendTerminating:
		return bpf.BackendTerminating
	}
	return bpf.BackendMaintenance
}

// addrKey is an IPv4 address, port and protocol packed into the key of the
// mirror's IPv4 maps: a quarter of the size of a tables.L4Addr key, and
// cheaper to hash.
type addrKey uint64

func keyOf(a tables.L4Addr) addrKey {
	ip := a.Addr.As4()
	return addrKey(ip[0])<<48 | addrKey(ip[1])<<40 | addrKey(ip[2])<<32 | addrKey(ip[3])<<24 |
		addrKey(a.Port)<<8 | addrKey(a.Proto)
}

// insertSorted adds id to the sorted set s.
func insertSorted(s []uint32, id uint32) ([]uint32, bool) {
	i, found := slices.BinarySearch(s, id)
	if found {
		return s, false
	}
	return slices.Insert(s, i, id), true
}

// removeSorted removes id from the sorted set s.
func removeSorted(s []uint32, id uint32) []uint32 {
	if i, found := slices.BinarySearch(s, id); found {
		return slices.Delete(s, i, i+1)
	}
	return s
}
