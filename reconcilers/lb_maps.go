package reconcilers

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// lbWalkBatch is the batch size for reading the load-balancing maps back.
const lbWalkBatch = 4096

// LBOpCounts counts the operations on the load-balancing maps, one per
// entry, batched or not.
type LBOpCounts struct {
	n [numLBMaps][2]atomic.Uint64
}

// Get returns how many updates (or, with del, deletes) of the map called
// name have been attempted.
func (c *LBOpCounts) Get(name string, del bool) uint64 {
	for m, n := range lbMapNames {
		if n == name {
			return c.n[m][b2i(del)].Load()
		}
	}
	return 0
}

func (c *LBOpCounts) add(m lbMapKind, del bool, n int) {
	c.n[m][b2i(del)].Add(uint64(n))
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// lbMaps are the open load-balancing maps, by kind.
type lbMaps [numLBMaps]bpf.Map

func (m *lbMaps) close() error {
	var errs []error
	for _, mm := range m {
		errs = append(errs, mm.Close())
	}
	return errors.Join(errs...)
}

func (m *lbMaps) public() LBMaps {
	return LBMaps{
		Services4: m[lb4Services], Backends4: m[lb4Backends], RevNat4: m[lb4RevNat],
		Services6: m[lb6Services], Backends6: m[lb6Backends], RevNat6: m[lb6RevNat],
		AffinityMatch: m[lbAffinityMatch],
	}
}

// lbMapLayouts are, by kind, the functions that copy a pinned map of an
// older spec (size, flags) and check that a pin has the kind's layout.
var lbMapLayouts = [numLBMaps]struct {
	migrate bpf.MigrateFunc
	check   func(*ebpf.MapSpec) error
}{
	lb4Services:     {bpf.CopyEntries[bpf.LB4ServiceKey, bpf.LB4ServiceValue], bpf.CheckLayout[bpf.LB4ServiceKey, bpf.LB4ServiceValue]},
	lb4Backends:     {bpf.CopyEntries[uint32, bpf.LB4BackendValue], bpf.CheckLayout[uint32, bpf.LB4BackendValue]},
	lb4RevNat:       {bpf.CopyEntries[bpf.Be16, bpf.LB4RevNatValue], bpf.CheckLayout[bpf.Be16, bpf.LB4RevNatValue]},
	lb6Services:     {bpf.CopyEntries[bpf.LB6ServiceKey, bpf.LB6ServiceValue], bpf.CheckLayout[bpf.LB6ServiceKey, bpf.LB6ServiceValue]},
	lb6Backends:     {bpf.CopyEntries[uint32, bpf.LB6BackendValue], bpf.CheckLayout[uint32, bpf.LB6BackendValue]},
	lb6RevNat:       {bpf.CopyEntries[bpf.Be16, bpf.LB6RevNatValue], bpf.CheckLayout[bpf.Be16, bpf.LB6RevNatValue]},
	lbAffinityMatch: {bpf.CopyEntries[bpf.LBAffinityMatchKey, uint8], bpf.CheckLayout[bpf.LBAffinityMatchKey, uint8]},
}

// ensureOpen opens the pinned maps and restores the mirror from them, once.
func (l *LB) ensureOpen() error {
	if l.maps != nil {
		return nil
	}
	var maps lbMaps
	var errs []error
	for kind, name := range lbMapNames {
		m, err := l.openMap(name, lbMapLayouts[kind].migrate, lbMapLayouts[kind].check)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		maps[kind] = m
	}
	if err := joinOneLine(errs...); err != nil {
		for _, m := range maps {
			if m != nil {
				m.Close()
			}
		}
		return fmt.Errorf("open load-balancing maps: %w", err)
	}
	if err := l.restore(&maps); err != nil {
		maps.close()
		return fmt.Errorf("restore load-balancing state: %w", err)
	}
	l.maps, l.prunedOnce = &maps, false
	return nil
}

// openMap opens (creating or migrating) the pinned map called name.
func (l *LB) openMap(name string, migrate bpf.MigrateFunc, check func(*ebpf.MapSpec) error) (bpf.Map, error) {
	spec, err := bpf.LBMapSpec(name, l.cfg.MaxEntries)
	if err != nil {
		return nil, err
	}
	if l.cfg.Preallocate {
		spec.Flags &^= unix.BPF_F_NO_PREALLOC
	}
	if err := check(spec); err != nil {
		return nil, err
	}
	opener := l.cfg.Maps
	if opener == nil {
		opener = bpf.KernelMaps
	}
	pm, err := opener.OpenMap(l.log, spec, l.cfg.PinDir, migrate)
	if err != nil {
		return nil, err
	}
	if pm.Outcome == bpf.PinReplaced {
		l.log.Info("Re-created load-balancing map, entries copied", "map", name, "change", pm.Mismatch)
	}
	return pm.Map, nil
}

// joinOneLine joins errs like errors.Join, but separated by "; " rather than
// newlines, so that the agent's one-line error stays one line.
func joinOneLine(errs ...error) error {
	err := errors.Join(errs...)
	if err == nil {
		return nil
	}
	return oneLine{err.(interface{ Unwrap() []error })}
}

type oneLine struct{ joined interface{ Unwrap() []error } }

func (e oneLine) Unwrap() []error { return e.joined.Unwrap() }

func (e oneLine) Error() string {
	msgs := make([]string, 0, len(e.Unwrap()))
	for _, err := range e.Unwrap() {
		msgs = append(msgs, err.Error())
	}
	return strings.Join(msgs, "; ")
}

// restore fills the mirror from the maps, so that frontends and backends
// keep their IDs and unchanged entries are not written again.
func (l *LB) restore(maps *lbMaps) error {
	err := errors.Join(
		restoreServices(l, maps[lb4Services], bpf.LB4ServicesMap, func(k bpf.LB4ServiceKey) (tables.L4Addr, uint16) {
			return keyAddr(k), k.Slot
		}),
		restoreServices(l, maps[lb6Services], bpf.LB6ServicesMap, func(k bpf.LB6ServiceKey) (tables.L4Addr, uint16) {
			return key6Addr(k), k.Slot
		}),
		restoreBackends(l, maps[lb4Backends], bpf.LB4BackendsMap, func(v bpf.LB4BackendValue) (tables.L4Addr, bpf.BackendState) {
			return tables.L4Addr{Addr: netip.AddrFrom4(v.Address), Port: v.Port.Uint16(), Proto: tables.Proto(v.Proto)}, v.State
		}),
		restoreBackends(l, maps[lb6Backends], bpf.LB6BackendsMap, func(v bpf.LB6BackendValue) (tables.L4Addr, bpf.BackendState) {
			return tables.L4Addr{Addr: netip.AddrFrom16(v.Address), Port: v.Port.Uint16(), Proto: tables.Proto(v.Proto)}, v.State
		}),
	)
	if err != nil {
		return err
	}

	for fe := range l.allFrontends() {
		if !fe.master {
			fe.id = fe.slotsID
		}
		if isWildcard(fe.addr) {
			// Wildcards have no ID; a master written with one is
			// rewritten.
			if fe.id != 0 {
				fe.id, fe.master = 0, false
			}
			continue
		}
		if fe.id == 0 || fe.id > MaxServiceID || l.frontendByID[fe.id] != nil {
			// Its entries are rewritten under a new ID.
			fe.id, fe.master = 0, false
			continue
		}
		l.frontendByID[fe.id] = fe
		l.nextServiceID = max(l.nextServiceID, fe.id+1)
		for _, id := range fe.slots {
			if be := l.backendByID[id]; be != nil && be.addr.Addr.Is4() == fe.addr.Addr.Is4() {
				if held, added := insertSorted(fe.held, id); added {
					fe.held = held
					be.refs++
				}
			}
		}
	}
	if l.nextServiceID > MaxServiceID {
		l.nextServiceID = 1
	}
	if l.nextBackendID == 0 || l.nextBackendID > MaxBackendID {
		l.nextBackendID = 1
	}

	err = errors.Join(
		restoreRevNat(l, maps[lb4RevNat], bpf.LB4RevNatMap, bpf.LB4RevNatValue.L4Addr),
		restoreRevNat(l, maps[lb6RevNat], bpf.LB6RevNatMap, bpf.LB6RevNatValue.L4Addr),
		bpf.Walk(maps[lbAffinityMatch], lbWalkBatch, func(keys []bpf.LBAffinityMatchKey, _ []uint8) error {
			for _, k := range keys {
				if fe := l.frontendByID[k.RevNat.Uint16()]; fe != nil && l.sameFamilyBackend(fe, k.BackendID) {
					fe.matched, _ = insertSorted(fe.matched, k.BackendID)
				}
			}
			return nil
		}),
	)
	if err != nil {
		return fmt.Errorf("read load-balancing maps: %w", err)
	}
	l.log.Info("Restored load-balancing state from the pinned maps",
		"frontends", len(l.frontends4)+len(l.frontends6), "backends", len(l.backendByID))
	return nil
}

// sameFamilyBackend says whether id is a known backend of fe's family.
func (l *LB) sameFamilyBackend(fe *feState, id uint32) bool {
	be := l.backendByID[id]
	return be != nil && be.addr.Addr.Is4() == fe.addr.Addr.Is4()
}

// restoreServices fills the mirror's frontends from a services map whose
// keys addrOf decodes.
func restoreServices[K any](l *LB, m bpf.Map, name string, addrOf func(K) (tables.L4Addr, uint16)) error {
	err := bpf.Walk(m, lbWalkBatch, func(keys []K, values []bpf.LB4ServiceValue) error {
		for i, k := range keys {
			v := values[i]
			addr, slot := addrOf(k)
			fe := l.frontend(addr)
			if fe == nil {
				fe = &feState{addr: addr}
				l.setFrontend(fe)
			}
			if slot == 0 {
				fe.master, fe.count, fe.qcount, fe.flags = true, v.Count, v.QCount, v.Flags
				fe.affinity = v.BackendID & bpf.AffinityTimeoutMask
				fe.id = v.RevNat.Uint16()
				continue
			}
			for len(fe.slots) < int(slot) {
				fe.slots = append(fe.slots, 0)
			}
			fe.slots[slot-1] = v.BackendID
			fe.slotsID, fe.slotsFlags = v.RevNat.Uint16(), v.Flags
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", name, err)
	}
	return nil
}

// restoreBackends fills the mirror's backends from a backends map whose
// values decode decodes. An ID the other family's map already holds is
// left out, so its entry goes as stray.
func restoreBackends[V any](l *LB, m bpf.Map, name string, decode func(V) (tables.L4Addr, bpf.BackendState)) error {
	err := bpf.Walk(m, lbWalkBatch, func(ids []uint32, values []V) error {
		for i, id := range ids {
			addr, state := decode(values[i])
			if id == 0 || id > MaxBackendID || l.backend(addr) != nil || l.backendByID[id] != nil {
				continue // pruned as stray
			}
			be := &beState{id: id, addr: addr, written: true, state: state}
			l.setBackend(be)
			l.backendByID[id] = be
			l.nextBackendID = max(l.nextBackendID, id+1)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", name, err)
	}
	return nil
}

// restoreRevNat marks the frontends whose reverse NAT entry is in place.
func restoreRevNat[V any](l *LB, m bpf.Map, name string, addrOf func(V) netip.AddrPort) error {
	err := bpf.Walk(m, lbWalkBatch, func(keys []bpf.Be16, values []V) error {
		for i, k := range keys {
			fe := l.frontendByID[k.Uint16()]
			if fe != nil && addrOf(values[i]) == netip.AddrPortFrom(fe.addr.Addr, fe.addr.Port) {
				fe.revNat = true
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", name, err)
	}
	return nil
}

// pruneStray deletes the entries the mirror does not explain.
func (l *LB) pruneStray() error {
	strayServices := func(addr tables.L4Addr, slot uint16) bool {
		fe := l.frontend(addr)
		return fe == nil ||
			slot == 0 && !fe.master ||
			slot > 0 && (int(slot) > len(fe.slots) || fe.slots[slot-1] == 0)
	}
	strayBackend := func(is4 bool) func(uint32) bool {
		return func(id uint32) bool {
			be := l.backendByID[id]
			return be == nil || !be.written || be.addr.Addr.Is4() != is4
		}
	}
	strayRevNat := func(is4 bool) func(bpf.Be16) bool {
		return func(k bpf.Be16) bool {
			fe := l.frontendByID[k.Uint16()]
			return fe == nil || !fe.revNat || fe.addr.Addr.Is4() != is4
		}
	}
	var errs []error
	prune := func(kind lbMapKind, n int, err error) {
		if err != nil {
			errs = append(errs, fmt.Errorf("delete stray entries of %s: %w", lbMapNames[kind], err))
		}
		if n > 0 {
			l.log.Info("Deleted stray load-balancing entries", "map", lbMapNames[kind], "count", n)
		}
		l.Ops.add(kind, true, n)
	}
	n, err := pruneMap[bpf.LB4ServiceKey, bpf.LB4ServiceValue](l.maps[lb4Services], func(k bpf.LB4ServiceKey) bool { return strayServices(keyAddr(k), k.Slot) })
	prune(lb4Services, n, err)
	n, err = pruneMap[bpf.LB6ServiceKey, bpf.LB6ServiceValue](l.maps[lb6Services], func(k bpf.LB6ServiceKey) bool { return strayServices(key6Addr(k), k.Slot) })
	prune(lb6Services, n, err)
	n, err = pruneMap[uint32, bpf.LB4BackendValue](l.maps[lb4Backends], strayBackend(true))
	prune(lb4Backends, n, err)
	n, err = pruneMap[uint32, bpf.LB6BackendValue](l.maps[lb6Backends], strayBackend(false))
	prune(lb6Backends, n, err)
	n, err = pruneMap[bpf.Be16, bpf.LB4RevNatValue](l.maps[lb4RevNat], strayRevNat(true))
	prune(lb4RevNat, n, err)
	n, err = pruneMap[bpf.Be16, bpf.LB6RevNatValue](l.maps[lb6RevNat], strayRevNat(false))
	prune(lb6RevNat, n, err)
	n, err = pruneMap[bpf.LBAffinityMatchKey, uint8](l.maps[lbAffinityMatch], func(k bpf.LBAffinityMatchKey) bool {
		fe := l.frontendByID[k.RevNat.Uint16()]
		if fe == nil {
			return true
		}
		_, ok := slices.BinarySearch(fe.matched, k.BackendID)
		return !ok
	})
	prune(lbAffinityMatch, n, err)
	return errors.Join(errs...)
}

// pruneMap deletes the keys of m that stray says the mirror does not
// explain, and returns how many it deleted.
func pruneMap[K, V any](m bpf.Map, stray func(K) bool) (int, error) {
	var keys []K
	err := bpf.Walk(m, lbWalkBatch, func(batch []K, _ []V) error {
		for _, k := range batch {
			if stray(k) {
				keys = append(keys, k)
			}
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("read: %w", err)
	}
	if len(keys) == 0 {
		return 0, nil
	}
	n, err := m.BatchDelete(keys, nil)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		err = nil
	}
	return n, err
}

// run performs ops, which are all on one map and of one kind, and returns
// how many succeeded before the first failure.
func (m *lbMaps) run(ops []*lbOp) (int, error) {
	op := ops[0]
	mm := m[op.m]
	switch op.m {
	case lb4Services:
		return runOps(mm, ops, func(o *lbOp) bpf.LB4ServiceKey { return serviceKey4(o.addr, o.slot) }, serviceValue)
	case lb6Services:
		return runOps(mm, ops, func(o *lbOp) bpf.LB6ServiceKey { return serviceKey6(o.addr, o.slot) }, serviceValue)
	case lb4Backends:
		return runOps(mm, ops, backendID, func(o *lbOp) bpf.LB4BackendValue { return backend4Value(o.addr, o.state) })
	case lb6Backends:
		return runOps(mm, ops, backendID, func(o *lbOp) bpf.LB6BackendValue { return backend6Value(o.addr, o.state) })
	case lb4RevNat:
		return runOps(mm, ops, revNatKey, func(o *lbOp) bpf.LB4RevNatValue { return revNat4Value(o.addr) })
	case lb6RevNat:
		return runOps(mm, ops, revNatKey, func(o *lbOp) bpf.LB6RevNatValue { return revNat6Value(o.addr) })
	default:
		return runOps(mm, ops, func(o *lbOp) bpf.LBAffinityMatchKey {
			return bpf.LBAffinityMatchKey{BackendID: o.id, RevNat: bpf.NewBe16(o.revNat)}
		}, func(*lbOp) uint8 { return 0 })
	}
}

// runOps performs ops on m: one plain operation when there is one, else a
// batch. key and value make the map's own types from an operation.
func runOps[K, V any](m bpf.Map, ops []*lbOp, key func(*lbOp) K, value func(*lbOp) V) (int, error) {
	if len(ops) == 1 {
		k := key(ops[0])
		var err error
		if ops[0].del {
			err = m.Delete(&k)
		} else {
			v := value(ops[0])
			err = m.Put(&k, &v)
		}
		if err != nil {
			return 0, err
		}
		return 1, nil
	}
	keys := make([]K, len(ops))
	for i, o := range ops {
		keys[i] = key(o)
	}
	if ops[0].del {
		return m.BatchDelete(keys, nil)
	}
	values := make([]V, len(ops))
	for i, o := range ops {
		values[i] = value(o)
	}
	return m.BatchUpdate(keys, values, nil)
}

func serviceKey4(addr tables.L4Addr, slot uint16) bpf.LB4ServiceKey {
	return bpf.NewLB4ServiceKey(ap(addr), uint8(addr.Proto), slot)
}

func serviceKey6(addr tables.L4Addr, slot uint16) bpf.LB6ServiceKey {
	return bpf.NewLB6ServiceKey(ap(addr), uint8(addr.Proto), slot)
}

func serviceValue(o *lbOp) bpf.LB4ServiceValue { return o.svc }

func backendID(o *lbOp) uint32 { return o.id }

func revNatKey(o *lbOp) bpf.Be16 { return bpf.NewBe16(uint16(o.id)) }

func keyAddr(k bpf.LB4ServiceKey) tables.L4Addr {
	return tables.L4Addr{Addr: netip.AddrFrom4(k.Address), Port: k.Port.Uint16(), Proto: tables.Proto(k.Proto)}
}

func key6Addr(k bpf.LB6ServiceKey) tables.L4Addr {
	return tables.L4Addr{Addr: netip.AddrFrom16(k.Address), Port: k.Port.Uint16(), Proto: tables.Proto(k.Proto)}
}
