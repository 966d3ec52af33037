package lb

import (
	"cmp"
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/tables"
)

// writer keeps the services, frontends and backends tables consistent: every
// change goes through it, inside the caller's write transaction, so that a
// reader never sees a frontend whose backends are half updated.
//
// Its table writes drop their errors: statedb's Insert and Delete fail only
// for a transaction that is closed or does not lock the table, and the one
// caller, reflector.apply, passes an open transaction of all three tables.
// (Handling them here would also leave conflicted and sliceRecords ahead of
// an aborted transaction.)
type writer struct {
	services  statedb.RWTable[*tables.Service]
	frontends statedb.RWTable[*tables.Frontend]
	backends  statedb.RWTable[*tables.Backend]

	// conflicted are the services waiting for a frontend address another
	// service uses. Kept here rather than as an index: few services are
	// ever in it, and an index would cost every service insert.
	conflicted map[tables.ServiceName]struct{}

	// sliceRecords are the EndpointSlices of each service, with what each
	// one said. Kept here rather than found through an index of the
	// backends table by service, which cost more than the rest of an
	// insert together.
	sliceRecords map[tables.ServiceName][]sliceRecord

	// edits is upsertSlice's buffer, reused between calls.
	edits []instanceEdit

	// nodeName is this node's name: Local traffic policies keep the
	// backends whose endpoint names it.
	nodeName string
	// nodeIPs are this node's own addresses, of both families, where
	// NodePort frontends listen. They come from the configuration and do not
	// change while the agent runs.
	nodeIPs []netip.Addr
}

// sliceRecord is what one EndpointSlice said about its service's backends.
type sliceRecord struct {
	name string
	// backends are sorted by address and port name, one per pair (see
	// sortBackends).
	backends []sliceBackend
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
	// names is refresh's list of the dirty services, reused.
	names []tables.ServiceName
}

func newChange() *change {
	return &change{
		dirty:    map[tables.ServiceName]struct{}{},
		problems: map[tables.ServiceName][]string{},
		prev:     map[tables.ServiceName]*tables.Service{},
	}
}

// reset empties c for the next batch, keeping the maps' room: growing them
// afresh for every batch cost more than what went into them.
func (c *change) reset() {
	clear(c.dirty)
	clear(c.problems)
	clear(c.prev)
}

// remember records the service as it was before the batch.
func (c *change) remember(name tables.ServiceName, old *tables.Service) {
	if _, ok := c.prev[name]; !ok {
		c.prev[name] = old
	}
}

func (w *writer) upsertService(txn statedb.WriteTxn, svc *tables.Service, c *change) {
	// One lookup rather than a Get and an Insert. Cannot fail: apply's
	// open txn locks all three tables (see writer).
	old, _, _ := w.services.Modify(txn, svc, keepConflicts)
	c.remember(svc.Name, old)
	c.dirty[svc.Name] = struct{}{}
}

// keepConflicts merges a service's new row with its old one: the
// conflicts are the writer's, not the object's, and stay until refresh
// recomputes them.
func keepConflicts(old, new *tables.Service) *tables.Service {
	new.Conflicts = old.Conflicts
	return new
}

func (w *writer) deleteService(txn statedb.WriteTxn, name tables.ServiceName, c *change) {
	if old, _, ok := w.services.Get(txn, tables.ServiceNameIndex.Query(name)); ok {
		c.remember(name, old)
		// Cannot fail: apply's open txn locks all three tables (see writer).
		w.services.Delete(txn, old)
		c.dirty[name] = struct{}{}
	}
}

// upsertSlice replaces what the slice said about its service's backends.
func (w *writer) upsertSlice(txn statedb.WriteTxn, s parsedSlice, c *change) {
	next := sortBackends(s.backends)
	recs := w.sliceRecords[s.service]
	i := slices.IndexFunc(recs, func(r sliceRecord) bool { return r.name == s.name })
	var prev []sliceBackend
	if i >= 0 {
		prev = recs[i].backends
	}
	// Both lists are sorted the same way: one walk finds what went, what
	// came and what changed. The edits come out sorted by address, then
	// port name, so those of one backend are adjacent and applied to it
	// together: one at a time, a backend serving 10,000 ports of a service
	// had its instance list copied 10,000 times (seconds).
	edits := w.edits[:0]
	for p, n := 0, 0; p < len(prev) || n < len(next); {
		switch {
		case n == len(next) || p < len(prev) && compareUse(prev[p], next[n]) < 0:
			edits = append(edits, instanceEdit{addr: prev[p].addr, inst: tables.BackendInstance{Service: s.service, Slice: s.name, PortName: prev[p].portName}})
			p++
			continue
		case p < len(prev) && compareUse(prev[p], next[n]) == 0:
			same := prev[p] == next[n]
			p++
			if same {
				n++
				continue
			}
		}
		b := next[n]
		edits = append(edits, instanceEdit{addr: b.addr, inst: tables.BackendInstance{Service: s.service, Slice: s.name, PortName: b.portName, State: b.state}, set: true})
		n++
	}
	for start := 0; start < len(edits); {
		end := start + 1
		for end < len(edits) && edits[end].addr == edits[start].addr {
			end++
		}
		w.setInstances(txn, edits[start].addr, edits[start:end])
		start = end
	}
	changed := len(edits) > 0
	clear(edits) // no strings kept alive by the reused buffer
	w.edits = edits[:0]
	switch {
	case len(next) == 0 && i >= 0:
		recs = slices.Delete(recs, i, i+1)
	case len(next) == 0:
	case i >= 0:
		recs[i].backends = next
	default:
		recs = append(recs, sliceRecord{name: s.name, backends: next})
	}
	if len(recs) == 0 {
		delete(w.sliceRecords, s.service)
	} else {
		w.sliceRecords[s.service] = recs
	}
	if changed {
		c.dirty[s.service] = struct{}{}
	}
}

// sortBackends sorts the backends of a slice by address and port name,
// keeping only the best state of a pair listed twice. An address appears
// once per port name: two service ports may target one container port, and
// the backend then serves both. It reuses bs.
func sortBackends(bs []sliceBackend) []sliceBackend {
	slices.SortFunc(bs, func(a, b sliceBackend) int {
		return cmp.Or(compareUse(a, b), cmp.Compare(a.state, b.state))
	})
	return slices.CompactFunc(bs, func(a, b sliceBackend) bool { return compareUse(a, b) == 0 })
}

// compareUse orders backends by address, then by the port name they serve.
func compareUse(a, b sliceBackend) int {
	return cmp.Or(a.addr.Compare(b.addr), cmp.Compare(a.portName, b.portName))
}

// deleteSlice removes what the slice said.
func (w *writer) deleteSlice(txn statedb.WriteTxn, svc tables.ServiceName, slice string, c *change) {
	w.upsertSlice(txn, parsedSlice{service: svc, name: slice}, c)
}

// instanceEdit sets (with set) or removes one instance of the backend at
// addr.
type instanceEdit struct {
	addr tables.L4Addr
	inst tables.BackendInstance
	set  bool
}

// setInstances applies edits, all of one slice of one service and sorted
// by port name, to the backend at addr, deleting the backend when no
// instance is left. It merges them into the backend's sorted instances in
// one pass.
func (w *writer) setInstances(txn statedb.WriteTxn, addr tables.L4Addr, edits []instanceEdit) {
	// Cannot fail, here and below: apply's open txn locks all three
	// tables (see writer).
	if slices.ContainsFunc(edits, func(e instanceEdit) bool { return e.set }) {
		// Something is set, so the backend stays: one lookup, where a
		// new backend (the common case) gets what edits set.
		w.backends.Modify(txn, newBackend(addr, mergeInstances(nil, edits)), func(old, _ *tables.Backend) *tables.Backend {
			return newBackend(addr, mergeInstances(old.Services, edits))
		})
		return
	}
	be, _, ok := w.backends.Get(txn, tables.BackendAddressIndex.Query(addr))
	if !ok {
		return
	}
	if insts := mergeInstances(be.Services, edits); len(insts) > 0 {
		w.backends.Insert(txn, newBackend(addr, insts))
	} else {
		w.backends.Delete(txn, be)
	}
}

// newBackend returns the backend at addr with insts, in the best of their
// states.
func newBackend(addr tables.L4Addr, insts []tables.BackendInstance) *tables.Backend {
	state := tables.BackendNotServing
	for _, in := range insts {
		state = min(state, in.State)
	}
	return &tables.Backend{Address: addr, State: state, Services: insts}
}

// mergeInstances returns old, sorted by compareInstances, with edits
// (sorted the same way) applied: an instance set replaces the one it
// compares equal to or is inserted, one removed is left out. The result is
// counted first: backends live long, and an exact slice holds no spare
// capacity. old is not modified.
func mergeInstances(old []tables.BackendInstance, edits []instanceEdit) []tables.BackendInstance {
	walk := func(emit func(tables.BackendInstance)) {
		i := 0
		for _, e := range edits {
			for i < len(old) && compareInstances(old[i], e.inst) < 0 {
				emit(old[i])
				i++
			}
			if i < len(old) && compareInstances(old[i], e.inst) == 0 {
				i++
			}
			if e.set {
				emit(e.inst)
			}
		}
		for ; i < len(old); i++ {
			emit(old[i])
		}
	}
	n := 0
	walk(func(tables.BackendInstance) { n++ })
	if n == 0 {
		return nil
	}
	out := make([]tables.BackendInstance, 0, n)
	walk(func(in tables.BackendInstance) { out = append(out, in) })
	return out
}

// compareInstances orders a backend's instances by service, slice and
// port name, which together identify one.
func compareInstances(a, b tables.BackendInstance) int {
	return cmp.Or(a.Service.Compare(b.Service), cmp.Compare(a.Slice, b.Slice), cmp.Compare(a.PortName, b.PortName))
}

// refresh recomputes the frontends of the services c marks dirty, then, if
// that freed frontend addresses, of the services waiting for one.
func (w *writer) refresh(txn statedb.WriteTxn, c *change) {
	freed := false
	// In name order, so that IDs do not depend on map iteration order.
	c.names = c.names[:0]
	for name := range c.dirty {
		c.names = append(c.names, name)
	}
	slices.SortFunc(c.names, tables.ServiceName.Compare)
	for _, name := range c.names {
		freed = w.refreshService(txn, name, c) || freed
	}
	clear(c.names)
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
	// What the service was before the batch; it is unchanged in the table
	// when only its slices changed.
	before, changed := c.prev[name]
	if !changed {
		before = svc
	}
	hadProblems := before != nil && len(before.Errors)+len(before.Conflicts) > 0 ||
		found && len(svc.Conflicts) > 0

	want := desiredFrontends(svc, w.nodeIPs)
	var backends []sliceBackend
	if len(want) > 0 {
		backends = w.serviceBackends(name)
	}
	byPort := groupByPort(want, backends)
	var conflicts []string
	for _, fe := range want {
		old, _, exists := w.frontends.Get(txn, tables.FrontendAddressIndex.Query(fe.Address))
		if exists && old.Service != name {
			conflicts = append(conflicts, fmt.Sprintf("frontend %s is already used by service %s", fe.Address, old.Service))
			continue
		}
		fe.Backends = backendsFor(fe, byPort.of(fe.PortName, backends), localOnly(svc, fe.Type), w.nodeName)
		if exists && old.Type == fe.Type && old.PortName == fe.PortName && old.SessionAffinity == fe.SessionAffinity &&
			slices.Equal(old.Backends, fe.Backends) {
			continue
		}
		if exists {
			fe.ID = old.ID
		}
		fe.Status = reconciler.StatusPending()
		// Cannot fail: apply's open txn locks all three tables (see writer).
		w.frontends.Insert(txn, fe)
	}
	// Frontends the service no longer asks for go, unless another
	// service holds the address. Unchanged, it asks for the same ones.
	// Only their addresses are needed: a deleted service's frontends are
	// not made again to be thrown away.
	if before != nil && before != svc {
		// A set for a service with many frontends, where the search is
		// quadratic (10,000 ports: seconds).
		var wanted map[tables.L4Addr]struct{}
		if len(want) > 64 {
			wanted = make(map[tables.L4Addr]struct{}, len(want))
			for _, fe := range want {
				wanted[fe.Address] = struct{}{}
			}
		}
		for addr := range frontendAddrs(before, w.nodeIPs) {
			if wanted != nil {
				if _, ok := wanted[addr]; ok {
					continue
				}
			} else if slices.ContainsFunc(want, func(w *tables.Frontend) bool { return w.Address == addr }) {
				continue
			}
			if old, _, ok := w.frontends.Get(txn, tables.FrontendAddressIndex.Query(addr)); ok && old.Service == name {
				// Cannot fail: apply's open txn locks all three tables (see writer).
				w.frontends.Delete(txn, old)
				deleted = true
			}
		}
	}

	if found && !slices.Equal(svc.Conflicts, conflicts) {
		svc = svc.Clone()
		svc.Conflicts = conflicts
		// Cannot fail: apply's open txn locks all three tables (see writer).
		w.services.Insert(txn, svc)
	}
	if found && len(svc.Conflicts) > 0 {
		w.conflicted[name] = struct{}{}
	} else {
		delete(w.conflicted, name)
	}
	// Only services with problems, now or before, are reported: the rest
	// have nothing to say and would cost a health key each.
	switch {
	case found && len(svc.Errors)+len(svc.Conflicts) > 0:
		c.problems[name] = append(slices.Clone(svc.Errors), svc.Conflicts...)
	case hadProblems:
		c.problems[name] = nil
	}
	return deleted
}

// serviceBackends returns the backends of the service merged over its
// slices, sorted by address: an address in several slices has the best of
// their states, and that slice's port name.
func (w *writer) serviceBackends(name tables.ServiceName) []sliceBackend {
	recs := w.sliceRecords[name]
	if len(recs) == 1 {
		return recs[0].backends
	}
	var out []sliceBackend
	for _, r := range recs {
		out = append(out, r.backends...)
	}
	return sortBackends(out)
}

// backendsByPort is a service's backends by slice port name, for a
// service with many frontends; nil for one with few (a scan is cheaper).
type backendsByPort map[string][]sliceBackend

// groupByPortMin is the number of frontends times backends from which
// grouping pays: below it, backendsFor scans them all per frontend. A
// Service with 10,000 ports (20,000 frontends, 10,000 slice backends)
// took 10 s scanning, milliseconds grouped.
const groupByPortMin = 4096

func groupByPort(fes []*tables.Frontend, backends []sliceBackend) backendsByPort {
	if len(fes)*len(backends) < groupByPortMin {
		return nil
	}
	g := backendsByPort{}
	for _, b := range backends {
		g[b.portName] = append(g[b.portName], b)
	}
	return g
}

// of returns the backends of the port name: all of them when not grouped
// (backendsFor selects by port name anyway).
func (g backendsByPort) of(portName string, all []sliceBackend) []sliceBackend {
	if g == nil {
		return all
	}
	return g[portName]
}

// backendsFor selects the backends of a frontend: same protocol and address
// family, and the slice port named like the service port, which is how
// Kubernetes resolves (named) target ports. With local set (a Local
// traffic policy) only the backends on the node named nodeName are kept;
// when there are none the frontend has no backend, as in Kubernetes.
func backendsFor(fe *tables.Frontend, backends []sliceBackend, local bool, nodeName string) []tables.FrontendBackend {
	selects := func(b sliceBackend) bool {
		return b.portName == fe.PortName && b.addr.Proto == fe.Address.Proto && b.addr.Addr.Is4() == fe.Address.Addr.Is4() &&
			(!local || b.nodeName == nodeName)
	}
	// Counted first: frontends live long, and an exact slice holds no
	// spare capacity.
	n := 0
	for _, b := range backends {
		if selects(b) {
			n++
		}
	}
	if n == 0 {
		return nil
	}
	out := make([]tables.FrontendBackend, 0, n)
	for _, b := range backends {
		if selects(b) {
			out = append(out, tables.FrontendBackend{Address: b.addr, State: b.state})
		}
	}
	return out
}
