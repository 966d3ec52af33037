package lb

import (
	"cmp"
	"fmt"
	"maps"
	"slices"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/tables"
)

// writer keeps the services, frontends and backends tables consistent: every
// change goes through it, inside the caller's write transaction, so that a
// reader never sees a frontend whose backends are half updated.
type writer struct {
	services  statedb.RWTable[*tables.Service]
	frontends statedb.RWTable[*tables.Frontend]
	backends  statedb.RWTable[*tables.Backend]

	// conflicted are the services waiting for a frontend address another
	// service uses. Kept here rather than as an index: few services are
	// ever in it, and an index would cost every service insert.
	conflicted map[tables.ServiceName]struct{}
}

// change collects what a batch of writes touched.
type change struct {
	// dirty are the services whose frontends must be recomputed.
	dirty map[tables.ServiceName]struct{}
	// problems are the services whose errors or conflicts changed, with
	// their new problems (empty when solved).
	problems map[tables.ServiceName][]string
	// prev are the services as they were before the batch (nil if new):
	// their frontends are the ones that may have to go.
	prev map[tables.ServiceName]*tables.Service
}

func newChange() *change {
	return &change{
		dirty:    map[tables.ServiceName]struct{}{},
		problems: map[tables.ServiceName][]string{},
		prev:     map[tables.ServiceName]*tables.Service{},
	}
}

// remember records the service as it was before the batch.
func (c *change) remember(name tables.ServiceName, old *tables.Service) {
	if _, ok := c.prev[name]; !ok {
		c.prev[name] = old
	}
}

func (w *writer) upsertService(txn statedb.WriteTxn, svc *tables.Service, c *change) {
	old, _, ok := w.services.Get(txn, tables.ServiceNameIndex.Query(svc.Name))
	if ok {
		svc.Conflicts = old.Conflicts
	}
	c.remember(svc.Name, old)
	w.services.Insert(txn, svc)
	c.dirty[svc.Name] = struct{}{}
}

func (w *writer) deleteService(txn statedb.WriteTxn, name tables.ServiceName, c *change) {
	if old, _, ok := w.services.Get(txn, tables.ServiceNameIndex.Query(name)); ok {
		c.remember(name, old)
		w.services.Delete(txn, old)
		c.dirty[name] = struct{}{}
	}
}

// upsertSlice replaces what the slice said about its service's backends.
func (w *writer) upsertSlice(txn statedb.WriteTxn, s parsedSlice, c *change) {
	next := make(map[tables.L4Addr]sliceBackend, len(s.backends))
	for _, b := range s.backends {
		// An address listed twice keeps its best state.
		if prev, ok := next[b.addr]; !ok || b.state < prev.state {
			next[b.addr] = b
		}
	}
	// Collected first: the table must not change under an iteration.
	var gone []*tables.Backend
	for be := range w.backends.List(txn, tables.BackendServiceIndex.Query(s.service)) {
		if _, ok := next[be.Address]; !ok && instanceIndex(be, s.service, s.name) >= 0 {
			gone = append(gone, be)
		}
	}
	changed := len(gone) > 0
	for _, be := range gone {
		w.setInstance(txn, be.Address, be, s.service, s.name, nil)
	}
	for addr, b := range next {
		be, _, _ := w.backends.Get(txn, tables.BackendAddressIndex.Query(addr))
		inst := tables.BackendInstance{Service: s.service, Slice: s.name, PortName: b.portName, State: b.state}
		if be != nil {
			if i := instanceIndex(be, s.service, s.name); i >= 0 && be.Services[i] == inst {
				continue
			}
		}
		w.setInstance(txn, addr, be, s.service, s.name, &inst)
		changed = true
	}
	if changed {
		c.dirty[s.service] = struct{}{}
	}
}

// deleteSlice removes what the slice said.
func (w *writer) deleteSlice(txn statedb.WriteTxn, svc tables.ServiceName, slice string, c *change) {
	w.upsertSlice(txn, parsedSlice{service: svc, name: slice}, c)
}

// setInstance sets (or, with inst nil, removes) the instance of (svc,
// slice) on the backend at addr, deleting the backend when no instance is
// left.
func (w *writer) setInstance(txn statedb.WriteTxn, addr tables.L4Addr, be *tables.Backend,
	svc tables.ServiceName, slice string, inst *tables.BackendInstance) {
	var insts []tables.BackendInstance
	if be != nil {
		insts = slices.Clone(be.Services)
	}
	if i := indexOfInstance(insts, svc, slice); i >= 0 {
		insts = slices.Delete(insts, i, i+1)
	}
	if inst != nil {
		i, _ := slices.BinarySearchFunc(insts, *inst, compareInstances)
		insts = slices.Insert(insts, i, *inst)
	}
	if len(insts) == 0 {
		if be != nil {
			w.backends.Delete(txn, be)
		}
		return
	}
	state := tables.BackendNotServing
	for _, in := range insts {
		state = min(state, in.State)
	}
	w.backends.Insert(txn, &tables.Backend{Address: addr, State: state, Services: insts})
}

func compareInstances(a, b tables.BackendInstance) int {
	return cmp.Or(a.Service.Compare(b.Service), cmp.Compare(a.Slice, b.Slice))
}

func indexOfInstance(insts []tables.BackendInstance, svc tables.ServiceName, slice string) int {
	for i, in := range insts {
		if in.Service == svc && in.Slice == slice {
			return i
		}
	}
	return -1
}

func instanceIndex(be *tables.Backend, svc tables.ServiceName, slice string) int {
	return indexOfInstance(be.Services, svc, slice)
}

// refresh recomputes the frontends of the services c marks dirty, then, if
// that freed frontend addresses, of the services waiting for one.
func (w *writer) refresh(txn statedb.WriteTxn, c *change) {
	freed := false
	// In name order, so that IDs do not depend on map iteration order.
	for _, name := range slices.SortedFunc(maps.Keys(c.dirty), tables.ServiceName.Compare) {
		freed = w.refreshService(txn, name, c) || freed
	}
	if !freed {
		return
	}
	for _, name := range slices.SortedFunc(maps.Keys(w.conflicted), tables.ServiceName.Compare) {
		w.refreshService(txn, name, c)
	}
}

// refreshService makes the frontends of the service match it and its
// backends. It reports whether it deleted frontends.
func (w *writer) refreshService(txn statedb.WriteTxn, name tables.ServiceName, c *change) (deleted bool) {
	svc, _, found := w.services.Get(txn, tables.ServiceNameIndex.Query(name))
	want := desiredFrontends(svc)

	var backends []svcBackend
	if len(want) > 0 {
		backends = w.serviceBackends(txn, name)
	}
	var conflicts []string
	wanted := make(map[tables.L4Addr]bool, len(want))
	for _, fe := range want {
		old, _, exists := w.frontends.Get(txn, tables.FrontendAddressIndex.Query(fe.Address))
		if exists && old.Service != name {
			conflicts = append(conflicts, fmt.Sprintf("frontend %s is already used by service %s", fe.Address, old.Service))
			continue
		}
		wanted[fe.Address] = true
		fe.Backends = backendsFor(fe, backends)
		if exists && old.Type == fe.Type && old.PortName == fe.PortName && slices.Equal(old.Backends, fe.Backends) {
			continue
		}
		if exists {
			fe.ID = old.ID
		}
		fe.Status = reconciler.StatusPending()
		w.frontends.Insert(txn, fe)
	}
	// The frontends the service had come from what it was before the
	// batch (it is unchanged in the table when only its slices changed).
	before, changed := c.prev[name]
	if !changed {
		before = svc
	}
	for _, fe := range desiredFrontends(before) {
		if wanted[fe.Address] {
			continue
		}
		if old, _, ok := w.frontends.Get(txn, tables.FrontendAddressIndex.Query(fe.Address)); ok && old.Service == name {
			w.frontends.Delete(txn, old)
			deleted = true
		}
	}

	if found && !slices.Equal(svc.Conflicts, conflicts) {
		svc = svc.Clone()
		svc.Conflicts = conflicts
		w.services.Insert(txn, svc)
	}
	if found && len(svc.Conflicts) > 0 {
		w.conflicted[name] = struct{}{}
	} else {
		delete(w.conflicted, name)
	}
	if found {
		c.problems[name] = append(slices.Clone(svc.Errors), svc.Conflicts...)
	} else {
		c.problems[name] = nil
	}
	return deleted
}

// svcBackend is a backend as one service sees it, merged over its slices.
type svcBackend struct {
	addr     tables.L4Addr
	portName string
	state    tables.BackendState
}

// serviceBackends returns the backends of the service, sorted by address.
func (w *writer) serviceBackends(txn statedb.ReadTxn, name tables.ServiceName) []svcBackend {
	var out []svcBackend
	for be := range w.backends.List(txn, tables.BackendServiceIndex.Query(name)) {
		merged := svcBackend{addr: be.Address, state: tables.BackendNotServing + 1}
		for _, in := range be.Services {
			if in.Service == name && in.State < merged.state {
				merged.state, merged.portName = in.State, in.PortName
			}
		}
		if merged.state <= tables.BackendNotServing {
			out = append(out, merged)
		}
	}
	slices.SortFunc(out, func(a, b svcBackend) int { return a.addr.Compare(b.addr) })
	return out
}

// backendsFor selects the backends of a frontend: same protocol and address
// family, and the slice port named like the service port, which is how
// Kubernetes resolves (named) target ports.
func backendsFor(fe *tables.Frontend, backends []svcBackend) []tables.FrontendBackend {
	var out []tables.FrontendBackend
	for _, b := range backends {
		if b.portName == fe.PortName && b.addr.Proto == fe.Address.Proto && b.addr.Addr.Is4() == fe.Address.Addr.Is4() {
			out = append(out, tables.FrontendBackend{Address: b.addr, State: b.state})
		}
	}
	return out
}
