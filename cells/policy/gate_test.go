package policy

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/tables"
)

// TestGate: a DNS answer is held while its address's identity is not yet
// selected by the FQDN selector of its labels, while the engine has not
// computed the selectors table's latest state, and while an entry of the
// identity is not in the map (its endpoint's row is not reconciled); it is released once all three hold.
func TestGate(t *testing.T) {
	db := statedb.New()
	ipc, err1 := tables.NewIPCacheTable(db)
	ids, err2 := tables.NewIdentitiesTable(db)
	sels, err3 := tables.NewSelectorsTable(db)
	entries, err4 := tables.NewPolicyEntriesTable(db)
	eps, err5 := tables.NewEndpointPolicyTable(db)
	for _, err := range []error{err1, err2, err3, err4, err5} {
		if err != nil {
			t.Fatal(err)
		}
	}
	const id = 0x01000002
	ip := netip.MustParseAddr("192.0.2.10")
	label := "fqdn:*.example.com"
	g := &gate{db: db, ipcache: ipc, identities: ids, selectors: sels, entries: entries, endpoints: eps, progress: newProgress(), mode: ModeDefault}
	write := func(f func(statedb.WriteTxn)) {
		wtxn := db.WriteTxn(ipc, ids, sels, entries, eps)
		f(wtxn)
		wtxn.Commit()
	}
	entry := &tables.PolicyEntry{Endpoint: "default/web", EndpointID: 1, Identity: id, Direction: tables.DirEgress,
		Protocol: 6, Port: 443, PortBits: 16, Policies: []string{"cnp/default/p"}}
	row := &tables.EndpointPolicy{Name: "default/web", ID: 1, CgroupID: 1001, Ingress: tables.EnforceOff,
		Egress: tables.EnforceDefaultDeny, Status: reconciler.StatusPending()}
	write(func(txn statedb.WriteTxn) {
		ipc.Insert(txn, &tables.IPCacheEntry{Prefix: tables.HostPrefix(ip), Identity: id})
		ids.Insert(txn, &tables.Identity{ID: id, Labels: tables.NewLabels(label, tables.LabelWorld)})
		sels.Insert(txn, &tables.Selector{Selector: label, Identities: []uint32{0x01000001}})
	})

	released := make(chan error, 1)
	go func() { released <- g.Wait(context.Background(), []netip.Addr{ip}) }()
	steps := []struct {
		what string
		do   func()
	}{
		{"the selector selects the identity", func() {
			write(func(txn statedb.WriteTxn) {
				sels.Insert(txn, &tables.Selector{Selector: label, Identities: []uint32{0x01000001, id}})
				entries.Insert(txn, entry)
				eps.Insert(txn, row)
			})
		}},
		{"the engine computed it", func() { g.progress.set(sels.Revision(db.ReadTxn())) }},
	}
	for _, step := range steps {
		if _, why := g.pending(db.ReadTxn(), []netip.Addr{ip}); why == "" {
			t.Fatalf("released before %s", step.what)
		}
		step.do()
	}
	if _, why := g.pending(db.ReadTxn(), []netip.Addr{ip}); why == "" {
		t.Fatal("released before the entry is in the map")
	}
	write(func(txn statedb.WriteTxn) {
		eps.Insert(txn, row.Clone().SetStatus(reconciler.StatusDone()))
	})
	select {
	case err := <-released:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("still held once everything is in place")
	}

	// A deadline that passes first is an error naming what is missing.
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	other := netip.MustParseAddr("192.0.2.11")
	write(func(txn statedb.WriteTxn) {
		ipc.Insert(txn, &tables.IPCacheEntry{Prefix: tables.HostPrefix(other), Identity: id + 1})
		ids.Insert(txn, &tables.Identity{ID: id + 1, Labels: tables.NewLabels(label, "fqdn:other", tables.LabelWorld)})
	})
	if err := g.Wait(ctx, []netip.Addr{other}); err == nil {
		t.Fatal("an identity the selector does not select was released")
	}
}
