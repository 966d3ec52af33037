package reconcilers

import (
	"errors"
	"fmt"
	"net/netip"
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

// lbMaps are the open load-balancing maps.
type lbMaps struct {
	services, backends, revNat *ebpf.Map
}

func (m *lbMaps) close() error {
	return errors.Join(m.services.Close(), m.backends.Close(), m.revNat.Close())
}

// ensureOpen opens the pinned maps and restores the mirror from them, once.
func (l *LB) ensureOpen() error {
	if l.maps != nil {
		return nil
	}
	var opened []*ebpf.Map
	open := func(name string, migrate bpf.MigrateFunc, check func(*ebpf.MapSpec) error) (*ebpf.Map, error) {
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
		pm, err := bpf.OpenPinnedMap(l.log, spec, l.cfg.PinDir, migrate)
		if err != nil {
			return nil, err
		}
		if pm.Outcome == bpf.PinReplaced {
			l.log.Info("Re-created load-balancing map, entries copied", "map", name, "change", pm.Mismatch)
		}
		opened = append(opened, pm.Map)
		return pm.Map, nil
	}
	services, err1 := open(bpf.LB4ServicesMap,
		bpf.CopyEntries[bpf.LB4ServiceKey, bpf.LB4ServiceValue],
		bpf.CheckLayout[bpf.LB4ServiceKey, bpf.LB4ServiceValue])
	backends, err2 := open(bpf.LB4BackendsMap,
		bpf.CopyEntries[uint32, bpf.LB4BackendValue],
		bpf.CheckLayout[uint32, bpf.LB4BackendValue])
	revNat, err3 := open(bpf.LB4RevNatMap,
		bpf.CopyEntries[bpf.Be16, bpf.LB4RevNatValue],
		bpf.CheckLayout[bpf.Be16, bpf.LB4RevNatValue])
	if err := joinOneLine(err1, err2, err3); err != nil {
		for _, m := range opened {
			m.Close()
		}
		return fmt.Errorf("open load-balancing maps: %w", err)
	}
	maps := &lbMaps{services: services, backends: backends, revNat: revNat}
	if err := l.restore(maps); err != nil {
		maps.close()
		return fmt.Errorf("restore load-balancing state: %w", err)
	}
	l.maps = maps
	return nil
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
	err := bpf.Walk(maps.services, lbWalkBatch, func(keys []bpf.LB4ServiceKey, values []bpf.LB4ServiceValue) error {
		for i, k := range keys {
			v := values[i]
			addr := keyAddr(k)
			fe := l.frontends[keyOf(addr)]
			if fe == nil {
				fe = &feState{addr: addr}
				l.frontends[keyOf(addr)] = fe
			}
			if k.Slot == 0 {
				fe.master, fe.count, fe.qcount, fe.flags = true, v.Count, v.QCount, v.Flags
				fe.id = v.RevNat.Uint16()
				continue
			}
			for len(fe.slots) < int(k.Slot) {
				fe.slots = append(fe.slots, 0)
			}
			fe.slots[k.Slot-1] = v.BackendID
			fe.slotsID, fe.slotsFlags = v.RevNat.Uint16(), v.Flags
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB4ServicesMap, err)
	}
	err = bpf.Walk(maps.backends, lbWalkBatch, func(ids []uint32, values []bpf.LB4BackendValue) error {
		for i, id := range ids {
			v := values[i]
			addr := tables.L4Addr{Addr: netip.AddrFrom4(v.Address), Port: v.Port.Uint16(), Proto: tables.Proto(v.Proto)}
			if id == 0 || id > MaxBackendID || l.backendByAddr[keyOf(addr)] != nil {
				continue // pruned as stray
			}
			be := &beState{id: id, addr: addr, written: true, value: v}
			l.backendByAddr[keyOf(addr)] = be
			l.backendByID[id] = be
			l.nextBackendID = max(l.nextBackendID, id+1)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB4BackendsMap, err)
	}

	for _, fe := range l.frontends {
		if !fe.master {
			fe.id = fe.slotsID
		}
		if fe.id == 0 || fe.id > MaxServiceID || l.frontendByID[fe.id] != nil {
			// Its entries are rewritten under a new ID.
			fe.id, fe.master = 0, false
			continue
		}
		l.frontendByID[fe.id] = fe
		l.nextServiceID = max(l.nextServiceID, fe.id+1)
		for _, id := range fe.slots {
			if be := l.backendByID[id]; be != nil {
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

	err = bpf.Walk(maps.revNat, lbWalkBatch, func(keys []bpf.Be16, values []bpf.LB4RevNatValue) error {
		for i, k := range keys {
			fe := l.frontendByID[k.Uint16()]
			if fe != nil && values[i].L4Addr() == netip.AddrPortFrom(fe.addr.Addr, fe.addr.Port) {
				fe.revNat = true
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read %s: %w", bpf.LB4RevNatMap, err)
	}
	l.log.Info("Restored load-balancing state from the pinned maps",
		"frontends", len(l.frontends), "backends", len(l.backendByID))
	return nil
}

// pruneStray deletes the entries the mirror does not explain.
func (l *LB) pruneStray() error {
	var svcKeys []bpf.LB4ServiceKey
	err := bpf.Walk(l.maps.services, lbWalkBatch, func(keys []bpf.LB4ServiceKey, _ []bpf.LB4ServiceValue) error {
		for _, k := range keys {
			fe := l.frontends[keyOf(keyAddr(k))]
			switch {
			case fe == nil,
				k.Slot == 0 && !fe.master,
				k.Slot > 0 && (int(k.Slot) > len(fe.slots) || fe.slots[k.Slot-1] == 0):
				svcKeys = append(svcKeys, k)
			}
		}
		return nil
	})
	var beKeys []uint32
	err2 := bpf.Walk(l.maps.backends, lbWalkBatch, func(ids []uint32, _ []bpf.LB4BackendValue) error {
		for _, id := range ids {
			if be := l.backendByID[id]; be == nil || !be.written {
				beKeys = append(beKeys, id)
			}
		}
		return nil
	})
	var revKeys []bpf.Be16
	err3 := bpf.Walk(l.maps.revNat, lbWalkBatch, func(keys []bpf.Be16, _ []bpf.LB4RevNatValue) error {
		for _, k := range keys {
			if fe := l.frontendByID[k.Uint16()]; fe == nil || !fe.revNat {
				revKeys = append(revKeys, k)
			}
		}
		return nil
	})
	if err := errors.Join(err, err2, err3); err != nil {
		return fmt.Errorf("read load-balancing maps: %w", err)
	}
	var errs []error
	del := func(m *ebpf.Map, kind lbMapKind, keys any, n int) {
		if n == 0 {
			return
		}
		l.log.Info("Deleting stray load-balancing entries", "map", lbMapNames[kind], "count", n)
		done, err := m.BatchDelete(keys, nil)
		l.Ops.add(kind, true, done)
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("delete stray entries of %s: %w", lbMapNames[kind], err))
		}
	}
	del(l.maps.services, lbServices, svcKeys, len(svcKeys))
	del(l.maps.backends, lbBackends, beKeys, len(beKeys))
	del(l.maps.revNat, lbRevNat, revKeys, len(revKeys))
	return errors.Join(errs...)
}

// run performs ops, which are all on one map and of one kind, and returns
// how many succeeded before the first failure.
func (m *lbMaps) run(ops []*lbOp) (int, error) {
	op := ops[0]
	if len(ops) == 1 {
		var err error
		switch {
		case op.m == lbServices && op.del:
			err = m.services.Delete(&op.svcKey)
		case op.m == lbServices:
			err = m.services.Put(&op.svcKey, &op.svcVal)
		case op.m == lbBackends && op.del:
			err = m.backends.Delete(&op.beID)
		case op.m == lbBackends:
			err = m.backends.Put(&op.beID, &op.beVal)
		case op.m == lbRevNat && op.del:
			err = m.revNat.Delete(&op.revKey)
		default:
			err = m.revNat.Put(&op.revKey, &op.revVal)
		}
		if err != nil {
			return 0, err
		}
		return 1, nil
	}
	switch op.m {
	case lbServices:
		keys := make([]bpf.LB4ServiceKey, len(ops))
		for i, o := range ops {
			keys[i] = o.svcKey
		}
		if op.del {
			return m.services.BatchDelete(keys, nil)
		}
		values := make([]bpf.LB4ServiceValue, len(ops))
		for i, o := range ops {
			values[i] = o.svcVal
		}
		return m.services.BatchUpdate(keys, values, nil)
	case lbBackends:
		keys := make([]uint32, len(ops))
		for i, o := range ops {
			keys[i] = o.beID
		}
		if op.del {
			return m.backends.BatchDelete(keys, nil)
		}
		values := make([]bpf.LB4BackendValue, len(ops))
		for i, o := range ops {
			values[i] = o.beVal
		}
		return m.backends.BatchUpdate(keys, values, nil)
	default:
		keys := make([]bpf.Be16, len(ops))
		for i, o := range ops {
			keys[i] = o.revKey
		}
		if op.del {
			return m.revNat.BatchDelete(keys, nil)
		}
		values := make([]bpf.LB4RevNatValue, len(ops))
		for i, o := range ops {
			values[i] = o.revVal
		}
		return m.revNat.BatchUpdate(keys, values, nil)
	}
}

func keyAddr(k bpf.LB4ServiceKey) tables.L4Addr {
	return tables.L4Addr{Addr: netip.AddrFrom4(k.Address), Port: k.Port.Uint16(), Proto: tables.Proto(k.Proto)}
}
