package identity

import (
	"maps"
	"testing"

	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// wantNumbers is a Renumberer whose wanted numbers a test sets.
type wantNumbers struct {
	agentNumbers
	want    map[string]uint32 // labels key -> number
	changed chan struct{}
}

func (w *wantNumbers) SourceOf(id uint32) string {
	if id >= MinTemporary {
		return SourceTemporary
	}
	return SourceCluster
}

func (w *wantNumbers) Assign(l tables.Labels, free func(uint32) bool, hint uint32) (uint32, error) {
	if n, ok := w.want[l.Key()]; ok && free(n) {
		return n, nil
	}
	return w.r.Allocate(free, hint)
}

func (w *wantNumbers) Want(l tables.Labels, cur uint32, free func(uint32) bool) (uint32, error) {
	if n, ok := w.want[l.Key()]; ok && n != cur && free(n) {
		return n, nil
	}
	return cur, nil
}

func (w *wantNumbers) Changed() <-chan struct{} { return w.changed }

func TestRenumber(t *testing.T) {
	db := statedb.New()
	table, err := tables.NewIdentitiesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	w := &wantNumbers{
		agentNumbers: agentNumbers{r: NewNumberRange(tables.ScopeCluster, MinTemporary, MaxTemporary)},
		want:         map[string]uint32{}, changed: make(chan struct{}),
	}
	a, err := NewAllocator(hivetest.Logger(t), db, table, w)
	if err != nil {
		t.Fatal(err)
	}
	if a.RenumberWatch() == nil {
		t.Fatal("RenumberWatch is nil for a Renumberer")
	}
	web, dbl := tables.NewLabels("k8s:app=web"), tables.NewLabels("k8s:app=db")

	wtxn := db.WriteTxn(table)
	idWeb, err := a.AcquireN(wtxn, web, 0, 3)
	if err != nil {
		t.Fatal(err)
	}
	idDB, err := a.Acquire(wtxn, dbl, 0)
	if err != nil {
		t.Fatal(err)
	}
	wtxn.Commit()
	if idWeb.ID != MinTemporary || idWeb.Source != SourceTemporary || idDB.ID != MinTemporary+1 {
		t.Fatalf("acquired %+v and %+v, want the first temporary numbers", idWeb, idDB)
	}

	// web's Identity appears: it moves with its references, its temporary
	// number is freed; db stays.
	w.want[web.Key()] = 300
	wtxn = db.WriteTxn(table)
	moved, err := a.Renumber(wtxn)
	if err != nil {
		t.Fatal(err)
	}
	wtxn.Commit()
	if want := map[uint32]uint32{MinTemporary: 300}; !maps.Equal(moved, want) {
		t.Fatalf("moved %v, want %v", moved, want)
	}
	rtxn := db.ReadTxn()
	row, _, ok := table.Get(rtxn, tables.IdentityLabelsIndex.Query(web.Key()))
	if !ok || row.ID != 300 || row.RefCount != 3 || row.Source != SourceCluster {
		t.Fatalf("web after renumber: %+v", row)
	}
	if _, _, ok := table.Get(rtxn, tables.IdentityIDIndex.Query(MinTemporary)); ok {
		t.Fatal("temporary number still in the table")
	}

	// A chain: db wants 300, which web holds, and web moves to 301 — both
	// settle in one call.
	w.want[dbl.Key()] = 300
	w.want[web.Key()] = 301
	wtxn = db.WriteTxn(table)
	moved, err = a.Renumber(wtxn)
	if err != nil {
		t.Fatal(err)
	}
	wtxn.Commit()
	if want := map[uint32]uint32{300: 301, MinTemporary + 1: 300}; !maps.Equal(moved, want) {
		t.Fatalf("moved %v, want %v", moved, want)
	}

	// Releasing the moved identity by its new number works as before.
	wtxn = db.WriteTxn(table)
	if err := a.ReleaseN(wtxn, 301, 3); err != nil {
		t.Fatal(err)
	}
	wtxn.Commit()
	if _, _, ok := table.Get(db.ReadTxn(), tables.IdentityIDIndex.Query(301)); ok {
		t.Fatal("released identity still there")
	}
}
