package reconcilers_test

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/sys/unix"
	"log/slog"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// TestPolicyReplacedPods replaces pods under the same names, as a
// Deployment's or StatefulSet's rollout does, in random sequences against
// the policy reconciler running in a hive, and after each burst of changes
// checks that the pinned maps hold exactly what the tables say: every
// endpoint enforced as its row says, on the cgroup its row names, with
// its entries and nothing else. The controller's writes are modelled as
// it makes them: an endpoint's entries and its row in one transaction; a
// pod deleted and made again either in one transaction (it keeps its
// endpoint ID) or in two (a new ID); new pods sometimes on a cgroup ID an
// old pod had, and sometimes on an endpoint ID restored from the map.
//
// APIARY_POLICY_REPLACE_STEPS sets the number of bursts (default 150).
func TestPolicyReplacedPods(t *testing.T) {
	steps := 150
	if s := os.Getenv("APIARY_POLICY_REPLACE_STEPS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			t.Fatalf("APIARY_POLICY_REPLACE_STEPS=%q: %v", s, err)
		}
		steps = n
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	h := newPolicyHive(t)
	m := &podModel{rng: rng, h: h, pods: map[string]*podState{}, nextID: 1, nextCgroup: 1000}
	for step := range steps {
		for range 1 + rng.IntN(6) {
			m.change()
		}
		h.settle(t)
		if diff := h.diff(t); diff != "" {
			t.Fatalf("seed %d, after burst %d:\n%s\nlast changes:\n%s", seed, step, diff, strings.Join(m.log[max(0, len(m.log)-12):], "\n"))
		}
	}
}

// policyHive runs the policy reconciler as the policy cell registers it,
// on maps pinned in a directory of the test's.
type policyHive struct {
	testMaps
	db        *statedb.DB
	entries   statedb.RWTable[*tables.PolicyEntry]
	endpoints statedb.RWTable[*tables.EndpointPolicy]
	ops       *reconcilers.Policy
	rec       reconciler.Reconciler[*tables.EndpointPolicy]
}

func newPolicyHive(t *testing.T) *policyHive {
	t.Helper()
	ph := &policyHive{testMaps: newTestMaps(t), ops: reconcilers.NewPolicy(nil, policyMaxFlag)}
	if _, err := ph.ops.OpenWith(ph.opener(), ph.dir, 4096, 1024); err != nil {
		t.Fatal(err)
	}
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell,
		cell.Module("policy-test", "Policy reconciler under test",
			cell.ProvidePrivate(
				func(r job.Registry, h cell.Health) job.Group { return r.NewGroup(h) },
				tables.NewPolicyEntriesTable,
				tables.NewEndpointPolicyTable,
			),
			cell.Invoke(func(p reconciler.Params, e statedb.RWTable[*tables.PolicyEntry], ep statedb.RWTable[*tables.EndpointPolicy]) error {
				ph.db, ph.entries, ph.endpoints = p.DB, e, ep
				var err error
				ph.rec, err = reconcilers.RegisterPolicy(p, ph.ops, e, ep)
				return err
			}),
		),
	)
	log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelWarn))
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		h.Stop(log, context.Background())
		ph.ops.Close()
	})
	return ph
}

// settle waits until the reconciler has applied every change made so far,
// without a failure left to retry.
func (ph *policyHive) settle(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rev := ph.endpoints.Revision(ph.db.ReadTxn())
	done, retryLow, err := ph.rec.WaitUntilReconciled(ctx, rev)
	if err != nil {
		t.Fatalf("endpoint-policy not reconciled up to revision %d: %v (reached %d)", rev, err, done)
	}
	if retryLow != 0 && retryLow <= rev { // 0: nothing to retry
		var failed []string
		for row := range ph.endpoints.All(ph.db.ReadTxn()) {
			if row.Status.Kind == reconciler.StatusKindError {
				failed = append(failed, row.Name+": "+row.Status.GetError())
			}
		}
		t.Fatalf("endpoint rows failed: %v", failed)
	}
}

// diff compares the pinned maps with what the tables want, and says how
// they differ ("" when they agree).
func (ph *policyHive) diff(t *testing.T) string {
	t.Helper()
	txn := ph.db.ReadTxn()
	wantEntries := map[bpf.PolicyKey]bpf.PolicyValue{}
	wantCgroups := map[uint64]bpf.PolicyEndpointValue{}
	for row := range ph.endpoints.All(txn) {
		if row.ID == 0 {
			continue
		}
		if row.CgroupID != 0 {
			wantCgroups[row.CgroupID] = reconcilers.EndpointValue(row)
		}
		for e := range tables.PolicyEntriesOf(txn, ph.entries, row.Name) {
			k, v := reconcilers.PolicyKeyOf(e)
			wantEntries[k] = v
		}
	}
	var b strings.Builder
	gotCgroups := readPinned[uint64, bpf.PolicyEndpointValue](t, ph.raw(t, bpf.PolicyEndpointsMap))
	for _, cg := range slices.Sorted(maps.Keys(wantCgroups)) {
		if got, ok := gotCgroups[cg]; !ok || got != wantCgroups[cg] {
			fmt.Fprintf(&b, "policy_endpoints[%d] = %+v (present %v), want %+v\n", cg, got, ok, wantCgroups[cg])
		}
	}
	for _, cg := range slices.Sorted(maps.Keys(gotCgroups)) {
		if _, ok := wantCgroups[cg]; !ok {
			fmt.Fprintf(&b, "policy_endpoints[%d] = %+v, stray\n", cg, gotCgroups[cg])
		}
	}
	gotEntries := readPinned[bpf.PolicyKey, bpf.PolicyValue](t, ph.raw(t, bpf.PolicyMap))
	for k, v := range wantEntries {
		if got, ok := gotEntries[k]; !ok || got != v {
			fmt.Fprintf(&b, "policy[%s] = %+v (present %v), want %+v\n", k, got, ok, v)
		}
	}
	for k, v := range gotEntries {
		if _, ok := wantEntries[k]; !ok {
			fmt.Fprintf(&b, "policy[%s] = %+v, stray\n", k, v)
		}
	}
	return b.String()
}

// podModel plays the policy controller for a few pod names.
type podModel struct {
	rng        *rand.Rand
	h          *policyHive
	pods       map[string]*podState // by name; absent: no pod
	nextID     uint32
	nextCgroup uint64
	freedCg    []uint64 // cgroup IDs of pods gone, for new pods to reuse
	freedIDs   []uint32 // endpoint IDs of pods gone, as restored from a map
	log        []string
}

type podState struct {
	row     *tables.EndpointPolicy
	entries map[string]*tables.PolicyEntry // by key
}

var podNames = []string{"default/web-0", "default/web-1", "default/web-2", "default/db-0"}

func (m *podModel) change() {
	name := podNames[m.rng.IntN(len(podNames))]
	p := m.pods[name]
	switch {
	case p == nil:
		m.create(name, m.h.db.WriteTxn(m.h.entries, m.h.endpoints), "created")
	case m.rng.IntN(3) == 0:
		m.repolicy(name, p)
	case m.rng.IntN(2) == 0:
		// Deleted and made again before the controller's flush: one
		// transaction, the endpoint ID kept, a new cgroup.
		wtxn := m.h.db.WriteTxn(m.h.entries, m.h.endpoints)
		row := p.row.Clone()
		row.CgroupID = m.cgroup()
		m.freedCg = append(m.freedCg, p.row.CgroupID)
		row.Cgroup = fmt.Sprintf("kubepods/pod%d", row.CgroupID)
		m.write(wtxn, name, row, m.randomEntries(name, row.ID), "replaced in one flush")
	default:
		// Deleted, flushed, then made again: a new endpoint ID.
		wtxn := m.h.db.WriteTxn(m.h.entries, m.h.endpoints)
		for _, e := range p.entries {
			m.h.entries.Delete(wtxn, e)
		}
		m.h.endpoints.Delete(wtxn, p.row)
		wtxn.Commit()
		delete(m.pods, name)
		m.freedCg = append(m.freedCg, p.row.CgroupID)
		m.freedIDs = append(m.freedIDs, p.row.ID)
		m.log = append(m.log, fmt.Sprintf("%s deleted (id %d cgroup %d)", name, p.row.ID, p.row.CgroupID))
		if m.rng.IntN(4) != 0 {
			m.create(name, m.h.db.WriteTxn(m.h.entries, m.h.endpoints), "made again")
		}
	}
}

// cgroup returns a cgroup ID for a new pod: one a gone pod had, now and
// then.
func (m *podModel) cgroup() uint64 {
	if len(m.freedCg) > 0 && m.rng.IntN(3) == 0 {
		i := m.rng.IntN(len(m.freedCg))
		cg := m.freedCg[i]
		m.freedCg = slices.Delete(m.freedCg, i, i+1)
		if !m.cgroupInUse(cg) {
			return cg
		}
	}
	m.nextCgroup++
	return m.nextCgroup
}

func (m *podModel) cgroupInUse(cg uint64) bool {
	for _, p := range m.pods {
		if p.row.CgroupID == cg {
			return true
		}
	}
	return false
}

func (m *podModel) idInUse(id uint32) bool {
	for _, p := range m.pods {
		if p.row.ID == id {
			return true
		}
	}
	return false
}

func (m *podModel) create(name string, wtxn statedb.WriteTxn, what string) {
	id := m.nextID
	if len(m.freedIDs) > 0 && m.rng.IntN(4) == 0 {
		i := m.rng.IntN(len(m.freedIDs))
		if cand := m.freedIDs[i]; !m.idInUse(cand) {
			id = cand
		}
		m.freedIDs = slices.Delete(m.freedIDs, i, i+1)
	}
	if id == m.nextID {
		m.nextID++
	}
	cg := m.cgroup()
	row := &tables.EndpointPolicy{Name: name, ID: id, Cgroup: fmt.Sprintf("kubepods/pod%d", cg), CgroupID: cg, Policies: []string{}}
	m.pods[name] = &podState{row: row, entries: map[string]*tables.PolicyEntry{}}
	m.write(wtxn, name, row, m.randomEntries(name, id), what)
}

// repolicy changes what the pod's policy says: enforcement and entries.
func (m *podModel) repolicy(name string, p *podState) {
	wtxn := m.h.db.WriteTxn(m.h.entries, m.h.endpoints)
	m.write(wtxn, name, p.row.Clone(), m.randomEntries(name, p.row.ID), "policy changed")
}

func (m *podModel) randomEntries(name string, id uint32) map[string]*tables.PolicyEntry {
	out := map[string]*tables.PolicyEntry{}
	for range m.rng.IntN(5) {
		dir := tables.DirIngress
		if m.rng.IntN(2) == 0 {
			dir = tables.DirEgress
		}
		e := &tables.PolicyEntry{
			Endpoint: name, EndpointID: id, Identity: 256 + uint32(m.rng.IntN(4)), Direction: dir,
			Protocol: unix.IPPROTO_TCP, Port: uint16(80 + m.rng.IntN(3)), PortBits: 16,
			Deny: m.rng.IntN(4) == 0, Policies: []string{"cnp/default/p"},
		}
		out[e.Key()] = e
	}
	return out
}

// write makes the pod's entries want and its row one transaction, as the
// controller's writer does: entries first, then the row.
func (m *podModel) write(wtxn statedb.WriteTxn, name string, row *tables.EndpointPolicy, want map[string]*tables.PolicyEntry, what string) {
	defer wtxn.Abort()
	p := m.pods[name]
	for k, e := range p.entries {
		if _, ok := want[k]; !ok {
			m.h.entries.Delete(wtxn, e)
		}
	}
	in, out := false, false
	for _, e := range want {
		m.h.entries.Insert(wtxn, e)
		if e.Direction == tables.DirIngress {
			in = true
		} else {
			out = true
		}
	}
	enforce := func(on bool) string {
		switch {
		case on:
			return tables.EnforceDefaultDeny
		case m.rng.IntN(3) == 0:
			return tables.EnforceDefaultDeny // selected, nothing allowed
		}
		return tables.EnforceOff
	}
	row.Ingress, row.Egress, row.Entries = enforce(in), enforce(out), len(want)
	row.Status = reconciler.StatusPending()
	m.h.endpoints.Insert(wtxn, row)
	wtxn.Commit()
	p.row, p.entries = row, want
	m.log = append(m.log, fmt.Sprintf("%s %s: id %d cgroup %d in=%s out=%s entries %d",
		name, what, row.ID, row.CgroupID, row.Ingress, row.Egress, len(want)))
}
