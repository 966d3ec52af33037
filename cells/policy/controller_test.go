package policy

import (
	"testing"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/tables"
)

// TestWriterMarksPendingRowsAnew: an endpoint whose entries change while
// its row is pending gets a new pending status. The reconciler may be
// applying the row with the entries from before; when it commits, it
// marks the row done if the row is unchanged or still carries the pending
// status it applied. Left as it was, the row was marked done and the
// pod's map never got the new entries (issue 35: a trusted answer after a
// restart left the asking pod denied).
func TestWriterMarksPendingRowsAnew(t *testing.T) {
	db := statedb.New()
	entries, err := tables.NewPolicyEntriesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	endpoints, err := tables.NewEndpointPolicyTable(db)
	if err != nil {
		t.Fatal(err)
	}
	w := &writer{c: &controller{controllerParams: controllerParams{DB: db, Entries: entries, EndpointPolicy: endpoints}}}

	for _, tc := range []struct {
		name   string
		status reconciler.Status
	}{
		{"done", reconciler.StatusDone()},
		{"pending", reconciler.StatusPending()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wtxn := db.WriteTxn(endpoints)
			row := &tables.EndpointPolicy{Name: "default/" + tc.name, ID: 1, Status: tc.status}
			if _, _, err := endpoints.Insert(wtxn, row); err != nil {
				t.Fatal(err)
			}
			wtxn.Commit()
			_, applied, _ := endpoints.Get(db.ReadTxn(), tables.EndpointPolicyNameIndex.Query(row.Name))

			w.upsertEntry(&tables.PolicyEntry{Endpoint: row.Name, EndpointID: 1, Identity: 16777220, Direction: tables.DirEgress, Protocol: 6, Port: 8080, PortBits: 16})
			if err := w.commit(); err != nil {
				t.Fatal(err)
			}

			got, rev, found := endpoints.Get(db.ReadTxn(), tables.EndpointPolicyNameIndex.Query(row.Name))
			if !found {
				t.Fatal("row gone")
			}
			if got.Status.Kind != reconciler.StatusKindPending || got.Status.ID == tc.status.ID || rev == applied {
				t.Errorf("after its entries changed: status %s (ID %d, was %d), revision %d (was %d); want pending with a new ID at a new revision",
					got.Status.Kind, got.Status.ID, tc.status.ID, rev, applied)
			}
		})
	}
}
