package policy

import (
	"context"
	"fmt"
	"runtime"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// BenchmarkMapMemory measures the kernel memory (memlock, which the kernel
// computes from the trie's nodes on 6.x) of 100 endpoints × 2,000 entries
// in one shared policy map, keyed by endpoint, against one map per
// endpoint, as the reference keeps them.
func BenchmarkMapMemory(b *testing.B) {
	testenv.RequireRoot(b)
	const endpoints, entries = 100, 2000
	key := func(ep, i int) bpf.PolicyKey {
		return bpf.NewPolicyKey(uint32(ep+1), uint32(256+i/4), uint8(i%2), 6, uint16(1000+i%4), 16)
	}
	memlock := func(m *ebpf.Map) uint64 {
		info, err := m.Info()
		if err != nil {
			b.Fatal(err)
		}
		v, _ := info.Memlock()
		return v
	}
	fill := func(m *ebpf.Map, ep int) {
		keys := make([]bpf.PolicyKey, entries)
		values := make([]bpf.PolicyValue, entries)
		for i := range keys {
			keys[i] = key(ep, i)
		}
		if _, err := m.BatchUpdate(keys, values, nil); err != nil {
			b.Fatal(err)
		}
	}
	newMap := func(max uint32) *ebpf.Map {
		spec := bpf.PolicyMapSpec(max)
		spec.Pinning = ebpf.PinNone
		m, err := ebpf.NewMap(spec)
		if err != nil {
			b.Fatal(err)
		}
		return m
	}
	for range b.N {
		shared := newMap(endpoints * entries)
		for ep := range endpoints {
			fill(shared, ep)
		}
		sharedBytes := memlock(shared)
		shared.Close()

		var perBytes uint64
		for ep := range endpoints {
			m := newMap(16384) // the reference's default size per endpoint
			fill(m, ep)
			perBytes += memlock(m)
			m.Close()
		}
		b.ReportMetric(float64(sharedBytes), "shared-bytes")
		b.ReportMetric(float64(perBytes), "per-endpoint-bytes")
	}
}

// bigPolicyRules is the shape of issue 29's comparison with the
// reference: rule r of n allows egress to 1–3 peers app=peer-N (N below
// peers) on 1–2 TCP ports. cells/selectors builds the same policy object
// (bigPolicyRules there), and bigPolicy in agent_bench_test.go; keep them
// in step.
func bigPolicyRules(n, peers int) []tables.PolicyRule {
	out := make([]tables.PolicyRule, n)
	for r := range out {
		var sels []string
		for k := range 1 + r%3 {
			sels = append(sels, fmt.Sprintf("any:app=peer-%d", (r*7+k*331)%peers))
		}
		ports := []tables.PortRule{tcp(uint16(1000+r%17), 0)}
		if r%2 == 1 {
			ports = append(ports, tcp(uint16(2000+r%13), 0))
		}
		out[r] = egress(false, sels, ports...)
	}
	return out
}

// BenchmarkEndpointPolicy computes the entries of the endpoints a new
// policy of 3,000 rules (bigPolicyRules) selects, over 1,000 peer
// identities, its selectors already matched (the selectors table): the
// engine's part of a new policy, from the policies row to the entries.
// Each iteration starts from a fresh engine holding the selectors and
// endpoints, untimed; only adding the policy and computing is timed, into
// an output that counts the entries (the rows they make, and the maps,
// are BenchmarkAgentNewPolicy's). retained-B is the heap the engine keeps
// for the policy.
func BenchmarkEndpointPolicy(b *testing.B) {
	const rules, peers = 3000, 1000
	for _, endpoints := range []int{1, 100} {
		b.Run(fmt.Sprintf("rules=%d,peers=%d,endpoints=%d", rules, peers, endpoints), func(b *testing.B) {
			policy := []tables.PolicySpec{spec("any:app=web", bigPolicyRules(rules, peers)...)}
			var want, entries int
			var retained uint64
			for i := range b.N {
				b.StopTimer()
				e := newEngine(ModeDefault, false, nil)
				var web []uint32
				for ep := range endpoints {
					web = append(web, uint32(256+ep%10)) // ten replicas per identity
				}
				e.setSelector("any:app=web", web)
				for i := range peers {
					e.setSelector(fmt.Sprintf("any:app=peer-%d", i), []uint32{uint32(1000 + i)})
				}
				for ep := range endpoints {
					name := fmt.Sprintf("default/web-%d", ep)
					e.setEndpoint(name, endpointRow(name, uint32(256+ep%10), uint64(100+ep)))
				}
				e.flush(&countOutput{})
				out := &countOutput{}
				before := heapInUse()
				b.StartTimer()

				e.setPolicy("cnp/default/big", policy, false, "")
				e.flush(out)

				b.StopTimer()
				retained += heapInUse() - before
				entries = out.entries
				if i == 0 {
					want = entries
					if want < rules*endpoints {
						b.Fatalf("%d entries, want at least %d", entries, rules*endpoints)
					}
				} else if entries != want {
					b.Fatalf("%d entries, want %d as before", entries, want)
				}
				runtime.KeepAlive(e)
				b.StartTimer()
			}
			b.ReportMetric(float64(entries), "entries")
			b.ReportMetric(float64(retained)/float64(b.N), "retained-B")
		})
	}
}

// countOutput counts the entries the engine hands out: the engine's own
// cost, without a table's (the agent benchmarks have the tables').
type countOutput struct{ entries int }

func (o *countOutput) upsertEntry(*tables.PolicyEntry)       { o.entries++ }
func (o *countOutput) deleteEntry(*tables.PolicyEntry)       { o.entries-- }
func (o *countOutput) upsertEndpoint(*tables.EndpointPolicy) {}
func (o *countOutput) deleteEndpoint(string)                 {}

// heapInUse is the heap live after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkIdentitySelected: a new identity selected by 100 selectors,
// each used by the policy of 100 endpoints, reaches their entries (the
// computation; the map writes are measured by the reconciler).
func BenchmarkIdentitySelected(b *testing.B) {
	const selectors, endpoints = 100, 100
	e := newEngine(ModeDefault, false, nil)
	e.setSelector("app=web", []uint32{256})
	var rules []tables.PolicyRule
	for s := range selectors {
		rules = append(rules, egress(false, []string{fmt.Sprintf("fqdn:s%d", s)}, tcp(443, 0)))
	}
	e.setPolicy("cnp/x", []tables.PolicySpec{spec("app=web", rules...)}, false, "")
	for i := range endpoints {
		name := fmt.Sprintf("default/web-%d", i)
		e.setEndpoint(name, endpointRow(name, 256, uint64(100+i)))
	}
	out := newTableOutput()
	e.flush(out)
	b.ResetTimer()
	for i := range b.N {
		id := uint32(0x01000000 + i)
		for s := range selectors {
			e.setSelector(fmt.Sprintf("fqdn:s%d", s), []uint32{id})
		}
		out.writes = 0
		e.flush(out)
		want := 2 * endpoints // the new identity's entry, the old one's gone
		if i == 0 {
			want = endpoints
		}
		if out.writes != want {
			b.Fatalf("%d writes, want %d", out.writes, want)
		}
	}
}

// mapOutput writes the engine's output into the policy tables with the
// controller's writer, and the rows it marks pending into the pinned maps
// with the reconciler's operations, as the agent does.
type mapOutput struct {
	*writer
	db        *statedb.DB
	entries   statedb.RWTable[*tables.PolicyEntry]
	endpoints statedb.RWTable[*tables.EndpointPolicy]
	ops       reconcilers.PolicyOps
	writes    int
}

func newMapOutput(tb testing.TB, ops *reconcilers.Policy) *mapOutput {
	db := statedb.New()
	entries, err := tables.NewPolicyEntriesTable(db)
	if err != nil {
		tb.Fatal(err)
	}
	endpoints, err := tables.NewEndpointPolicyTable(db)
	if err != nil {
		tb.Fatal(err)
	}
	c := &controller{controllerParams: controllerParams{DB: db, Entries: entries, EndpointPolicy: endpoints}}
	return &mapOutput{writer: &writer{c: c}, db: db, entries: entries, endpoints: endpoints, ops: ops.Ops(entries)}
}

func (o *mapOutput) upsertEntry(e *tables.PolicyEntry) { o.writes++; o.writer.upsertEntry(e) }
func (o *mapOutput) deleteEntry(e *tables.PolicyEntry) { o.writes++; o.writer.deleteEntry(e) }

// apply commits the output and applies every pending row.
func (o *mapOutput) apply() error {
	if err := o.commit(); err != nil {
		return err
	}
	txn := o.db.ReadTxn()
	wtxn := o.db.WriteTxn(o.endpoints)
	defer wtxn.Commit()
	for row, rev := range o.endpoints.All(txn) {
		if row.Status.Kind == reconciler.StatusKindDone {
			continue
		}
		if err := o.ops.Update(context.Background(), txn, rev, row); err != nil {
			return err
		}
		o.endpoints.Insert(wtxn, row.Clone().SetStatus(reconciler.StatusDone()))
	}
	return nil
}

// BenchmarkIdentityToMap: a new identity selected by 100 selectors, each
// named by the policy of 100 endpoints, computed and written into the
// pinned policy map (the old identity's entries deleted): the issue's
// "reaching the maps of 100 endpoints".
func BenchmarkIdentityToMap(b *testing.B) {
	testenv.RequireRoot(b)
	const selectors, endpoints = 100, 100
	ops := reconcilers.NewPolicy(nil, MapMaxFlag)
	if _, err := ops.Open(testenv.BPFPinDir(b), bpf.DefaultPolicyMapMaxEntries, endpointsMax); err != nil {
		b.Fatal(err)
	}
	defer ops.Close()
	e := newEngine(ModeDefault, false, nil)
	e.setSelector("app=web", []uint32{256})
	var rules []tables.PolicyRule
	for s := range selectors {
		rules = append(rules, egress(false, []string{fmt.Sprintf("fqdn:s%d", s)}, tcp(443, 0)))
	}
	e.setPolicy("cnp/x", []tables.PolicySpec{spec("app=web", rules...)}, false, "")
	for i := range endpoints {
		name := fmt.Sprintf("default/web-%d", i)
		e.setEndpoint(name, endpointRow(name, 256, uint64(100+i)))
	}
	out := newMapOutput(b, ops)
	e.flush(out)
	if err := out.apply(); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := range b.N {
		id := uint32(0x01000000 + i)
		for s := range selectors {
			e.setSelector(fmt.Sprintf("fqdn:s%d", s), []uint32{id})
		}
		e.flush(out)
		if err := out.apply(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(out.writes)/float64(b.N), "map-ops/op")
}
