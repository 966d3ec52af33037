package reconcilers

import (
	"errors"
	"fmt"
	"slices"
	"sync"

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

// lbMapKind names one of the maps, in the order of bpf.LBMapNames.
type lbMapKind uint8

const (
	lb4Services lbMapKind = iota
	lb4Backends
	lb4RevNat
	lb6Services
	lb6Backends
	lb6RevNat
	lbAffinityMatch
	numLBMaps
)

var lbMapNames = bpf.LBMapNames

// lbRole is what a map holds, whatever the family.
type lbRole uint8

const (
	roleServices lbRole = iota
	roleBackends
	roleRevNat
	roleAffinityMatch
)

func (m lbMapKind) role() lbRole {
	switch m {
	case lb4Services, lb6Services:
		return roleServices
	case lb4Backends, lb6Backends:
		return roleBackends
	case lb4RevNat, lb6RevNat:
		return roleRevNat
	}
	return roleAffinityMatch
}

// lbMapFor returns the map of role for the family of addr.
func lbMapFor(r lbRole, addr tables.L4Addr) lbMapKind {
	if r == roleAffinityMatch {
		return lbAffinityMatch
	}
	m := lbMapKind(r) // lb4Services, lb4Backends, lb4RevNat
	if !addr.Addr.Is4() {
		m += lb6Services
	}
	return m
}

// lbOp is one map operation, in terms of the mirror; the maps' own key and
// value types are made from it when it runs. Once it is done, apply
// records it in the mirror.
type lbOp struct {
	m   lbMapKind
	del bool
	// owner is the plan that fails if the operation fails; nil for backend
	// writes, which may serve several plans: those are owners.
	owner  *lbPlan
	owners []*lbPlan
	// owner1 backs owners while there is one: most shared writes serve
	// one plan, and need no list of their own.
	owner1 [1]*lbPlan
	// fe is the frontend whose entry a services, rev-NAT or affinity
	// match operation writes (for a wildcard, not its owner's); be the
	// backend of a backends operation.
	fe *feState
	be *beState

	// addr is the frontend's address (services, rev-NAT) or the
	// backend's (backends).
	addr tables.L4Addr
	// slot and svc are a services entry's slot and value.
	slot uint16
	svc  bpf.LB4ServiceValue
	// id is the backend ID (backends, affinity match) or the service ID
	// (rev-NAT); revNat the service ID of an affinity match.
	id     uint32
	revNat uint16
	state  bpf.BackendState
}

// apply records a done operation in the mirror: what it changed follows
// from the map's role, the kind and, for services, the slot.
func (l *LB) apply(op *lbOp) {
	switch op.m.role() {
	case roleBackends:
		if op.del {
			op.be.written = false
			l.forgetBackend(op.be)
		} else {
			op.be.written, op.be.state = true, op.state
		}
	case roleRevNat:
		op.fe.revNat = !op.del
	case roleAffinityMatch:
		fe := op.fe
		if op.del {
			fe.matched = removeSorted(fe.matched, op.id)
		} else {
			fe.matched, _ = insertSorted(fe.matched, op.id)
		}
	case roleServices:
		fe, slot := op.fe, int(op.slot)
		switch {
		case slot == 0 && op.del:
			fe.master = false
			if isWildcard(fe.addr) && fe.refs == 0 {
				l.forgetFrontend(fe)
			}
		case slot == 0:
			fe.master, fe.count, fe.qcount, fe.flags = true, op.svc.Count, op.svc.QCount, op.svc.Flags
			fe.affinity = op.svc.BackendID & bpf.AffinityTimeoutMask
		case op.del:
			// Slots are trimmed from the last one.
			fe.slots = fe.slots[:slot-1]
		case slot <= len(fe.slots):
			fe.slots[slot-1] = op.svc.BackendID
		default:
			// New slots are written in increasing order.
			fe.slots = append(fe.slots, op.svc.BackendID)
		}
	}
}

// lbPlan is what one frontend's update or delete does.
type lbPlan struct {
	fe       *feState
	flags    bpf.ServiceFlags
	affinity uint32
	// want are the backend IDs the frontend uses after the update.
	want []uint32
	err  error
}

// lbRun collects the operations of one batch of plans. Runs are pooled
// with their buffers (see LB.newRun): the operations, plans and lists of a
// round of thousands of frontends were a third of what the load balancer
// allocated, and the garbage collector's work grows with that.
type lbRun struct {
	steps    [numSteps][]*lbOp
	releases []*beState
	// wildcardWrites are the wildcard entries the run writes, by entry;
	// wildcardReleases those that may have lost their last reference.
	wildcardWrites   map[*feState]*lbOp
	wildcardReleases []*feState
	// ops and plans are carved from chunks, kept for the next run.
	ops   slab[lbOp]
	plans slab[lbPlan]
	// ids backs the plans' want lists.
	ids []uint32
	// group is execute's list of one map's operations of one kind.
	group []*lbOp
	// pool is where release puts the run: its LB's.
	pool *sync.Pool
}

// newRun returns an empty run from l's pool; release hands it back. A
// pool rather than one run kept in l: what a burst made grow goes back to
// the garbage collector once the load balancer has been idle for a couple
// of collections.
func (l *LB) newRun() *lbRun {
	if r, ok := l.runs.Get().(*lbRun); ok {
		return r
	}
	return &lbRun{pool: &l.runs}
}

// release empties r, so that the pool keeps nothing of the mirror alive,
// and pools it. No operation or plan of r may be used after.
func (r *lbRun) release() {
	for i := range r.steps {
		r.steps[i] = reuse(r.steps[i])
	}
	r.releases = reuse(r.releases)
	clear(r.wildcardWrites)
	r.wildcardReleases = reuse(r.wildcardReleases)
	r.ops.reset()
	r.plans.reset()
	r.ids = reuse(r.ids)
	r.group = reuse(r.group)
	r.pool.Put(r)
}

// newOp returns a zero operation that lives as long as the run.
func (r *lbRun) newOp() *lbOp { return r.ops.get() }

// newPlan returns a zero plan that lives as long as the run.
func (r *lbRun) newPlan() *lbPlan { return r.plans.get() }

// wantBuf returns an empty list with room for n IDs, carved from the
// run's: appending beyond n allocates rather than overwrites.
func (r *lbRun) wantBuf(n int) []uint32 {
	if cap(r.ids)-len(r.ids) < n {
		r.ids = make([]uint32, 0, max(keepLen/2, n))
	}
	start := len(r.ids)
	r.ids = r.ids[:start+n]
	return r.ids[start : start : start+n]
}

// slabChunk is the number of values a slab allocates at a time.
const slabChunk = 256

// keepChunks and keepLen bound what a pooled run keeps: a round of a few
// thousand frontends reuses everything, the buffers of a bigger burst are
// left to the garbage collector rather than held by the pool.
const (
	keepChunks = 32
	keepLen    = keepChunks * slabChunk
)

// reuse returns s emptied for the next run, or nil if it grew past
// keepLen. Emptied, it keeps nothing alive.
func reuse[T any](s []T) []T {
	clear(s)
	if cap(s) > keepLen {
		return nil
	}
	return s[:0]
}

// slab hands out pointers to zero values carved from chunks, one
// allocation for many; reset makes them all available again.
type slab[T any] struct {
	chunks [][]T
	// cur is the chunk being carved, used how much of it is.
	cur, used int
}

func (s *slab[T]) get() *T {
	if s.cur == len(s.chunks) {
		s.chunks = append(s.chunks, make([]T, slabChunk))
	}
	v := &s.chunks[s.cur][s.used]
	if s.used++; s.used == slabChunk {
		s.cur, s.used = s.cur+1, 0
	}
	return v
}

// reset zeroes what was handed out, so that the slab keeps nothing alive.
func (s *slab[T]) reset() {
	for i := 0; i < s.cur; i++ {
		clear(s.chunks[i])
	}
	if s.cur < len(s.chunks) {
		clear(s.chunks[s.cur][:s.used])
	}
	if len(s.chunks) > keepChunks {
		clear(s.chunks[keepChunks:])
		s.chunks = s.chunks[:keepChunks]
	}
	s.cur, s.used = 0, 0
}

func (r *lbRun) add(step int, op *lbOp) { r.steps[step] = append(r.steps[step], op) }

// writeBackend schedules the write of be's entry, once per run however many
// plans need it.
func (r *lbRun) writeBackend(be *beState, state bpf.BackendState, p *lbPlan) {
	if op := be.pending; op != nil {
		op.state = state
		op.owners = append(op.owners, p)
		return
	}
	op := r.newOp()
	*op = lbOp{m: lbMapFor(roleBackends, be.addr), be: be, addr: be.addr, id: be.id, state: state, owner1: [1]*lbPlan{p}}
	op.owners = op.owner1[:1:1]
	be.pending = op
	r.add(stepBackends, op)
}

// planUpdate schedules what it takes to make the maps match f.
func (l *LB) planUpdate(run *lbRun, txn statedb.ReadTxn, f *tables.Frontend) *lbPlan {
	p := run.newPlan()
	p.flags, p.affinity = frontendFlags(f), affinityTimeout(f)
	if isWildcard(f.Address) {
		p.err = fmt.Errorf("frontend %s: port 0 is the address's wildcard entry, which the load balancer writes itself", f.Address)
		p.fe = &feState{addr: f.Address}
		return p
	}
	fe := l.frontend(f.Address)
	if fe == nil {
		fe = &feState{addr: f.Address}
		l.setFrontend(fe)
	}
	p.fe = fe
	if fe.id == 0 && !isWildcard(fe.addr) {
		id, err := l.allocServiceID()
		if err != nil {
			p.err = fmt.Errorf("frontend %s: %w", f.Address, err)
			return p
		}
		fe.id = id
		l.frontendByID[id] = fe
	}

	var active, terminating []uint32
	// The datapath translates within a family; the writer gives a
	// frontend only the backends of its own.
	for _, b := range f.Backends {
		if b.Address.Addr.Is4() != fe.addr.Addr.Is4() {
			p.err = fmt.Errorf("frontend %s: backend %s is of the other address family", f.Address, b.Address)
			return p
		}
	}
	p.want = run.wantBuf(len(f.Backends))
	for _, b := range f.Backends {
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
		if st := backendMapState(state); !be.written || be.state != st {
			run.writeBackend(be, st, p)
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
			l.addMaster(run, stepShrink, p, ni, qi, fe.flags, fe.affinity)
		}
	}
	services := lbMapFor(roleServices, fe.addr)
	for i, id := range slots {
		if !rewrite && i < len(fe.slots) && fe.slots[i] == id {
			continue
		}
		op := run.newOp()
		*op = lbOp{m: services, owner: p, fe: fe, addr: fe.addr, slot: uint16(i + 1),
			svc: slotValue(id, fe.id, p.flags),
		}
		run.add(stepSlots, op)
	}
	// A backend is chosen only once count covers its slot (stepGrow), so
	// its affinity match, written with the slots, is there before any
	// client can be pinned to it.
	var match []uint32
	if p.affinity != 0 {
		match = slices.Clone(active)
		slices.Sort(match)
		match = slices.Compact(match)
	}
	l.addMatches(run, p, match)
	if !fe.master || count != n || qcount != q || fe.flags != p.flags || fe.affinity != p.affinity || rewrite {
		l.addMaster(run, stepGrow, p, n, q, p.flags, p.affinity)
	}
	if !fe.revNat && !isWildcard(fe.addr) {
		op := run.newOp()
		*op = lbOp{m: lbMapFor(roleRevNat, fe.addr), owner: p, fe: fe, addr: fe.addr, id: uint32(fe.id)}
		run.add(stepGrow, op)
	}
	l.addTrim(run, p, int(n+q))
	if wantsWildcard(f) {
		// Also when held already but its write failed before.
		if wc := l.frontend(wildcardOf(fe.addr)); !fe.wildcard || wc == nil || !wc.master {
			l.holdWildcard(run, p)
		}
	} else if fe.wildcard {
		l.releaseWildcard(run, fe)
	}
	return p
}

// holdWildcard makes p's frontend count a reference on the wildcard entry
// of its IP, and schedules the entry's write if it is not in the map. The
// frontends of one IP in one run share the write, and each fails with it.
func (l *LB) holdWildcard(run *lbRun, p *lbPlan) {
	fe := p.fe
	wc := l.frontend(wildcardOf(fe.addr))
	if wc == nil {
		wc = &feState{addr: wildcardOf(fe.addr)}
		l.setFrontend(wc)
		fe.wildcard = false
	}
	if !fe.wildcard {
		fe.wildcard = true
		wc.refs++
	}
	if wc.master {
		return
	}
	if op := run.wildcardWrites[wc]; op != nil {
		op.owners = append(op.owners, p)
		return
	}
	op := run.newOp()
	// No service ID (nothing translates back to it), no backends.
	*op = lbOp{m: lbMapFor(roleServices, wc.addr), fe: wc, addr: wc.addr, owner1: [1]*lbPlan{p},
		svc: masterValue(0, 0, 0, 0, 0)}
	op.owners = op.owner1[:1:1]
	if run.wildcardWrites == nil {
		run.wildcardWrites = map[*feState]*lbOp{}
	}
	run.wildcardWrites[wc] = op
	run.add(stepGrow, op)
}

// releaseWildcard drops fe's reference on its IP's wildcard entry. The
// entry is deleted by planWildcardReleases once the whole run is planned,
// so that a frontend of the same IP added in the same run keeps it.
func (l *LB) releaseWildcard(run *lbRun, fe *feState) {
	fe.wildcard = false
	wc := l.frontend(wildcardOf(fe.addr))
	if wc == nil {
		return
	}
	wc.refs--
	if wc.refs <= 0 {
		wc.refs = 0
		run.wildcardReleases = append(run.wildcardReleases, wc)
	}
}

// planWildcardReleases schedules the deletion of the wildcard entries that
// lost their last reference in run. The deletion has no plan to fail: one
// that fails is retried by the next prune, which deletes what no frontend
// explains.
func (l *LB) planWildcardReleases(run *lbRun) {
	for _, wc := range run.wildcardReleases {
		if wc.refs > 0 {
			continue
		}
		if !wc.master {
			l.forgetFrontend(wc)
			continue
		}
		op := run.newOp()
		*op = lbOp{m: lbMapFor(roleServices, wc.addr), del: true, fe: wc, addr: wc.addr}
		run.add(stepTrim, op)
	}
	run.wildcardReleases = nil
}

// addMaster schedules a write of fe's slot 0.
func (l *LB) addMaster(run *lbRun, step int, p *lbPlan, count, qcount uint16, flags bpf.ServiceFlags, affinity uint32) {
	fe := p.fe
	op := run.newOp()
	*op = lbOp{m: lbMapFor(roleServices, fe.addr), owner: p, fe: fe, addr: fe.addr,
		svc: masterValue(fe.id, count, qcount, flags, affinity),
	}
	run.add(step, op)
}

// addTrim schedules the deletion of fe's slots beyond end, last first.
func (l *LB) addTrim(run *lbRun, p *lbPlan, end int) {
	fe := p.fe
	for pos := len(fe.slots); pos > end; pos-- {
		op := run.newOp()
		*op = lbOp{m: lbMapFor(roleServices, fe.addr), del: true, owner: p, fe: fe, addr: fe.addr, slot: uint16(pos)}
		run.add(stepTrim, op)
	}
}

// addMatches schedules the affinity match entries that make fe's matched
// set want (sorted): new ones with the slots, stale ones with the trim,
// after the datapath stopped choosing their backends.
func (l *LB) addMatches(run *lbRun, p *lbPlan, want []uint32) {
	fe := p.fe
	for _, id := range want {
		if _, ok := slices.BinarySearch(fe.matched, id); !ok {
			op := run.newOp()
			*op = lbOp{m: lbAffinityMatch, owner: p, fe: fe, id: id, revNat: fe.id}
			run.add(stepSlots, op)
		}
	}
	for _, id := range fe.matched {
		if _, ok := slices.BinarySearch(want, id); !ok {
			op := run.newOp()
			*op = lbOp{m: lbAffinityMatch, del: true, owner: p, fe: fe, id: id, revNat: fe.id}
			run.add(stepTrim, op)
		}
	}
}

// finishUpdate records a successful update and releases the backends the
// frontend no longer uses.
func (l *LB) finishUpdate(run *lbRun, p *lbPlan) {
	fe := p.fe
	fe.slotsID, fe.slotsFlags, fe.unsure = fe.id, p.flags, false
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
	p := run.newPlan()
	p.fe = fe
	if fe.master {
		op := run.newOp()
		*op = lbOp{m: lbMapFor(roleServices, fe.addr), del: true, owner: p, fe: fe, addr: fe.addr}
		run.add(stepShrink, op)
	}
	l.addTrim(run, p, 0)
	l.addMatches(run, p, nil)
	if fe.wildcard {
		l.releaseWildcard(run, fe)
	}
	if fe.revNat {
		op := run.newOp()
		*op = lbOp{m: lbMapFor(roleRevNat, fe.addr), del: true, owner: p, fe: fe, addr: fe.addr, id: uint32(fe.id)}
		run.add(stepTrim, op)
	}
	return p
}

// finishDelete forgets a deleted frontend, releases its ID and its backends.
func (l *LB) finishDelete(run *lbRun, p *lbPlan) {
	fe := p.fe
	l.forgetFrontend(fe)
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
			for _, del := range [...]bool{false, true} {
				group := run.group[:0]
				for _, op := range ops {
					if op.m == m && op.del == del {
						group = append(group, op)
					}
				}
				l.execGroup(run, group)
				run.group = group
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
		*op = lbOp{m: lbMapFor(roleBackends, be.addr), del: true, be: be, addr: be.addr, id: be.id}
		group = append(group, op)
	}
	// Each group is one map.
	slices.SortStableFunc(group, func(a, b *lbOp) int { return int(a.m) - int(b.m) })
	var failed []*lbOp
	for len(group) > 0 {
		n := 1
		for n < len(group) && group[n].m == group[0].m {
			n++
		}
		failed = append(failed, l.execGroup(run, group[:n])...)
		group = group[n:]
	}
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
		// Filtered in place: the caller's list is scratch.
		live := ops[:0]
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
		}
		for _, p := range op.owners {
			p.err = err
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
	switch op.m.role() {
	case roleServices:
		what = fmt.Sprintf("%s slot %d", op.addr, op.slot)
	case roleBackends:
		what = fmt.Sprintf("backend %d", op.id)
	case roleRevNat:
		what = fmt.Sprintf("rev-NAT %d", op.id)
	case roleAffinityMatch:
		what = fmt.Sprintf("backend %d of service %d", op.id, op.revNat)
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
