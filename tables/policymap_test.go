package tables

import (
	"slices"
	"testing"

	"github.com/cilium/statedb"
)

func TestPolicyEntryKey(t *testing.T) {
	for _, tc := range []struct {
		proto uint8
		port  uint16
		bits  uint8
		want  string
	}{
		{0, 0, 0, "ANY"},
		{6, 0, 0, "TCP"},
		{17, 53, 16, "UDP/53"},
		{6, 80, 12, "TCP/80-95"},
		{132, 0, 1, "SCTP/0-32767"},
		{99, 7, 16, "proto-99/7"},
	} {
		if got := PortPrefixString(tc.proto, tc.port, tc.bits); got != tc.want {
			t.Errorf("PortPrefixString(%d, %d, %d) = %q, want %q", tc.proto, tc.port, tc.bits, got, tc.want)
		}
		e := &PolicyEntry{Endpoint: "ns/pod", Identity: 4294967295, Direction: DirEgress, Protocol: tc.proto, Port: tc.port, PortBits: tc.bits}
		if got, want := e.Key(), "ns/pod|4294967295|egress|"+tc.want; got != want {
			t.Errorf("Key() = %q, want %q", got, want)
		}
	}
}

func TestPolicyEntriesOf(t *testing.T) {
	db := statedb.New()
	tbl, err := NewPolicyEntriesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	wtxn := db.WriteTxn(tbl)
	for _, ep := range []string{"ns/pod", "ns/pod2", "ns/po", "ns2/pod"} {
		for id := range uint32(3) {
			if _, _, err := tbl.Insert(wtxn, &PolicyEntry{Endpoint: ep, Identity: id, Direction: DirIngress}); err != nil {
				t.Fatal(err)
			}
		}
	}
	txn := wtxn.Commit()
	var got []string
	for e := range PolicyEntriesOf(txn, tbl, "ns/pod") {
		got = append(got, e.Key())
	}
	want := []string{"ns/pod|0|ingress|ANY", "ns/pod|1|ingress|ANY", "ns/pod|2|ingress|ANY"}
	if !slices.Equal(got, want) {
		t.Fatalf("entries of ns/pod: %q, want %q", got, want)
	}
}

// TestPolicyEntryIdentityIndex: the entries of node-local identities are
// found by identity; those of pod and reserved identities are not indexed.
func TestPolicyEntryIdentityIndex(t *testing.T) {
	db := statedb.New()
	tbl, err := NewPolicyEntriesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	ids := []uint32{2, 300, MinLocalIdentity, MaxLocalIdentity, MaxLocalIdentity + 1}
	wtxn := db.WriteTxn(tbl)
	for _, id := range ids {
		for _, ep := range []string{"ns/a", "ns/b"} {
			if _, _, err := tbl.Insert(wtxn, &PolicyEntry{Endpoint: ep, Identity: id, Direction: DirEgress}); err != nil {
				t.Fatal(err)
			}
		}
	}
	txn := wtxn.Commit()
	for _, id := range ids {
		want := 0
		if id >= MinLocalIdentity && id <= MaxLocalIdentity {
			want = 2
		}
		got := 0
		for e := range tbl.List(txn, PolicyEntryIdentityIndex.Query(id)) {
			if e.Identity != id {
				t.Errorf("identity %d: found an entry of %d", id, e.Identity)
			}
			got++
		}
		if got != want {
			t.Errorf("identity %d: %d entries by index, want %d", id, got, want)
		}
	}
	if n := tbl.NumObjects(txn); n != 2*len(ids) {
		t.Errorf("%d rows, want %d", n, 2*len(ids))
	}
}
