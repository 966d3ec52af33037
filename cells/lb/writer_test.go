package lb

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// TestWriterBackendInstances checks the backends table against a model
// after random slice changes of services sharing backend addresses, many
// ports per address: each backend's instances are exactly what the slices
// say now, sorted, with the best state, and a backend nothing names is gone.
func TestWriterBackendInstances(t *testing.T) {
	db := statedb.New()
	services, err := tables.NewServicesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	frontends, err := tables.NewFrontendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	backends, err := tables.NewBackendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	w := &writer{services: services, frontends: frontends, backends: backends,
		conflicted: map[tables.ServiceName]struct{}{}, sliceRecords: map[tables.ServiceName][]sliceRecord{}}

	rng := rand.New(rand.NewPCG(1, 2))
	addrs := []tables.L4Addr{}
	for i := range 3 {
		addrs = append(addrs, tables.L4Addr{Addr: netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)}), Port: 8080, Proto: tables.TCP})
	}
	// model: (service, slice) -> what the slice says now.
	type key struct {
		svc   tables.ServiceName
		slice string
	}
	model := map[key][]sliceBackend{}
	for step := range 400 {
		k := key{tables.ServiceName{Namespace: "ns", Name: fmt.Sprintf("s%d", rng.IntN(3))}, fmt.Sprintf("e%d", rng.IntN(2))}
		var bs []sliceBackend
		if rng.IntN(5) > 0 { // else the slice goes
			for _, a := range addrs {
				for p := range 6 {
					if rng.IntN(2) == 0 {
						bs = append(bs, sliceBackend{addr: a, portName: fmt.Sprintf("p%d", p), state: tables.BackendState(rng.IntN(3))})
					}
				}
			}
		}
		rng.Shuffle(len(bs), func(i, j int) { bs[i], bs[j] = bs[j], bs[i] })
		model[k] = sortBackends(slices.Clone(bs))
		txn := db.WriteTxn(services, frontends, backends)
		c := newChange()
		if len(bs) == 0 && rng.IntN(2) == 0 {
			w.deleteSlice(txn, k.svc, k.slice, c)
		} else {
			w.upsertSlice(txn, parsedSlice{service: k.svc, name: k.slice, backends: bs}, c)
		}
		txn.Commit()

		want := map[tables.L4Addr][]tables.BackendInstance{}
		for k, bs := range model {
			for _, b := range bs {
				want[b.addr] = append(want[b.addr], tables.BackendInstance{Service: k.svc, Slice: k.slice, PortName: b.portName, State: b.state})
			}
		}
		rtxn := db.ReadTxn()
		if n := backends.NumObjects(rtxn); n != len(want) {
			t.Fatalf("step %d: %d backends, want %d", step, n, len(want))
		}
		for addr, insts := range want {
			slices.SortFunc(insts, compareInstances)
			be, _, ok := backends.Get(rtxn, tables.BackendAddressIndex.Query(addr))
			if !ok {
				t.Fatalf("step %d: backend %s missing", step, addr)
			}
			if !slices.Equal(be.Services, insts) {
				t.Fatalf("step %d: backend %s has %v, want %v", step, addr, be.Services, insts)
			}
			if len(be.Services) != cap(be.Services) {
				t.Fatalf("step %d: backend %s holds spare capacity (%d of %d)", step, addr, len(be.Services), cap(be.Services))
			}
			state := tables.BackendNotServing
			for _, in := range insts {
				state = min(state, in.State)
			}
			if be.State != state {
				t.Fatalf("step %d: backend %s is %s, want %s", step, addr, be.State, state)
			}
		}
	}
}
