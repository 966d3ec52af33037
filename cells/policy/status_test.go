package policy

import (
	"slices"
	"testing"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// TestVerdictCounter: counts added between writes are summed into the
// policies' status rows; counts of a policy without a row are dropped.
func TestVerdictCounter(t *testing.T) {
	db := statedb.New()
	status, err := tables.NewPolicyStatusTable(db)
	if err != nil {
		t.Fatal(err)
	}
	rows := newStatusRows(db, status)
	rows.policy("cnp/default/web", false)
	if err := rows.sync(nil); err != nil {
		t.Fatal(err)
	}

	v := newVerdictCounter()
	v.Add("cnp/default/web", tables.VerdictCounts{Allowed: 2})
	v.Add("cnp/default/web", tables.VerdictCounts{Denied: 1, Audited: 3})
	v.Add("cnp/default/gone", tables.VerdictCounts{Allowed: 5})
	select {
	case <-v.signal:
	default:
		t.Fatal("Add did not signal the writer")
	}
	writeVerdicts(db, status, v.take())
	v.Add("cnp/default/web", tables.VerdictCounts{Allowed: 1})
	writeVerdicts(db, status, v.take())

	rtxn := db.ReadTxn()
	row, _, _ := status.Get(rtxn, tables.PolicyStatusNameIndex.Query("cnp/default/web"))
	if want := (tables.VerdictCounts{Allowed: 3, Denied: 1, Audited: 3}); row.Verdicts != want {
		t.Errorf("counts %+v, want %+v", row.Verdicts, want)
	}
	if status.NumObjects(rtxn) != 1 {
		t.Errorf("a row was made for a policy that has none")
	}
}

// TestStatusRows: a row per policy, with the engine's warnings; counts
// survive a change of warnings; a policy gone takes its row.
func TestStatusRows(t *testing.T) {
	db := statedb.New()
	status, err := tables.NewPolicyStatusTable(db)
	if err != nil {
		t.Fatal(err)
	}
	rows := newStatusRows(db, status)
	get := func(name string) (*tables.PolicyStatus, bool) {
		r, _, ok := status.Get(db.ReadTxn(), tables.PolicyStatusNameIndex.Query(name))
		return r, ok
	}

	rows.policy("cnp/default/a", false)
	rows.policy("netpol/default/b", false)
	if err := rows.sync(map[string][]string{"cnp/default/a": {"port name http is 80 and 8080"}}); err != nil {
		t.Fatal(err)
	}
	a, ok := get("cnp/default/a")
	if !ok || !slices.Equal(a.Warnings, []string{"port name http is 80 and 8080"}) {
		t.Fatalf("cnp/default/a: %+v %v", a, ok)
	}
	if _, ok := get("netpol/default/b"); !ok {
		t.Fatal("netpol/default/b has no row")
	}

	writeVerdicts(db, status, map[string]tables.VerdictCounts{"cnp/default/a": {Denied: 4}})
	rev := status.Revision(db.ReadTxn())
	if err := rows.sync(map[string][]string{"cnp/default/a": {"port name http is 80 and 8080"}}); err != nil {
		t.Fatal(err)
	}
	if got := status.Revision(db.ReadTxn()); got != rev {
		t.Errorf("nothing changed, yet the table was written (revision %d → %d)", rev, got)
	}
	if err := rows.sync(nil); err != nil {
		t.Fatal(err)
	}
	a, _ = get("cnp/default/a")
	if len(a.Warnings) != 0 || a.Verdicts.Denied != 4 {
		t.Errorf("after its warning went: %+v, want no warnings and the 4 denied kept", a)
	}

	rows.policy("netpol/default/b", true)
	if err := rows.sync(nil); err != nil {
		t.Fatal(err)
	}
	if _, ok := get("netpol/default/b"); ok {
		t.Error("netpol/default/b's row stayed after the policy went")
	}
}
