package reconcilers

import (
	"errors"
	"net/netip"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// ResyncWith makes every Prune first compare the load-balancing maps with
// what the mirror says they hold and repair them, reporting to d (nil: no
// resync).
func (l *LB) ResyncWith(d *Drift) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.drift = d
}

// lbWant is what the mirror says each load-balancing map holds.
type lbWant struct {
	services4 map[bpf.LB4ServiceKey]bpf.LB4ServiceValue
	services6 map[bpf.LB6ServiceKey]bpf.LB6ServiceValue
	backends4 map[uint32]bpf.LB4BackendValue
	backends6 map[uint32]bpf.LB6BackendValue
	revNat4   map[bpf.Be16]bpf.LB4RevNatValue
	revNat6   map[bpf.Be16]bpf.LB6RevNatValue
	affinity  map[bpf.LBAffinityMatchKey]uint8
}

// want derives the maps' contents from the mirror. Slots the mirror knows
// to be missing (backend ID 0) are left out, and so are the service
// entries of frontends whose update failed partway (feState.unsure).
func (l *LB) want() lbWant {
	w := lbWant{
		services4: map[bpf.LB4ServiceKey]bpf.LB4ServiceValue{},
		services6: map[bpf.LB6ServiceKey]bpf.LB6ServiceValue{},
		backends4: map[uint32]bpf.LB4BackendValue{},
		backends6: map[uint32]bpf.LB6BackendValue{},
		revNat4:   map[bpf.Be16]bpf.LB4RevNatValue{},
		revNat6:   map[bpf.Be16]bpf.LB6RevNatValue{},
		affinity:  map[bpf.LBAffinityMatchKey]uint8{},
	}
	service := func(addr tables.L4Addr, slot uint16, v bpf.LB4ServiceValue) {
		if addr.Addr.Is4() {
			w.services4[serviceKey4(addr, slot)] = v
		} else {
			w.services6[serviceKey6(addr, slot)] = v
		}
	}
	for fe := range l.allFrontends() {
		// The service entries of a frontend whose update failed partway
		// are left to the update's retry.
		if fe.master && !fe.unsure {
			service(fe.addr, 0, masterValue(fe.id, fe.count, fe.qcount, fe.flags, fe.affinity))
		}
		for i, id := range fe.slots {
			if id != 0 && !fe.unsure {
				service(fe.addr, uint16(i+1), slotValue(id, fe.slotsID, fe.slotsFlags))
			}
		}
		if fe.revNat {
			if fe.addr.Addr.Is4() {
				w.revNat4[bpf.NewBe16(fe.id)] = revNat4Value(fe.addr)
			} else {
				w.revNat6[bpf.NewBe16(fe.id)] = revNat6Value(fe.addr)
			}
		}
		for _, id := range fe.matched {
			w.affinity[bpf.LBAffinityMatchKey{BackendID: id, RevNat: bpf.NewBe16(fe.id)}] = 0
		}
	}
	for id, be := range l.backendByID {
		switch {
		case !be.written:
		case be.addr.Addr.Is4():
			w.backends4[id] = backend4Value(be.addr, be.state)
		default:
			w.backends6[id] = backend6Value(be.addr, be.state)
		}
	}
	return w
}

// resyncLocked repairs drift of every load-balancing map (see resyncMap)
// against the mirror. The repairs count as map operations too.
func (l *LB) resyncLocked() error {
	if l.drift == nil || l.maps == nil {
		return nil
	}
	w := l.want()
	unsure4 := func(k bpf.LB4ServiceKey) bool { fe := l.frontend(keyAddr(k)); return fe != nil && fe.unsure }
	unsure6 := func(k bpf.LB6ServiceKey) bool { fe := l.frontend(key6Addr(k)); return fe != nil && fe.unsure }
	return errors.Join(
		resyncLBMap(l, lb4Services, w.services4, unsure4),
		resyncLBMap(l, lb6Services, w.services6, unsure6),
		resyncLBMap[uint32](l, lb4Backends, w.backends4, nil),
		resyncLBMap[uint32](l, lb6Backends, w.backends6, nil),
		resyncLBMap[bpf.Be16](l, lb4RevNat, w.revNat4, nil),
		resyncLBMap[bpf.Be16](l, lb6RevNat, w.revNat6, nil),
		resyncLBMap[bpf.LBAffinityMatchKey](l, lbAffinityMatch, w.affinity, nil),
	)
}

func resyncLBMap[K, V comparable](l *LB, kind lbMapKind, want map[K]V, leave func(K) bool) error {
	c, err := resyncMapLeaving(l.maps[kind], want, leave)
	l.Ops.add(kind, false, c.Missing+c.Changed)
	l.Ops.add(kind, true, c.Stray)
	return errors.Join(err, l.drift.Report(lbMapNames[kind], c))
}

// The values the maps hold, for writes and resyncs (built by package bpf).

func ap(addr tables.L4Addr) netip.AddrPort { return netip.AddrPortFrom(addr.Addr, addr.Port) }

func masterValue(id, count, qcount uint16, flags bpf.ServiceFlags, affinity uint32) bpf.LB4ServiceValue {
	return bpf.NewLBMasterValue(id, count, qcount, flags, affinity)
}

func slotValue(backend uint32, id uint16, flags bpf.ServiceFlags) bpf.LB4ServiceValue {
	return bpf.NewLBSlotValue(backend, id, flags)
}

func backend4Value(addr tables.L4Addr, state bpf.BackendState) bpf.LB4BackendValue {
	return bpf.NewLB4BackendValue(ap(addr), uint8(addr.Proto), state)
}

func backend6Value(addr tables.L4Addr, state bpf.BackendState) bpf.LB6BackendValue {
	return bpf.NewLB6BackendValue(ap(addr), uint8(addr.Proto), state)
}

func revNat4Value(addr tables.L4Addr) bpf.LB4RevNatValue { return bpf.NewLB4RevNatValue(ap(addr)) }

func revNat6Value(addr tables.L4Addr) bpf.LB6RevNatValue { return bpf.NewLB6RevNatValue(ap(addr)) }
