package reconcilers_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/memmap"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// policyMaxFlag is the flag the operations name when the policy map is
// full (the policy cell passes its own, the same).
const policyMaxFlag = "bpf-policy-map-max"

// testMaps is where a test's maps are pinned: in a fresh bpffs directory
// (the kernel's maps) when the test runs as root, else in memory
// (bpf/memmap), where the reconcilers behave the same; APIARY_TEST_MAPS=
// memory puts them in memory under root too.
type testMaps struct {
	dir  string
	pins *memmap.Pins // nil: the kernel's
}

func newTestMaps(t testing.TB) testMaps {
	t.Helper()
	if os.Geteuid() != 0 || os.Getenv("APIARY_TEST_MAPS") == "memory" {
		return testMaps{dir: "/test", pins: memmap.NewPins(nil)}
	}
	return kernelTestMaps(t)
}

// kernelTestMaps are the kernel's maps, for what only they do (an LPM
// trie's longest-prefix match).
func kernelTestMaps(t testing.TB) testMaps {
	t.Helper()
	return testMaps{dir: testenv.BPFPinDir(t)}
}

func (m testMaps) opener() bpf.Opener {
	if m.pins != nil {
		return m.pins
	}
	return bpf.KernelMaps
}

// raw returns a handle of the test's own on the map called name.
func (m testMaps) raw(t testing.TB, name string) bpf.Map {
	t.Helper()
	path := filepath.Join(m.dir, name)
	if m.pins != nil {
		pm := m.pins.Get(path)
		if pm == nil {
			t.Fatalf("no map pinned at %s", path)
		}
		return pm
	}
	km, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { km.Close() })
	return km
}

// policyFixture is a real statedb.DB holding the policy-entries and
// endpoint-policy tables, and the policy operations on maps pinned in a
// fresh directory (testMaps).
type policyFixture struct {
	testMaps
	db        *statedb.DB
	entries   statedb.RWTable[*tables.PolicyEntry]
	endpoints statedb.RWTable[*tables.EndpointPolicy]
	ops       *reconcilers.Policy
}

// newPolicyFixture opens empty maps, the policy map with room for
// maxEntries entries.
func newPolicyFixture(t testing.TB, maxEntries uint32) *policyFixture {
	t.Helper()
	return newPolicyFixtureOn(t, newTestMaps(t), maxEntries)
}

func newPolicyFixtureOn(t testing.TB, where testMaps, maxEntries uint32) *policyFixture {
	t.Helper()
	f := &policyFixture{testMaps: where, db: statedb.New()}
	var err error
	if f.entries, err = tables.NewPolicyEntriesTable(f.db); err != nil {
		t.Fatal(err)
	}
	if f.endpoints, err = tables.NewEndpointPolicyTable(f.db); err != nil {
		t.Fatal(err)
	}
	if restored := f.open(t, maxEntries); len(restored) != 0 {
		t.Fatalf("fresh maps restored %v", restored)
	}
	t.Cleanup(func() { f.ops.Close() })
	return f
}

// open opens the pinned maps with new operations (as a restarted agent
// does), closing the previous ones, and returns what Open restored.
func (f *policyFixture) open(t testing.TB, maxEntries uint32) map[uint64]uint32 {
	t.Helper()
	if f.ops != nil {
		if err := f.ops.Close(); err != nil {
			t.Fatal(err)
		}
	}
	f.ops = reconcilers.NewPolicy(nil, policyMaxFlag)
	restored, err := f.ops.OpenWith(f.opener(), f.dir, maxEntries, 1024)
	if err != nil {
		t.Fatalf("open the policy maps in %s: %v", f.dir, err)
	}
	return restored
}

// insert puts rows (*tables.PolicyEntry or *tables.EndpointPolicy) into
// their tables, pending, as the policy controller does.
func (f *policyFixture) insert(t testing.TB, rows ...any) {
	t.Helper()
	wtxn := f.db.WriteTxn(f.entries, f.endpoints)
	defer wtxn.Abort()
	for _, row := range rows {
		var err error
		switch r := row.(type) {
		case *tables.PolicyEntry:
			_, _, err = f.entries.Insert(wtxn, r)
		case *tables.EndpointPolicy:
			r.Status = reconciler.StatusPending()
			_, _, err = f.endpoints.Insert(wtxn, r)
		default:
			t.Fatalf("insert %T", row)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	wtxn.Commit()
}

// remove deletes rows from their tables.
func (f *policyFixture) remove(t testing.TB, rows ...any) {
	t.Helper()
	wtxn := f.db.WriteTxn(f.entries, f.endpoints)
	defer wtxn.Abort()
	for _, row := range rows {
		var err error
		switch r := row.(type) {
		case *tables.PolicyEntry:
			_, _, err = f.entries.Delete(wtxn, r)
		case *tables.EndpointPolicy:
			_, _, err = f.endpoints.Delete(wtxn, r)
		default:
			t.Fatalf("remove %T", row)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	wtxn.Commit()
}

// updateEndpoint runs Update on the row name, as the reconciler does, and
// records the outcome in the row's status.
func (f *policyFixture) updateEndpoint(t testing.TB, name string) error {
	t.Helper()
	txn := f.db.ReadTxn()
	row, rev, found := f.endpoints.Get(txn, tables.EndpointPolicyNameIndex.Query(name))
	if !found {
		t.Fatalf("no endpoint-policy row %s", name)
	}
	err := f.ops.Ops(f.entries).Update(context.Background(), txn, rev, row)
	status := reconciler.StatusDone()
	if err != nil {
		status = reconciler.StatusError(err)
	}
	wtxn := f.db.WriteTxn(f.endpoints)
	f.endpoints.Insert(wtxn, row.Clone().SetStatus(status))
	wtxn.Commit()
	return err
}

// prune runs Prune with what the tables hold.
func (f *policyFixture) prune(t testing.TB) {
	t.Helper()
	txn := f.db.ReadTxn()
	if err := f.ops.Ops(f.entries).Prune(context.Background(), txn, f.endpoints.All(txn)); err != nil {
		t.Fatal(err)
	}
}

// policyMap reads the pinned policy map as the kernel has it.
func (f *policyFixture) policyMap(t *testing.T) map[bpf.PolicyKey]bpf.PolicyValue {
	t.Helper()
	return readPinned[bpf.PolicyKey, bpf.PolicyValue](t, f.raw(t, bpf.PolicyMap))
}

// endpointsMap reads the pinned policy_endpoints map.
func (f *policyFixture) endpointsMap(t *testing.T) map[uint64]bpf.PolicyEndpointValue {
	t.Helper()
	return readPinned[uint64, bpf.PolicyEndpointValue](t, f.raw(t, bpf.PolicyEndpointsMap))
}

// endpointsGen reads the pinned policy_endpoints_gen counter.
func (f *policyFixture) endpointsGen(t *testing.T) uint64 {
	t.Helper()
	return readPinned[uint32, uint64](t, f.raw(t, bpf.PolicyEndpointsGenMap))[0]
}

func readPinned[K comparable, V any](t *testing.T, m bpf.Map) map[K]V {
	t.Helper()
	out := map[K]V{}
	err := bpf.Walk(m, 64, func(keys []K, values []V) error {
		for i, k := range keys {
			out[k] = values[i]
		}
		return nil
	})
	if err != nil {
		t.Fatalf("read %s: %v", m, err)
	}
	return out
}

// polEntry is an allow entry of endpoint (named "default/ep<id>") towards
// identity on TCP/port.
func polEntry(endpointID, identity uint32, dir string, port uint16) *tables.PolicyEntry {
	return &tables.PolicyEntry{
		Endpoint: fmt.Sprintf("default/ep%d", endpointID), EndpointID: endpointID, Identity: identity,
		Direction: dir, Protocol: unix.IPPROTO_TCP, Port: port, PortBits: 16, Policies: []string{"cnp/default/p"},
	}
}

// polEndpoint is the endpoint-policy row of "default/ep<id>".
func polEndpoint(id uint32, cgroupID uint64, ingress, egress string) *tables.EndpointPolicy {
	return &tables.EndpointPolicy{
		Name: fmt.Sprintf("default/ep%d", id), ID: id, Cgroup: fmt.Sprintf("kubepods/pod%d", id), CgroupID: cgroupID,
		Ingress: ingress, Egress: egress, Policies: []string{"cnp/default/p"},
	}
}

// policyLookup is a lookup as the datapath makes it: every key bit given.
type policyLookup struct {
	egress   bool
	protocol uint8
	port     uint16
}

func (l policyLookup) String() string {
	dir := "ingress"
	if l.egress {
		dir = "egress"
	}
	return fmt.Sprintf("%s %s", dir, tables.PortPrefixString(l.protocol, l.port, 16))
}

// TestPolicyEntryKeys writes entries of every shape and reads them back
// from the map: the key's prefix length covers endpoint, identity and
// direction (72 bits), then the protocol (8) unless it is any, then the
// port's prefix bits; the value repeats the protocol and port bits and
// carries the deny flag. Lookups with full keys, as the datapath's,
// match what the entry covers and nothing else.
func TestPolicyEntryKeys(t *testing.T) {
	const (
		tcp, udp = unix.IPPROTO_TCP, unix.IPPROTO_UDP
		cidrID   = 0x01000001 // a local identity: every byte of the key's identity matters
	)
	tests := []struct {
		name  string
		entry tables.PolicyEntry // EndpointID is the case's number
		key   bpf.PolicyKey      // EndpointID is the case's number
		value bpf.PolicyValue
		hits  []policyLookup
		miss  []policyLookup
	}{{
		name:  "any protocol",
		entry: tables.PolicyEntry{Identity: 256, Direction: tables.DirEgress},
		key:   bpf.PolicyKey{PrefixLen: 72, Identity: 256, Egress: bpf.PolicyEgress},
		value: bpf.PolicyValue{PortPrefixLen: 0},
		hits:  []policyLookup{{true, tcp, 443}, {true, udp, 53}, {true, unix.IPPROTO_SCTP, 1}},
		miss:  []policyLookup{{false, tcp, 443}},
	}, {
		name:  "any identity, every TCP port",
		entry: tables.PolicyEntry{Identity: 0, Direction: tables.DirIngress, Protocol: tcp},
		key:   bpf.PolicyKey{PrefixLen: 80, Identity: 0, Egress: bpf.PolicyIngress, Protocol: tcp},
		value: bpf.PolicyValue{PortPrefixLen: 8},
		hits:  []policyLookup{{false, tcp, 1}, {false, tcp, 65535}},
		miss:  []policyLookup{{false, udp, 80}, {true, tcp, 80}},
	}, {
		name:  "one port",
		entry: tables.PolicyEntry{Identity: cidrID, Direction: tables.DirEgress, Protocol: tcp, Port: 443, PortBits: 16},
		key:   bpf.PolicyKey{PrefixLen: 96, Identity: cidrID, Egress: bpf.PolicyEgress, Protocol: tcp, Port: bpf.NewBe16(443)},
		value: bpf.PolicyValue{PortPrefixLen: 24},
		hits:  []policyLookup{{true, tcp, 443}},
		miss:  []policyLookup{{true, tcp, 442}, {true, tcp, 444}, {true, udp, 443}},
	}, {
		name:  "port prefix 8000-8063",
		entry: tables.PolicyEntry{Identity: 256, Direction: tables.DirIngress, Protocol: tcp, Port: 8000, PortBits: 10},
		key:   bpf.PolicyKey{PrefixLen: 90, Identity: 256, Egress: bpf.PolicyIngress, Protocol: tcp, Port: bpf.NewBe16(8000)},
		value: bpf.PolicyValue{PortPrefixLen: 18},
		hits:  []policyLookup{{false, tcp, 8000}, {false, tcp, 8031}, {false, tcp, 8063}},
		miss:  []policyLookup{{false, tcp, 7999}, {false, tcp, 8064}},
	}, {
		name:  "port prefix: the bits past it are cleared",
		entry: tables.PolicyEntry{Identity: 256, Direction: tables.DirEgress, Protocol: udp, Port: 1029, PortBits: 14},
		key:   bpf.PolicyKey{PrefixLen: 94, Identity: 256, Egress: bpf.PolicyEgress, Protocol: udp, Port: bpf.NewBe16(1028)},
		value: bpf.PolicyValue{PortPrefixLen: 22},
		hits:  []policyLookup{{true, udp, 1028}, {true, udp, 1031}},
		miss:  []policyLookup{{true, udp, 1027}, {true, udp, 1032}},
	}, {
		name:  "deny",
		entry: tables.PolicyEntry{Identity: 2, Direction: tables.DirEgress, Protocol: udp, Port: 53, PortBits: 16, Deny: true},
		key:   bpf.PolicyKey{PrefixLen: 96, Identity: 2, Egress: bpf.PolicyEgress, Protocol: udp, Port: bpf.NewBe16(53)},
		value: bpf.PolicyValue{Flags: bpf.PolicyFlagDeny, PortPrefixLen: 24},
		hits:  []policyLookup{{true, udp, 53}},
		miss:  []policyLookup{{true, tcp, 53}, {false, udp, 53}},
	}, {
		name:  "deny of every port of any identity",
		entry: tables.PolicyEntry{Identity: 0, Direction: tables.DirIngress, Deny: true},
		key:   bpf.PolicyKey{PrefixLen: 72, Identity: 0, Egress: bpf.PolicyIngress},
		value: bpf.PolicyValue{Flags: bpf.PolicyFlagDeny},
		hits:  []policyLookup{{false, tcp, 22}, {false, udp, 22}},
		miss:  []policyLookup{{true, tcp, 22}},
	}}

	// The lookups are the LPM trie's longest-prefix match: the kernel's.
	f := newPolicyFixtureOn(t, kernelTestMaps(t), 1024)
	want := map[bpf.PolicyKey]bpf.PolicyValue{}
	for i, tc := range tests {
		// One endpoint per case, so that lookups see that case's entry
		// only.
		e := tc.entry
		e.EndpointID = uint32(i + 1)
		e.Endpoint = fmt.Sprintf("default/ep%d", e.EndpointID)
		// A row without a cgroup: the entries only.
		f.insert(t, &e, polEndpoint(e.EndpointID, 0, tables.EnforceOff, tables.EnforceOff))
		if err := f.updateEndpoint(t, e.Endpoint); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		k := tc.key
		k.EndpointID = e.EndpointID
		// The key as the rest of the agent computes it.
		if nk := bpf.NewPolicyKey(e.EndpointID, e.Identity, k.Egress, e.Protocol, e.Port, int(e.PortBits)); nk != k {
			t.Errorf("%s: NewPolicyKey gives %+v, want %+v", tc.name, nk, k)
		}
		want[k] = tc.value
	}
	if got := f.policyMap(t); !maps.Equal(got, want) {
		t.Fatalf("the map holds\n%v\nwant\n%v", got, want)
	}
	if u, d := f.ops.Writes(); u != uint64(len(tests)) || d != 0 {
		t.Errorf("%d writes, %d deletes; want %d, 0", u, d, len(tests))
	}

	m := f.raw(t, bpf.PolicyMap)
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			lookup := func(l policyLookup) (bpf.PolicyValue, error) {
				dir := bpf.PolicyIngress
				if l.egress {
					dir = bpf.PolicyEgress
				}
				var v bpf.PolicyValue
				err := m.Lookup(bpf.NewPolicyKey(uint32(i+1), tc.key.Identity, dir, l.protocol, l.port, 16), &v)
				return v, err
			}
			for _, l := range tc.hits {
				if v, err := lookup(l); err != nil || v != tc.value {
					t.Errorf("lookup %s: %+v, %v; want %+v", l, v, err, tc.value)
				}
			}
			for _, l := range tc.miss {
				if v, err := lookup(l); !errors.Is(err, ebpf.ErrKeyNotExist) {
					t.Errorf("lookup %s matched %+v (%v); want no entry", l, v, err)
				}
			}
		})
	}
}

// TestPolicyRestart closes the operations and opens the maps again, as a
// restarted agent does: Open returns the endpoint IDs by cgroup, the same
// rows applied again write nothing (also after the map was resized), and
// Prune removes what the tables no longer hold.
func TestPolicyRestart(t *testing.T) {
	f := newPolicyFixture(t, 1024)
	web := polEndpoint(1, 1001, tables.EnforceDefaultDeny, tables.EnforceDefaultDeny)
	db := polEndpoint(2, 1002, tables.EnforceDefaultDeny, tables.EnforceOff)
	webEntries := []*tables.PolicyEntry{
		polEntry(1, 256, tables.DirEgress, 5432), polEntry(1, 257, tables.DirIngress, 8080), polEntry(1, 0, tables.DirEgress, 53),
	}
	dbEntries := []*tables.PolicyEntry{polEntry(2, 256, tables.DirIngress, 5432), polEntry(2, 258, tables.DirIngress, 5432)}
	rows := []any{web, db}
	for _, e := range slices.Concat(webEntries, dbEntries) {
		rows = append(rows, e)
	}
	f.insert(t, rows...)

	apply := func() {
		t.Helper()
		for _, name := range []string{web.Name, db.Name} {
			if err := f.updateEndpoint(t, name); err != nil {
				t.Fatal(err)
			}
		}
	}
	apply()
	if u, d := f.ops.Writes(); u != 7 || d != 0 {
		t.Fatalf("first run: %d writes, %d deletes; want 5 entries and 2 cgroups written", u, d)
	}
	wantCgroups := map[uint64]bpf.PolicyEndpointValue{
		1001: {EndpointID: 1, Flags: bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress},
		1002: {EndpointID: 2, Flags: bpf.PolicyEnforceIngress},
	}
	if got := f.endpointsMap(t); !maps.Equal(got, wantCgroups) {
		t.Fatalf("policy_endpoints %v, want %v", got, wantCgroups)
	}

	for _, size := range []uint32{1024, 2048} { // the same size, then a resize
		restored := f.open(t, size)
		if want := map[uint64]uint32{1001: 1, 1002: 2}; !maps.Equal(restored, want) {
			t.Fatalf("size %d: restored %v, want %v", size, restored, want)
		}
		if n := f.ops.Entries(); n != 5 {
			t.Errorf("size %d: %d entries read, want 5", size, n)
		}
		apply()
		f.prune(t)
		if u, d := f.ops.Writes(); u != 0 || d != 0 {
			t.Errorf("size %d: %d writes, %d deletes for rows the maps held", size, u, d)
		}
	}

	// An entry and an endpoint the tables lost while the agent was down
	// (the new run's rows lack them) go at the first prune.
	gone := webEntries[1]
	goneKey, _ := reconcilers.PolicyKeyOf(gone)
	f.open(t, 2048)
	f.remove(t, gone, db, dbEntries[0], dbEntries[1])
	f.prune(t)
	got := f.policyMap(t)
	if _, ok := got[goneKey]; ok {
		t.Errorf("pruned entry %s is still in the map", goneKey)
	}
	for _, e := range dbEntries {
		k, _ := reconcilers.PolicyKeyOf(e)
		if _, ok := got[k]; ok {
			t.Errorf("pruned entry %s is still in the map", k)
		}
	}
	if len(got) != 2 {
		t.Errorf("%d entries after the prune, want 2: %v", len(got), got)
	}
	delete(wantCgroups, 1002)
	if got := f.endpointsMap(t); !maps.Equal(got, wantCgroups) {
		t.Errorf("after the prune policy_endpoints is %v, want %v", got, wantCgroups)
	}
	if u, d := f.ops.Writes(); u != 0 || d != 4 {
		t.Errorf("prune: %d writes, %d deletes; want 0, 4", u, d)
	}
}

// TestPolicyMapFull fills a policy map of the smallest size (256) with 300
// entries: an endpoint whose entries do not all fit fails closed (issue 35
// item 8): its policy_endpoints entry is written all the same, so that its
// default deny is enforced, with the allows that fit, and an error names
// it, the full map, the flag that sizes it and what it lacks; once room is
// made it gets the rest.
func TestPolicyMapFull(t *testing.T) {
	const size = 256
	f := newPolicyFixture(t, size)
	fits := polEndpoint(1, 2001, tables.EnforceOff, tables.EnforceDefaultDeny)
	overflows := polEndpoint(2, 2002, tables.EnforceOff, tables.EnforceDefaultDeny)
	var fitsEntries, overflowsEntries []*tables.PolicyEntry
	rows := []any{fits, overflows}
	for i := range 200 {
		e := polEntry(1, uint32(1000+i), tables.DirEgress, 443)
		fitsEntries = append(fitsEntries, e)
		rows = append(rows, e)
	}
	for i := range 100 {
		e := polEntry(2, uint32(1000+i), tables.DirEgress, 443)
		overflowsEntries = append(overflowsEntries, e)
		rows = append(rows, e)
	}
	f.insert(t, rows...)

	if err := f.updateEndpoint(t, fits.Name); err != nil {
		t.Fatalf("endpoint %s: %v", fits.Name, err)
	}
	err := f.updateEndpoint(t, overflows.Name)
	for _, want := range []string{"endpoint " + overflows.Name + " fails closed", fmt.Sprintf("policy map is full (%d entries)", size),
		"--" + policyMaxFlag, "egress lacks 44 allows"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("endpoint %s: %v; want an error saying %q", overflows.Name, err, want)
		}
	}
	if n := len(f.policyMap(t)); n != size {
		t.Fatalf("%d entries in the map, want %d", n, size)
	}
	wantCgroups := map[uint64]bpf.PolicyEndpointValue{
		2001: {EndpointID: 1, Flags: bpf.PolicyEnforceEgress},
		2002: {EndpointID: 2, Flags: bpf.PolicyEnforceEgress},
	}
	if got := f.endpointsMap(t); !maps.Equal(got, wantCgroups) {
		t.Fatalf("policy_endpoints %v, want %v", got, wantCgroups)
	}

	// Room is made (the first endpoint loses 50 entries): the second
	// one's entries go in, and its error goes.
	var dropped []any
	for _, e := range fitsEntries[150:] {
		dropped = append(dropped, e)
	}
	f.remove(t, dropped...)
	if err := f.updateEndpoint(t, fits.Name); err != nil {
		t.Fatal(err)
	}
	if err := f.updateEndpoint(t, overflows.Name); err != nil {
		t.Fatalf("endpoint %s once there is room: %v", overflows.Name, err)
	}
	if got := f.endpointsMap(t); !maps.Equal(got, wantCgroups) {
		t.Fatalf("policy_endpoints %v, want %v", got, wantCgroups)
	}
	got := f.policyMap(t)
	for _, e := range slices.Concat(fitsEntries[:150], overflowsEntries) {
		if k, _ := reconcilers.PolicyKeyOf(e); !mapHas(got, k) {
			t.Errorf("entry %s of a switched-on endpoint is not in the map", k)
		}
	}
	if len(got) != 250 {
		t.Errorf("%d entries in the map, want 250", len(got))
	}
}

// TestPolicyMapFullNoDenyLost: when a deny of an endpoint does not fit, no
// allow of its direction stays in the map (a missing deny must never let a
// broader allow through): the direction denies everything, the other
// direction keeps its allows, and the error says so. A new default deny
// (an endpoint with only an allow of the host) is switched on although its
// one entry does not fit.
func TestPolicyMapFullNoDenyLost(t *testing.T) {
	const size = 256
	f := newPolicyFixture(t, size)
	filler := polEndpoint(1, 2001, tables.EnforceOff, tables.EnforceDefaultDeny)
	ep := polEndpoint(2, 2002, tables.EnforceDefaultDeny, tables.EnforceDefaultDeny)
	rows := []any{filler, ep}
	for i := range 250 {
		rows = append(rows, polEntry(1, uint32(1000+i), tables.DirEgress, 443))
	}
	// ep: egress allows any peer on TCP (a broad allow) and denies
	// identity 7 on 443 within it; ingress allows identity 9 on 80.
	allowAll := polEntry(2, 0, tables.DirEgress, 0)
	allowAll.PortBits = 0
	egressAllows := []*tables.PolicyEntry{allowAll}
	for i := range 10 {
		egressAllows = append(egressAllows, polEntry(2, uint32(100+i), tables.DirEgress, 8080))
	}
	ingressAllow := polEntry(2, 9, tables.DirIngress, 80)
	rows = append(rows, ingressAllow)
	for _, e := range egressAllows {
		rows = append(rows, e)
	}
	// The allows of ep are in the map before the map fills up.
	f.insert(t, rows[1:2]...)
	f.insert(t, rows[252:]...)
	if err := f.updateEndpoint(t, ep.Name); err != nil {
		t.Fatal(err)
	}
	f.insert(t, rows[0])
	f.insert(t, rows[2:252]...)
	if err := f.updateEndpoint(t, filler.Name); err == nil {
		t.Fatal("the filler fits; the test needs it not to")
	}
	// Now ep gains denies that do not fit.
	var denies []any
	for i := range 20 {
		d := polEntry(2, uint32(7+i*1000), tables.DirEgress, 443)
		d.Deny = true
		denies = append(denies, d)
	}
	f.insert(t, denies...)
	err := f.updateEndpoint(t, ep.Name)
	if err == nil || !strings.Contains(err.Error(), "fails closed") || !strings.Contains(err.Error(), "egress denies everything") {
		t.Fatalf("endpoint %s: %v; want it failing closed, its egress denying everything", ep.Name, err)
	}
	got := f.policyMap(t)
	for k, v := range got {
		if k.EndpointID == 2 && k.Egress == bpf.PolicyEgress && v.Flags&bpf.PolicyFlagDeny == 0 {
			t.Errorf("egress allow %s of %s stays while one of its denies is missing", k, ep.Name)
		}
	}
	if k, _ := reconcilers.PolicyKeyOf(ingressAllow); !mapHas(got, k) {
		t.Errorf("ingress allow %s went; its direction lost no deny", k)
	}
	want := bpf.PolicyEndpointValue{EndpointID: 2, Flags: bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress}
	if v := f.endpointsMap(t)[2002]; v != want {
		t.Errorf("policy_endpoints of %s is %v, want %v", ep.Name, v, want)
	}

	// A new endpoint, default deny in ingress with one allow (the host),
	// is switched on although its entry does not fit.
	newEP := polEndpoint(3, 2003, tables.EnforceDefaultDeny, tables.EnforceOff)
	f.insert(t, newEP, polEntry(3, 1, tables.DirIngress, 22))
	if err := f.updateEndpoint(t, newEP.Name); err == nil || !strings.Contains(err.Error(), "ingress lacks 1 allows") {
		t.Fatalf("endpoint %s: %v; want it failing closed", newEP.Name, err)
	}
	want = bpf.PolicyEndpointValue{EndpointID: 3, Flags: bpf.PolicyEnforceIngress}
	if v, ok := f.endpointsMap(t)[2003]; !ok || v != want {
		t.Errorf("policy_endpoints of %s is %v (%v), want %v: its default deny not enforced", newEP.Name, v, ok, want)
	}
}

func mapHas[K comparable, V any](m map[K]V, k K) bool {
	_, ok := m[k]
	return ok
}

// TestPolicyEndpointFlags: an endpoint row's Update writes the endpoint's
// entries and then its cgroup, with the
// flags of its directions' enforcement and of audit mode.
func TestPolicyEndpointFlags(t *testing.T) {
	tests := []struct {
		name            string
		ingress, egress string
		audit           bool
		want            uint32
	}{
		{"not enforced", tables.EnforceOff, tables.EnforceOff, false, 0},
		{"ingress default deny", tables.EnforceDefaultDeny, tables.EnforceOff, false, bpf.PolicyEnforceIngress},
		{"egress default allow", tables.EnforceOff, tables.EnforceDefaultAllow, false, bpf.PolicyEnforceEgress},
		{"both, audit", tables.EnforceDefaultAllow, tables.EnforceDefaultDeny, true,
			bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress | bpf.PolicyAudit},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newPolicyFixture(t, 1024)
			ep := polEndpoint(7, 3001, tc.ingress, tc.egress)
			ep.Audit = tc.audit
			entries := []*tables.PolicyEntry{polEntry(7, 256, tables.DirIngress, 80), polEntry(7, 0, tables.DirEgress, 53)}
			f.insert(t, ep, entries[0], entries[1])
			if err := f.updateEndpoint(t, ep.Name); err != nil {
				t.Fatal(err)
			}
			got := f.policyMap(t)
			for _, e := range entries {
				k, v := reconcilers.PolicyKeyOf(e)
				if got[k] != v || !mapHas(got, k) {
					t.Errorf("entry %s: %+v in the map, want %+v", k, got[k], v)
				}
			}
			want := map[uint64]bpf.PolicyEndpointValue{3001: {EndpointID: 7, Flags: tc.want}}
			if got := f.endpointsMap(t); !maps.Equal(got, want) {
				t.Errorf("policy_endpoints %v, want %v", got, want)
			}
		})
	}
}

// TestPolicyEndpointPodIface: an endpoint whose interface is enforced
// carries the flag and its pod side's index (which must fit, else
// neither: the drop stays EPERM); a restarted agent's Open clears both
// from every entry until the rows say so again.
func TestPolicyEndpointPodIface(t *testing.T) {
	f := newPolicyFixture(t, 1024)
	rows := map[string]int{"a": 2, "b": 0, "c": 40000}
	var names []string
	for i, name := range []string{"a", "b", "c"} {
		ep := polEndpoint(uint32(i+1), uint64(3001+i), tables.EnforceOff, tables.EnforceDefaultAllow)
		ep.PodIface, ep.PodIfindex = true, rows[name]
		f.insert(t, ep)
		names = append(names, ep.Name)
	}
	for _, n := range names {
		if err := f.updateEndpoint(t, n); err != nil {
			t.Fatal(err)
		}
	}
	want := map[uint64]bpf.PolicyEndpointValue{
		3001: {EndpointID: 1, Flags: bpf.PolicyEnforceEgress | bpf.PolicyPodIface | 2<<bpf.PolicyPodIfindexShift},
		3002: {EndpointID: 2, Flags: bpf.PolicyEnforceEgress},
		3003: {EndpointID: 3, Flags: bpf.PolicyEnforceEgress},
	}
	if got := f.endpointsMap(t); !maps.Equal(got, want) {
		t.Fatalf("policy_endpoints %v, want %v", got, want)
	}
	f.open(t, 1024)
	want[3001] = bpf.PolicyEndpointValue{EndpointID: 1, Flags: bpf.PolicyEnforceEgress}
	if got := f.endpointsMap(t); !maps.Equal(got, want) {
		t.Fatalf("after Open: policy_endpoints %v, want %v", got, want)
	}
}

// TestPolicyEndpointCgroup follows an endpoint's cgroup: a new cgroup ID
// moves its policy_endpoints entry (the old key goes), a cgroup gone
// removes it, Delete removes it, a row without an endpoint ID writes
// nothing, and Prune removes the cgroups no row names (left by an earlier
// run) and keeps those rows name.
func TestPolicyEndpointCgroup(t *testing.T) {
	f := newPolicyFixture(t, 1024)
	// An earlier run left cgroup 4242 (endpoint 9) in policy_endpoints.
	old := polEndpoint(9, 4242, tables.EnforceDefaultDeny, tables.EnforceOff)
	f.insert(t, old)
	if err := f.updateEndpoint(t, old.Name); err != nil {
		t.Fatal(err)
	}
	f.remove(t, old)
	if restored := f.open(t, 1024); !maps.Equal(restored, map[uint64]uint32{4242: 9}) {
		t.Fatalf("restored %v", restored)
	}

	web := polEndpoint(1, 1001, tables.EnforceDefaultDeny, tables.EnforceDefaultDeny)
	webValue := bpf.PolicyEndpointValue{EndpointID: 1, Flags: bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress}
	entry := polEntry(1, 256, tables.DirEgress, 443)
	f.insert(t, web, entry)
	steps := []struct {
		name   string
		change func(*tables.EndpointPolicy) // nil: Delete the row
		want   map[uint64]bpf.PolicyEndpointValue
	}{
		{"first cgroup", func(*tables.EndpointPolicy) {}, map[uint64]bpf.PolicyEndpointValue{4242: {EndpointID: 9, Flags: bpf.PolicyEnforceIngress}, 1001: webValue}},
		{"cgroup made anew", func(e *tables.EndpointPolicy) { e.CgroupID = 1002 }, map[uint64]bpf.PolicyEndpointValue{4242: {EndpointID: 9, Flags: bpf.PolicyEnforceIngress}, 1002: webValue}},
		{"egress no longer enforced", func(e *tables.EndpointPolicy) { e.Egress = tables.EnforceOff },
			map[uint64]bpf.PolicyEndpointValue{4242: {EndpointID: 9, Flags: bpf.PolicyEnforceIngress}, 1002: {EndpointID: 1, Flags: bpf.PolicyEnforceIngress}}},
		{"cgroup gone", func(e *tables.EndpointPolicy) { e.CgroupID, e.Cgroup = 0, "" }, map[uint64]bpf.PolicyEndpointValue{4242: {EndpointID: 9, Flags: bpf.PolicyEnforceIngress}}},
		{"cgroup back", func(e *tables.EndpointPolicy) { e.CgroupID, e.Cgroup = 1003, "kubepods/pod1" }, map[uint64]bpf.PolicyEndpointValue{4242: {EndpointID: 9, Flags: bpf.PolicyEnforceIngress}, 1003: {EndpointID: 1, Flags: bpf.PolicyEnforceIngress}}},
		{"deleted", nil, map[uint64]bpf.PolicyEndpointValue{4242: {EndpointID: 9, Flags: bpf.PolicyEnforceIngress}}},
	}
	row := web
	for _, step := range steps {
		var err error
		genBefore := f.endpointsGen(t)
		if step.change == nil {
			txn := f.db.ReadTxn()
			f.remove(t, row)
			err = f.ops.Ops(f.entries).Delete(context.Background(), txn, 0, row)
		} else {
			row = row.Clone()
			step.change(row)
			f.insert(t, row)
			err = f.updateEndpoint(t, row.Name)
		}
		if err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		if got := f.endpointsMap(t); !maps.Equal(got, step.want) {
			t.Fatalf("%s: policy_endpoints %v, want %v", step.name, got, step.want)
		}
		// Every change moves the counter the programs' cache holds to.
		if gen := f.endpointsGen(t); gen <= genBefore {
			t.Errorf("%s: policy_endpoints_gen %d, was %d: the programs would go on with what they cached", step.name, gen, genBefore)
		}
	}
	// Its entries went with it.
	if k, _ := reconcilers.PolicyKeyOf(entry); mapHas(f.policyMap(t), k) {
		t.Errorf("deleting the endpoint row left its entry %s", k)
	}

	// No endpoint ID yet (its cgroup unknown so far): nothing written.
	pending := polEndpoint(0, 0, tables.EnforceDefaultDeny, tables.EnforceOff)
	pending.Name = "default/pending"
	f.insert(t, pending)
	before, _ := f.ops.Writes()
	if err := f.updateEndpoint(t, pending.Name); err != nil {
		t.Fatal(err)
	}
	if after, _ := f.ops.Writes(); after != before {
		t.Errorf("a row without an endpoint ID wrote %d entries", after-before)
	}

	// Prune: the rows name cgroup 1005 only.
	db := polEndpoint(2, 1005, tables.EnforceDefaultDeny, tables.EnforceOff)
	f.insert(t, db)
	if err := f.updateEndpoint(t, db.Name); err != nil {
		t.Fatal(err)
	}
	genBefore := f.endpointsGen(t)
	f.prune(t)
	want := map[uint64]bpf.PolicyEndpointValue{1005: {EndpointID: 2, Flags: bpf.PolicyEnforceIngress}}
	if got := f.endpointsMap(t); !maps.Equal(got, want) {
		t.Fatalf("after the prune policy_endpoints %v, want %v", got, want)
	}
	if gen := f.endpointsGen(t); gen <= genBefore {
		t.Errorf("the prune deleted an entry, policy_endpoints_gen stayed %d", gen)
	}
}

// TestPolicyPruneKeepsPending: Prune leaves what a row not applied yet
// (pending, or failed and to be retried) had applied, which its Update
// replaces in order; once applied, what the row no longer has goes.
func TestPolicyPruneKeepsPending(t *testing.T) {
	f := newPolicyFixture(t, 1024)
	web := polEndpoint(1, 1001, tables.EnforceOff, tables.EnforceDefaultDeny)
	e := polEntry(1, 256, tables.DirEgress, 443)
	f.insert(t, web, e)
	if err := f.updateEndpoint(t, web.Name); err != nil {
		t.Fatal(err)
	}
	// The policy changes (another port); the row is pending.
	next := polEntry(1, 256, tables.DirEgress, 8443)
	f.remove(t, e)
	f.insert(t, next, web.Clone())
	f.prune(t)
	k, _ := reconcilers.PolicyKeyOf(e)
	if !mapHas(f.policyMap(t), k) {
		t.Fatalf("prune deleted %s under an enforced endpoint whose row is pending", k)
	}
	if !mapHas(f.endpointsMap(t), 1001) {
		t.Fatalf("prune deleted the cgroup of a pending row")
	}
	if err := f.updateEndpoint(t, web.Name); err != nil {
		t.Fatal(err)
	}
	nk, _ := reconcilers.PolicyKeyOf(next)
	if got := f.policyMap(t); mapHas(got, k) || !mapHas(got, nk) {
		t.Fatalf("after the update the map holds %v; want %s and not %s", got, nk, k)
	}
}

// TestPolicyMapShrink: a restart with a policy map smaller than the
// entries it held keeps the entries that fit instead of failing to start.
func TestPolicyMapShrink(t *testing.T) {
	f := newPolicyFixture(t, 1024)
	var rows []any
	for i := range 300 {
		rows = append(rows, polEntry(1, uint32(1000+i), tables.DirEgress, 443))
	}
	rows = append(rows, polEndpoint(1, 0, tables.EnforceOff, tables.EnforceOff))
	f.insert(t, rows...)
	if err := f.updateEndpoint(t, "default/ep1"); err != nil {
		t.Fatal(err)
	}
	f.open(t, 256)
	if n := len(f.policyMap(t)); n != 256 {
		t.Fatalf("the shrunk map holds %d entries, want the 256 that fit", n)
	}
}

// TestPolicyOffBeforeEntriesGo: when a policy goes, its entries are
// deleted and the endpoint turned off in one transaction; the update
// applies both (enforcement first, see Policy).
func TestPolicyOffBeforeEntriesGo(t *testing.T) {
	f := newPolicyFixture(t, 1024)
	web := polEndpoint(1, 1001, tables.EnforceOff, tables.EnforceDefaultDeny)
	e := polEntry(1, 256, tables.DirEgress, 443)
	f.insert(t, web, e)
	if err := f.updateEndpoint(t, web.Name); err != nil {
		t.Fatal(err)
	}
	f.remove(t, e)
	f.insert(t, polEndpoint(1, 1001, tables.EnforceOff, tables.EnforceOff))
	if err := f.updateEndpoint(t, web.Name); err != nil {
		t.Fatal(err)
	}
	if v := f.endpointsMap(t)[1001]; v.Flags&(bpf.PolicyEnforceEgress|bpf.PolicyEnforceIngress) != 0 {
		t.Errorf("the endpoint still enforces: flags %#x", v.Flags)
	}
	if k, _ := reconcilers.PolicyKeyOf(e); mapHas(f.policyMap(t), k) {
		t.Errorf("the entry is still in the map")
	}
}

// The flags of an entry's map value: a deny (audited or not), and an allow
// that matches pods' addresses; a deny never carries the latter.
func TestPolicyKeyOfFlags(t *testing.T) {
	for _, tc := range []struct {
		name  string
		e     tables.PolicyEntry
		flags uint8
	}{
		{"allow", tables.PolicyEntry{}, 0},
		{"deny", tables.PolicyEntry{Deny: true}, bpf.PolicyFlagDeny},
		{"audited deny", tables.PolicyEntry{Deny: true, Audit: true}, bpf.PolicyFlagDeny | bpf.PolicyFlagAudit},
		{"allow of pods' addresses", tables.PolicyEntry{PodAddrs: true}, bpf.PolicyFlagPodAddrs},
		{"deny with PodAddrs", tables.PolicyEntry{Deny: true, PodAddrs: true}, bpf.PolicyFlagDeny},
		{"ClusterNetworkPolicy deny (drop)", tables.PolicyEntry{Deny: true, Final: true, Drop: true},
			bpf.PolicyFlagDeny | bpf.PolicyFlagFinal | bpf.PolicyFlagDrop},
		{"drop on an allow: none", tables.PolicyEntry{Final: true, Drop: true}, bpf.PolicyFlagFinal},
	} {
		e := tc.e
		e.Direction = tables.DirEgress
		if _, v := reconcilers.PolicyKeyOf(&e); v.Flags != tc.flags {
			t.Errorf("%s: flags %#x, want %#x", tc.name, v.Flags, tc.flags)
		}
	}
}

// TestPolicyFaults runs the policy reconciler on maps in memory whose
// writes fail (memmap.Faulty): a policy map batch that fails halfway is
// finished one by one and the endpoint enforced; writes that keep failing
// leave the endpoint's policy_endpoints entry unwritten (its entries go
// first) and the row in error, until a retry succeeds.
func TestPolicyFaults(t *testing.T) {
	cases := []struct {
		name  string
		fault memmap.Fault
		fails bool
	}{
		{"batch fails halfway", memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy, After: 3, Times: 1}, false},
		{"every write fails", memmap.Fault{Op: memmap.OpWrite, Err: memmap.ErrBusy}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			faulty := map[string]*memmap.Faulty{}
			pins := memmap.NewPins(func(path string, m *memmap.Map) bpf.Map {
				faulty[filepath.Base(path)] = memmap.NewFaulty(m)
				return faulty[filepath.Base(path)]
			})
			f := newPolicyFixtureOn(t, testMaps{dir: "/test", pins: pins}, 1024)
			rows := []any{polEndpoint(1, 1001, tables.EnforceDefaultDeny, tables.EnforceDefaultDeny)}
			want := map[bpf.PolicyKey]bpf.PolicyValue{}
			for i := range 8 {
				e := polEntry(1, uint32(256+i), tables.DirIngress, 80)
				rows = append(rows, e)
				k, v := reconcilers.PolicyKeyOf(e)
				want[k] = v
			}
			f.insert(t, rows...)
			faulty[bpf.PolicyMap].Inject(tc.fault)
			err := f.updateEndpoint(t, "default/ep1")
			if tc.fails {
				if !errors.Is(err, memmap.ErrBusy) || !strings.Contains(err.Error(), "not enforced until its policy is in the map") {
					t.Fatalf("update: %v; want the endpoint not enforced, with the map's error", err)
				}
				if _, ok := f.endpointsMap(t)[1001]; ok {
					t.Fatal("policy_endpoints holds the endpoint whose entries failed")
				}
				faulty[bpf.PolicyMap].Clear()
				err = f.updateEndpoint(t, "default/ep1")
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := f.policyMap(t); !maps.Equal(got, want) {
				t.Errorf("the map holds\n%v\nwant\n%v", got, want)
			}
			if _, ok := f.endpointsMap(t)[1001]; !ok {
				t.Error("policy_endpoints lacks the endpoint")
			}
			u0, d0 := f.ops.Writes()
			f.prune(t)
			if err := f.updateEndpoint(t, "default/ep1"); err != nil {
				t.Fatal(err)
			}
			if u, d := f.ops.Writes(); u != u0 || d != d0 {
				t.Errorf("applying the row again wrote %d and deleted %d: the record missed what the faulty round wrote", u-u0, d-d0)
			}
		})
	}
}

// TestPolicySet: an endpoint's update writes the entries of the policy set
// its reference entry names before its own (the set's row may come later);
// a set's row deleted while a reference in the map still names it keeps
// its entries until Prune finds none; a set that does not fit fails its
// endpoints closed, with the error on their rows.
func TestPolicySet(t *testing.T) {
	const size = 256
	f := newPolicyFixture(t, size)
	set := &tables.EndpointPolicy{Name: tables.PolicySetName(9), ID: 9, Set: true,
		Ingress: tables.EnforceOff, Egress: tables.EnforceOff, Policies: []string{}}
	ep := polEndpoint(1, 2001, tables.EnforceOff, tables.EnforceDefaultDeny)
	ref := &tables.PolicyEntry{Endpoint: ep.Name, EndpointID: 1, Identity: tables.PolicySetRef, Direction: tables.DirEgress,
		Policies: []string{set.Name}, Cookie: 9}
	rows := []any{set, ep, ref}
	var setEntries []*tables.PolicyEntry
	for i := range 100 {
		e := polEntry(9, uint32(1000+i), tables.DirEgress, 53)
		e.Endpoint, e.Policies = set.Name, []string{set.Name}
		setEntries = append(setEntries, e)
		rows = append(rows, e)
	}
	f.insert(t, rows...)
	if err := f.updateEndpoint(t, ep.Name); err != nil {
		t.Fatalf("endpoint %s: %v", ep.Name, err)
	}
	got := f.policyMap(t)
	for _, e := range append(slices.Clone(setEntries), ref) {
		if k, _ := reconcilers.PolicyKeyOf(e); !mapHas(got, k) {
			t.Fatalf("entry %s is not in the map after the endpoint's update", k)
		}
	}
	if err := f.updateEndpoint(t, set.Name); err != nil {
		t.Fatalf("set %s: %v", set.Name, err)
	}
	if n := len(f.policyMap(t)); n != 101 {
		t.Fatalf("%d entries, want 101", n)
	}

	// A restart reserves the set's number (no cgroup names it, a
	// reference does): no new set may take it while the reference is in
	// the map.
	restored := f.open(t, size)
	if want := map[uint64]uint32{2001: 1, reconcilers.StaleIDKey(9): 9}; !maps.Equal(restored, want) {
		t.Fatalf("restored %v, want %v", restored, want)
	}
	if err := f.updateEndpoint(t, ep.Name); err != nil {
		t.Fatal(err)
	}
	if err := f.updateEndpoint(t, set.Name); err != nil {
		t.Fatal(err)
	}

	// The set's row goes before the endpoint's new row (no reference) is
	// applied: its entries stay (a prune meanwhile keeps them too), and
	// go when the endpoint's update takes the last reference away.
	if err := f.ops.Ops(f.entries).Delete(context.Background(), f.db.ReadTxn(), 0, set); err != nil {
		t.Fatal(err)
	}
	f.remove(t, set)
	f.prune(t)
	if n := len(f.policyMap(t)); n != 101 {
		t.Fatalf("%d entries after the set's delete while referenced, want 101", n)
	}
	f.remove(t, ref)
	f.insert(t, ep)
	if err := f.updateEndpoint(t, ep.Name); err != nil {
		t.Fatal(err)
	}
	if n := len(f.policyMap(t)); n != 0 {
		t.Fatalf("%d entries once no reference names the set, want 0", n)
	}

	// A set larger than the map: the endpoint fails closed, saying so.
	big := &tables.EndpointPolicy{Name: tables.PolicySetName(10), ID: 10, Set: true,
		Ingress: tables.EnforceOff, Egress: tables.EnforceOff, Policies: []string{}}
	ref2 := &tables.PolicyEntry{Endpoint: ep.Name, EndpointID: 1, Identity: tables.PolicySetRef, Direction: tables.DirEgress,
		Policies: []string{big.Name}, Cookie: 10}
	rows = []any{big, ref2}
	for i := range 300 {
		e := polEntry(10, uint32(1000+i), tables.DirEgress, 53)
		e.Endpoint, e.Policies = big.Name, []string{big.Name}
		rows = append(rows, e)
	}
	f.insert(t, rows...)
	err := f.updateEndpoint(t, ep.Name)
	for _, want := range []string{"endpoint " + ep.Name + " fails closed", "policy map is full", "policy set " + big.Name + " lacks"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("endpoint %s: %v; want an error saying %q", ep.Name, err, want)
		}
	}
	if got := f.endpointsMap(t); got[2001].EndpointID != 1 || got[2001].Flags != bpf.PolicyEnforceEgress {
		t.Fatalf("policy_endpoints %v: the endpoint's default deny is not enforced", got)
	}
}
