package selectors

import (
	"testing"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// TestVerdictCounter: counts added between writes are summed into the
// policies' rows; counts of a policy without a row are dropped.
func TestVerdictCounter(t *testing.T) {
	db := statedb.New()
	policies, err := tables.NewPoliciesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	wtxn := db.WriteTxn(policies)
	policies.Insert(wtxn, &tables.Policy{Name: "cnp/default/web", Status: tables.PolicyOK})
	wtxn.Commit()

	v := newVerdictCounter()
	v.Add("cnp/default/web", tables.VerdictCounts{Allowed: 2})
	v.Add("cnp/default/web", tables.VerdictCounts{Denied: 1, Audited: 3})
	v.Add("cnp/default/gone", tables.VerdictCounts{Allowed: 5})
	select {
	case <-v.signal:
	default:
		t.Fatal("Add did not signal the writer")
	}
	writeVerdicts(db, policies, v.take())
	v.Add("cnp/default/web", tables.VerdictCounts{Allowed: 1})
	writeVerdicts(db, policies, v.take())

	rtxn := db.ReadTxn()
	row, _, _ := policies.Get(rtxn, tables.PolicyNameIndex.Query("cnp/default/web"))
	if want := (tables.VerdictCounts{Allowed: 3, Denied: 1, Audited: 3}); row.Verdicts != want {
		t.Errorf("counts %+v, want %+v", row.Verdicts, want)
	}
	if policies.NumObjects(rtxn) != 1 {
		t.Errorf("a row was made for a policy that has none")
	}
}
