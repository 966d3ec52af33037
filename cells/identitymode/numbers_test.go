package identitymode

import (
	"errors"
	"testing"

	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/tables"
)

func TestOperatorNumbers(t *testing.T) {
	web := tables.NewLabels("k8s:app=web")
	db := tables.NewLabels("k8s:app=db")
	used := map[uint32]bool{}
	free := func(n uint32) bool { return !used[n] }
	o := NewOperatorNumbers(2)

	// Before the Identities are listed, a cluster number the old map had
	// is trusted; anything else gets a temporary number.
	if n, err := o.Assign(web, free, 700); err != nil || n != 700 {
		t.Fatalf("Assign before sync with hint = %d, %v; want the hint", n, err)
	}
	if n, err := o.Assign(db, free, 0); err != nil || n != identity.MinTemporary {
		t.Fatalf("Assign before sync = %d, %v; want the first temporary number", n, err)
	}
	used[identity.MinTemporary] = true
	if got, _ := o.Want(web, 700, free); got != 700 {
		t.Fatalf("Want before sync moved 700 to %d", got)
	}

	ch := o.Changed()
	o.Set(300, db)
	o.Set(301, db) // a duplicate
	o.Synced()
	select {
	case <-ch:
	default:
		t.Fatal("Changed not closed by Set")
	}
	// The lowest free Identity of the set; a cluster number without an
	// Identity goes temporary once synced.
	if got, _ := o.Want(db, identity.MinTemporary, free); got != 300 {
		t.Fatalf("Want(db) = %d, want 300", got)
	}
	used[300] = true
	if got, _ := o.Want(db, identity.MinTemporary, free); got != 301 {
		t.Fatalf("Want(db) with 300 taken = %d, want 301", got)
	}
	if got, _ := o.Want(db, 300, free); got != 300 {
		t.Fatalf("Want(db, 300) = %d, want it kept", got)
	}
	if got, _ := o.Want(web, 700, free); got != identity.MinTemporary+1 {
		t.Fatalf("Want(web, 700) after sync = %d, want a temporary number", got)
	}
	used[identity.MinTemporary+1] = true

	// Exhaustion names the range; a freed number is handed out again.
	_, err := o.Assign(tables.NewLabels("k8s:app=x"), free, 0)
	var ex *identity.ExhaustedError
	if !errors.As(err, &ex) || ex.Error() != "temporary identity space exhausted: every number in 0x1010000–0x1010001 is in use" {
		t.Fatalf("Assign with no temporary number left: %v", err)
	}
	used[identity.MinTemporary] = false
	o.Freed(identity.MinTemporary)
	if n, err := o.Assign(tables.NewLabels("k8s:app=x"), free, 0); err != nil || n != identity.MinTemporary {
		t.Fatalf("Assign after Freed = %d, %v", n, err)
	}

	// Sources and ranges.
	for _, tc := range []struct {
		id       uint32
		source   string
		contains bool
	}{
		{300, identity.SourceCluster, true}, {identity.MinTemporary, identity.SourceTemporary, true},
		{identity.MaxTemporary, identity.SourceTemporary, true}, {identity.MinLocal, identity.SourceCluster, false},
	} {
		if o.SourceOf(tc.id) != tc.source || o.Contains(tc.id) != tc.contains {
			t.Errorf("id %#x: source %s contains %v", tc.id, o.SourceOf(tc.id), o.Contains(tc.id))
		}
	}

	// Removing an Identity forgets it.
	o.Remove(300)
	o.Remove(301)
	if o.Len() != 0 {
		t.Fatalf("Len = %d after removing all", o.Len())
	}
}
