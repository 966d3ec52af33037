package reconcilers

import (
	"errors"
	"fmt"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// A change to the maps runs in steps. Every step finishes, for all the
// frontends of a batch, before the next one starts, so that the datapath
// never picks a slot that is missing or names a missing backend:
//
//  1. stepBackends writes the backend entries that are new or changed;
//  2. stepShrink lowers count and qcount in slot 0 where they shrink;
//  3. stepSlots writes the slots whose contents change, appending new ones
//     in increasing order;
//  4. stepGrow writes slot 0 with the final count and qcount (and the
//     reverse NAT entry);
//  5. stepTrim deletes the slots beyond the new end, from the last one;
//  6. then the backends no frontend uses any more are deleted.
//
// Removing one backend of a service thus costs one write of slot 0, one
// slot write (the last slot moved into the hole), one slot delete and one
// backend delete.
const (
	stepBackends = iota
	stepShrink
	stepSlots
	stepGrow
	stepTrim
	numSteps
)

// lbMapKind names one of the three maps.
type lbMapKind uint8

const (
	lbServices lbMapKind = iota
	lbBackends
	lbRevNat
	numLBMaps
)

var lbMapNames = [numLBMaps]string{bpf.LB4ServicesMap, bpf.LB4BackendsMap, bpf.LB4RevNatMap}

// lbOp is one map operation. Once it is done, apply records it in the
// mirror.
type lbOp struct {
	m   lbMapKind
	del bool
	// owner is the plan that fails if the operation fails; nil for backend
	// writes, which may serve several plans: those are owners.
	owner  *lbPlan
	owners []*lbPlan
	be     *beState

	svcKey bpf.LB4ServiceKey
	svcVal bpf.LB4ServiceValue
	beID   uint32
	beVal  bpf.LB4BackendValue
	revKey bpf.Be16
	revVal bpf.LB4RevNatValue
}

// apply records a done operation in the mirror: what it changed follows
// from the map, the kind and, for lb4_services, the slot.
func (l *LB) apply(op *lbOp) {
	switch op.m {
	case lbBackends:
		if op.del {
			op.be.written = false
			l.forgetBackend(op.be)
		} else {
			op.be.written, op.be.value = true, op.beVal
		}
	case lbRevNat:
		op.owner.fe.revNat = !op.del
	case lbServices:
		fe, slot := op.owner.fe, int(op.svcKey.Slot)
		switch {
		case slot == 0 && op.del:
			fe.master = false
		case slot == 0:
			fe.master, fe.count, fe.qcount, fe.flags = true, op.svcVal.Count, op.svcVal.QCount, op.svcVal.Flags
		case op.del:
			// Slots are trimmed from the last one.
			fe.slots = fe.slots[:slot-1]
		case slot <= len(fe.slots):
			fe.slots[slot-1] = op.svcVal.BackendID
		default:
			// New slots are written in increasing order.
			fe.slots = append(fe.slots, op.svcVal.BackendID)
		}
	}
}

// lbPlan is what one frontend's update or delete does.
type lbPlan struct {
	fe    *feState
	flags bpf.ServiceFlags
	// want are the backend IDs the frontend uses after the update.
	want []uint32
	err  error
}

// lbRun collects the operations of one batch of plans.
type lbRun struct {
	steps    [numSteps][]*lbOp
	releases []*beState
	// slab is where new operations are carved from: one allocation for
	// many, as a run plans several per frontend.
	slab []lbOp
}

// newOp returns a zero operation that lives as long as the run.
func (r *lbRun) newOp() *lbOp {
	if len(r.slab) == cap(r.slab) {
		r.slab = make([]lbOp, 0, 256)
	}
	r.slab = r.slab[:len(r.slab)+1]
	return &r.slab[len(r.slab)-1]
}

func newLBRun() *lbRun { return &lbRun{} }

func (r *lbRun) add(step int, op *lbOp) { r.steps[step] = append(r.steps[step], op) }

// writeBackend schedules the write of be's entry, once per run however many
// plans need it.
func (r *lbRun) writeBackend(be *beState, val bpf.LB4BackendValue, p *lbPlan) {
	if op := be.pending; op != nil {
		op.beVal = val
		op.owners = append(op.owners, p)
		return
	}
	op := r.newOp()
	*op = lbOp{m: lbBackends, be: be, beID: be.id, beVal: val, owners: []*lbPlan{p}}
	be.pending = op
	r.add(stepBackends, op)
}

// planUpdate schedules what it takes to make the maps match f.
func (l *LB) planUpdate(run *lbRun, txn statedb.ReadTxn, f *tables.Frontend) *lbPlan {
	p := &lbPlan{flags: frontendFlags(f.Type)}
	if !f.Address.Addr.Is4() {
		p.err = fmt.Errorf("frontend %s: only IPv4 frontends are load-balanced", f.Address)
		p.fe = &feState{addr: f.Address}
		return p
	}
	fe := l.frontends[keyOf(f.Address)]
	if fe == nil {
		fe = &feState{addr: f.Address}
		l.frontends[keyOf(f.Address)] = fe
	}
	p.fe = fe
	if fe.id == 0 {
		id, err := l.allocServiceID()
		if err != nil {
			p.err = fmt.Errorf("frontend %s: %w", f.Address, err)
			return p
		}
		fe.id = id
		l.frontendByID[id] = fe
	}

	var active, terminating []uint32
	p.want = make([]uint32, 0, len(f.Backends))
	for _, b := range f.Backends {
		if !b.Address.Addr.Is4() {
			continue
		}
		be, err := l.backendFor(b.Address)
		if err != nil {
			p.err = fmt.Errorf("frontend %s: backend %s: %w", f.Address, b.Address, err)
			return p
		}
		// The entry is shared by every service using the backend, so it
		// carries the backend's overall state; the slots follow this
		// frontend's view.
		state := b.State
		if shared, _, ok := l.backends.Get(txn, tables.BackendAddressIndex.Query(b.Address)); ok {
			state = shared.State
		}
		if val := backendValue(b.Address, state); !be.written || be.value != val {
			run.writeBackend(be, val, p)
		}
		if held, added := insertSorted(fe.held, be.id); added {
			fe.held = held
			be.refs++
		}
		p.want = append(p.want, be.id)
		switch b.State {
		case tables.BackendActive:
			active = append(active, be.id)
		case tables.BackendTerminating:
			terminating = append(terminating, be.id)
		}
	}
	slices.Sort(p.want)
	p.want = slices.Compact(p.want)

	slots := planSlots(fe.slots, active, terminating)
	n, q := uint16(len(active)), uint16(len(terminating))
	rewrite := fe.slotsID != fe.id || fe.slotsFlags != p.flags

	count, qcount := fe.count, fe.qcount
	if fe.master {
		ni := min(fe.count, n)
		qi := min(fe.count+fe.qcount, n+q) - ni
		if ni != fe.count || qi != fe.qcount {
			count, qcount = ni, qi
			l.addMaster(run, stepShrink, p, ni, qi, fe.flags)
		}
	}
	for i, id := range slots {
		if !rewrite && i < len(fe.slots) && fe.slots[i] == id {
			continue
		}
		op := run.newOp()
		*op = lbOp{m: lbServices, owner: p,
			svcKey: serviceKey(fe.addr, uint16(i+1)),
			svcVal: bpf.LB4ServiceValue{BackendID: id, RevNat: bpf.NewBe16(fe.id), Flags: p.flags},
		}
		run.add(stepSlots, op)
	}
	if !fe.master || count != n || qcount != q || fe.flags != p.flags || rewrite {
		l.addMaster(run, stepGrow, p, n, q, p.flags)
	}
	if !fe.revNat {
		op := run.newOp()
		*op = lbOp{m: lbRevNat, owner: p,
			revKey: bpf.NewBe16(fe.id),
			revVal: bpf.LB4RevNatValue{Address: fe.addr.Addr.As4(), Port: bpf.NewBe16(fe.addr.Port)},
		}
		run.add(stepGrow, op)
	}
	l.addTrim(run, p, int(n+q))
	return p
}

// addMaster schedules a write of fe's slot 0.
func (l *LB) addMaster(run *lbRun, step int, p *lbPlan, count, qcount uint16, flags bpf.ServiceFlags) {
	fe := p.fe
	op := run.newOp()
	*op = lbOp{m: lbServices, owner: p,
		svcKey: serviceKey(fe.addr, 0),
		svcVal: bpf.LB4ServiceValue{Count: count, QCount: qcount, RevNat: bpf.NewBe16(fe.id), Flags: flags},
	}
	run.add(step, op)
}

// addTrim schedules the deletion of fe's slots beyond end, last first.
func (l *LB) addTrim(run *lbRun, p *lbPlan, end int) {
	fe := p.fe
	for pos := len(fe.slots); pos > end; pos-- {
		op := run.newOp()
		*op = lbOp{m: lbServices, del: true, owner: p, svcKey: serviceKey(fe.addr, uint16(pos))}
		run.add(stepTrim, op)
	}
}

// finishUpdate records a successful update and releases the backends the
// frontend no longer uses.
func (l *LB) finishUpdate(run *lbRun, p *lbPlan) {
	fe := p.fe
	fe.slotsID, fe.slotsFlags = fe.id, p.flags
	kept := fe.held[:0]
	for _, id := range fe.held {
		if _, ok := slices.BinarySearch(p.want, id); ok {
			kept = append(kept, id)
			continue
		}
		l.unref(run, id)
	}
	fe.held = kept
}

// planDelete schedules the removal of everything fe has in the maps: slot 0
// first, so that the datapath stops choosing the frontend's backends, then
// the slots and the reverse NAT entry.
func (l *LB) planDelete(run *lbRun, fe *feState) *lbPlan {
	p := &lbPlan{fe: fe}
	if fe.master {
		op := run.newOp()
		*op = lbOp{m: lbServices, del: true, owner: p, svcKey: serviceKey(fe.addr, 0)}
		run.add(stepShrink, op)
	}
	l.addTrim(run, p, 0)
	if fe.revNat {
		op := run.newOp()
		*op = lbOp{m: lbRevNat, del: true, owner: p, revKey: bpf.NewBe16(fe.id)}
		run.add(stepTrim, op)
	}
	return p
}

// finishDelete forgets a deleted frontend, releases its ID and its backends.
func (l *LB) finishDelete(run *lbRun, p *lbPlan) {
	fe := p.fe
	delete(l.frontends, keyOf(fe.addr))
	if l.frontendByID[fe.id] == fe {
		delete(l.frontendByID, fe.id)
	}
	for _, id := range fe.held {
		l.unref(run, id)
	}
	fe.held = nil
}

func (l *LB) unref(run *lbRun, id uint32) {
	be := l.backendByID[id]
	if be == nil {
		return
	}
	be.refs--
	if be.refs <= 0 {
		be.refs = 0
		run.releases = append(run.releases, be)
	}
}

// execute runs the steps of run in order.
func (l *LB) execute(run *lbRun) {
	// Planning is over: the next run plans its own backend writes.
	for _, op := range run.steps[stepBackends] {
		op.be.pending = nil
	}
	for step := range run.steps {
		ops := run.steps[step]
		// Within a step, the operations on one map and of one kind go out
		// together, in the order they were planned.
		for m := range numLBMaps {
			for _, del := range []bool{false, true} {
				var group []*lbOp
				for _, op := range ops {
					if op.m == m && op.del == del {
						group = append(group, op)
					}
				}
				l.execGroup(run, group)
			}
		}
	}
}

// executeReleases deletes the backends that lost their last user in this
// run, and those whose deletion failed before.
func (l *LB) executeReleases(run *lbRun) {
	candidates := append(run.releases, l.orphans...)
	l.orphans = nil
	var group []*lbOp
	seen := map[*beState]bool{}
	for _, be := range candidates {
		if be.refs > 0 || seen[be] {
			continue
		}
		seen[be] = true
		if !be.written {
			l.forgetBackend(be)
			continue
		}
		op := run.newOp()
		*op = lbOp{m: lbBackends, del: true, be: be, beID: be.id}
		group = append(group, op)
	}
	failed := l.execGroup(run, group)
	for _, op := range failed {
		l.orphans = append(l.orphans, op.be)
	}
}

// execGroup runs ops, all on one map and of one kind, as one batch, or as
// one plain operation when there is only one. An operation that fails fails
// its plan (or the plans that needed the backend it writes), and the
// plans' later operations are skipped. It returns the failed operations.
func (l *LB) execGroup(run *lbRun, ops []*lbOp) (failed []*lbOp) {
	for len(ops) > 0 {
		live := ops[:0:0]
		for _, op := range ops {
			if op.owner == nil || op.owner.err == nil {
				live = append(live, op)
			}
		}
		if len(live) == 0 {
			return failed
		}
		done, err := l.maps.run(live)
		l.Ops.add(live[0].m, live[0].del, min(done+1, len(live)))
		for _, op := range live[:done] {
			l.apply(op)
		}
		if err == nil {
			return failed
		}
		op := live[done]
		ops = live[done+1:]
		if op.del && errors.Is(err, ebpf.ErrKeyNotExist) {
			l.apply(op)
			continue
		}
		err = l.opError(op, err)
		failed = append(failed, op)
		if op.owner != nil {
			op.owner.err = err
		} else if op.be != nil {
			for _, p := range op.owners {
				p.err = err
			}
		}
	}
	return failed
}

// opError explains a failed operation; a full map names the flag to raise.
func (l *LB) opError(op *lbOp, err error) error {
	name := lbMapNames[op.m]
	if errors.Is(err, unix.E2BIG) || errors.Is(err, unix.ENOSPC) {
		return &mapFullError{
			msg: fmt.Sprintf("map %s is full (%d entries): raise --%s", name, l.cfg.MaxEntries, l.cfg.MaxEntriesFlag),
			err: err,
		}
	}
	verb := "update"
	if op.del {
		verb = "delete"
	}
	var what string
	switch op.m {
	case lbServices:
		what = fmt.Sprintf("%s slot %d", op.svcKey.L4Addr(), op.svcKey.Slot)
	case lbBackends:
		what = fmt.Sprintf("backend %d", op.beID)
	case lbRevNat:
		what = fmt.Sprintf("rev-NAT %d", op.revKey.Uint16())
	}
	return fmt.Errorf("%s %s %s: %w", verb, name, what, err)
}

// mapFullError says which map is full and which flag sizes it; the
// library's text for the errno ("key too big for map") would mislead.
type mapFullError struct {
	msg string
	err error
}

func (e *mapFullError) Error() string { return e.msg }
func (e *mapFullError) Unwrap() error { return e.err }
