package lb

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// BenchmarkServices feeds N Services with one EndpointSlice each through the
// reflector, the tables and the reconciler into real pinned maps, waits
// until every frontend is Done, then deletes them all and waits until the
// maps are empty. It reports services per second for both directions, bytes
// allocated per service, bytes the load balancer retains per service (the
// tables and the reconciler's mirror; not the event source, whose objects
// are an informer's business), and map operations per service.
//
// A cold run starts after the runtime has handed its free memory back to
// the kernel, as a freshly started agent would: every page the load
// balancer fills is faulted in, which on a virtual machine costs more than
// the work that fills it. A warm run repeats the insert and delete on the
// same hive, with the memory of a first round still mapped, as an agent
// sees it under churn. Prealloc runs use --bpf-lb-preallocate.
func BenchmarkServices(b *testing.B) {
	benchN := *benchServicesFlag
	for _, c := range []struct {
		backends             int
		warm, prealloc, ipv6 bool
	}{
		{1, false, false, false}, {1, true, false, false}, {1, false, true, false}, {1, true, true, false},
		{10, false, false, false},
		{1, false, false, true}, {1, true, false, true}, {10, false, false, true},
	} {
		name := fmt.Sprintf("services=%d/backends=%d/cold", benchN, c.backends)
		if c.warm {
			name = strings.Replace(name, "cold", "warm", 1)
		}
		var flags []string
		if c.prealloc {
			name += "/prealloc"
			flags = append(flags, "--bpf-lb-preallocate")
		}
		if c.ipv6 {
			name += "/ipv6"
		}
		b.Run(name, func(b *testing.B) {
			for range b.N {
				benchServices(b, benchN, c.backends, c.warm, c.ipv6, flags...)
			}
		})
	}
}

// benchServicesFlag is the number of services per run (-services, for
// scripts/lb-reference/compare.sh's runs of other sizes).
var benchServicesFlag = flag.Int("services", 50000, "services per BenchmarkServices and BenchmarkTableRows run")

func benchServices(b *testing.B, n, backendsPerService int, warm, ipv6 bool, flags ...string) {
	testenv.RequireRoot(b)
	b.StopTimer()
	svcs := newChanResource[*corev1.Service]()
	slices := newChanResource[*discoveryv1.EndpointSlice]()
	maxEntries := n * (backendsPerService + 2)
	db, frontends, ops, _ := startChanHive(b, testenv.BPFPinDir(b), svcs, slices,
		append(flags, fmt.Sprintf("--%s=%d", MapMaxFlag, maxEntries))...)

	// The objects exist before the clock starts, as in an informer's cache.
	svcEvents := make([]k8s.Event[*corev1.Service], n)
	sliceEvents := make([]k8s.Event[*discoveryv1.EndpointSlice], n)
	for i := range n {
		svc, slice := benchObjects(i, backendsPerService, ipv6)
		svcEvents[i] = k8s.Event[*corev1.Service]{Kind: k8s.Upsert, Key: k8s.KeyOf(svc), Object: svc}
		sliceEvents[i] = k8s.Event[*discoveryv1.EndpointSlice]{Kind: k8s.Upsert, Key: k8s.KeyOf(slice), Object: slice}
	}
	svcs.ch <- k8s.Event[*corev1.Service]{Kind: k8s.Sync}
	slices.ch <- k8s.Event[*discoveryv1.EndpointSlice]{Kind: k8s.Sync}
	insertAll := func() {
		for i := range n {
			svcEvents[i].Kind, sliceEvents[i].Kind = k8s.Upsert, k8s.Upsert
			slices.ch <- sliceEvents[i]
			svcs.ch <- svcEvents[i]
		}
	}
	deleteAll := func() {
		for i := range n {
			svcEvents[i].Kind, sliceEvents[i].Kind = k8s.Delete, k8s.Delete
			svcs.ch <- svcEvents[i]
			slices.ch <- sliceEvents[i]
		}
	}
	if warm {
		insertAll()
		waitFrontends(b, db, frontends, n, true)
		deleteAll()
		waitFrontends(b, db, frontends, 0, false)
		waitMapsEmpty(b, ops)
	}
	opsBefore := totalOps(ops)

	runtime.GC()
	if !warm {
		debug.FreeOSMemory()
	}
	var m0, m1, m2 runtime.MemStats
	runtime.ReadMemStats(&m0)
	cpu0 := cpuTime()
	start := time.Now()
	b.StartTimer()
	go insertAll()
	waitFrontends(b, db, frontends, n, true)
	b.StopTimer()
	insert := time.Since(start)
	insertCPU := cpuTime() - cpu0
	runtime.ReadMemStats(&m1)
	runtime.GC()
	runtime.ReadMemStats(&m2)
	insertOps := totalOps(ops) - opsBefore

	cpu0 = cpuTime()
	start = time.Now()
	b.StartTimer()
	go deleteAll()
	waitFrontends(b, db, frontends, 0, false)
	waitMapsEmpty(b, ops)
	b.StopTimer()
	remove := time.Since(start)
	removeCPU := cpuTime() - cpu0

	b.ReportMetric(float64(n)/insert.Seconds(), "insert-services/s")
	b.ReportMetric(float64(n)/remove.Seconds(), "delete-services/s")
	b.ReportMetric(float64(m1.TotalAlloc-m0.TotalAlloc)/float64(n), "alloc-B/service")
	b.ReportMetric(float64(int64(m2.HeapAlloc)-int64(m0.HeapAlloc))/float64(n), "retained-B/service")
	b.ReportMetric(float64(insertOps)/float64(n), "insert-map-ops/service")
	// CPU time of the whole process (the feeding goroutine's share is
	// small): against the wall time, it says how much of the two stages'
	// work overlaps.
	b.ReportMetric(float64(insertCPU.Microseconds())/float64(n), "insert-cpu-µs/service")
	b.ReportMetric(float64(removeCPU.Microseconds())/float64(n), "delete-cpu-µs/service")
}

// cpuTime is the CPU time (user and system) the process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkTableRows writes, with nothing else, the rows one service with
// one backend costs in statedb: a service, a backend, a frontend, and the
// frontend again with its status, 1000 services per write transaction as
// the reflector and the reconciler batch them. It is the floor the table
// design puts under BenchmarkServices; a cold run first hands the
// runtime's free memory back to the kernel.
func BenchmarkTableRows(b *testing.B) {
	benchN := *benchServicesFlag
	for _, heap := range []string{"cold", "warm"} {
		b.Run(fmt.Sprintf("services=%d/%s", benchN, heap), func(b *testing.B) {
			svcs := make([]*corev1.Service, benchN)
			for i := range svcs {
				svcs[i], _ = benchObjects(i, 1, false)
			}
			if heap == "warm" {
				writeTableRows(b, svcs)
			}
			b.ResetTimer()
			var retained int64
			for range b.N {
				b.StopTimer()
				var m0, m1 runtime.MemStats
				runtime.GC()
				if heap == "cold" {
					debug.FreeOSMemory()
				}
				runtime.ReadMemStats(&m0)
				b.StartTimer()
				db := writeTableRows(b, svcs)
				b.StopTimer()
				runtime.GC()
				runtime.ReadMemStats(&m1)
				runtime.KeepAlive(db)
				retained += int64(m1.HeapAlloc) - int64(m0.HeapAlloc)
				b.StartTimer()
			}
			b.ReportMetric(float64(benchN*b.N)/b.Elapsed().Seconds(), "services/s")
			if heap == "cold" {
				// A warm run's first round frees the warm-up's rows as it
				// fills its own, which blurs the difference.
				b.ReportMetric(float64(retained)/float64(benchN*b.N), "retained-B/service")
			}
		})
	}
}

func writeTableRows(b *testing.B, svcs []*corev1.Service) *statedb.DB {
	db := statedb.New()
	services, err := tables.NewServicesTable(db)
	if err != nil {
		b.Fatal(err)
	}
	frontends, _ := tables.NewFrontendsTable(db)
	backends, _ := tables.NewBackendsTable(db)
	for start := 0; start < len(svcs); start += 1000 {
		end := min(start+1000, len(svcs))
		txn := db.WriteTxn(services, frontends, backends)
		for i := start; i < end; i++ {
			svc := serviceFromK8s(svcs[i], defaultNodePortRange)
			services.Insert(txn, svc)
			addr := tables.L4Addr{Addr: netip.AddrFrom4([4]byte{10, byte(128 + i>>16), byte(i >> 8), byte(i)}), Port: 8080, Proto: tables.TCP}
			backends.Insert(txn, &tables.Backend{Address: addr, Services: []tables.BackendInstance{{Service: svc.Name, Slice: "s"}}})
			fe := desiredFrontends(svc, nil)[0]
			fe.Backends = []tables.FrontendBackend{{Address: addr}}
			fe.Status = reconciler.StatusPending()
			frontends.Insert(txn, fe)
		}
		txn.Commit()
		txn = db.WriteTxn(frontends)
		for i := start; i < end; i++ {
			addr := tables.L4Addr{Addr: netip.MustParseAddr(svcs[i].Spec.ClusterIP), Port: 80, Proto: tables.TCP}
			fe, _, _ := frontends.Get(txn, tables.FrontendAddressIndex.Query(addr))
			fe = fe.Clone()
			fe.Status = reconciler.StatusDone()
			frontends.Insert(txn, fe)
		}
		txn.Commit()
	}
	return db
}

// startChanHive starts a hive with the lb cell fed by svcs and slices,
// pinning in pinDir; it is stopped by stop or at the end of the test.
func startChanHive(tb testing.TB, pinDir string, svcs *chanResource[*corev1.Service],
	slices *chanResource[*discoveryv1.EndpointSlice], flags ...string,
) (_ *statedb.DB, _ statedb.Table[*tables.Frontend], _ *reconcilers.LB, stop func()) {
	var (
		db        *statedb.DB
		frontends statedb.Table[*tables.Frontend]
		ops       *reconcilers.LB
	)
	h := hive.NewWithOptions(core.HiveOptions(),
		statedb.Cell, health.Cell, job.Cell, metrics.Cell, bpffs.Cell, node.Cell,
		cell.Provide(
			func() k8s.Resource[*corev1.Service] { return svcs },
			func() k8s.Resource[*discoveryv1.EndpointSlice] { return slices },
		),
		Cell,
		cell.Invoke(func(d *statedb.DB, f statedb.Table[*tables.Frontend], m Maps) {
			db, frontends, ops = d, f, m.(*reconcilers.LB)
		}),
	)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	if err := fs.Parse(append([]string{
		"--bpf-pin-dir=" + pinDir, "--state-dir=" + tb.TempDir(), "--node-name=test",
	}, flags...)); err != nil {
		tb.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	if err := h.Start(log, context.Background()); err != nil {
		tb.Fatal(err)
	}
	stop = sync.OnceFunc(func() { h.Stop(log, context.Background()) })
	tb.Cleanup(stop)
	return db, frontends, ops, stop
}

// waitFrontends waits until the frontends table holds want rows, all Done
// if done is set. Rows are checked from the revision of the first one not
// yet Done on the previous look, as the reference's benchmark checks its
// table: a look at all 50,000 rows every 2 ms would take a good part of a
// core from what is measured.
func waitFrontends(b testing.TB, db *statedb.DB, frontends statedb.Table[*tables.Frontend], want int, done bool) {
	deadline := time.Now().Add(2 * time.Minute)
	var from statedb.Revision
	for time.Now().Before(deadline) {
		txn := db.ReadTxn()
		if frontends.NumObjects(txn) == want {
			ok := true
			if done {
				for fe, rev := range frontends.LowerBound(txn, statedb.ByRevision[*tables.Frontend](from)) {
					if fe.Status.Kind != reconciler.StatusKindDone {
						ok, from = false, rev
						break
					}
				}
			}
			if ok {
				return
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	b.Fatalf("frontends did not reach %d (done=%v) in time", want, done)
}

func waitMapsEmpty(b testing.TB, ops *reconcilers.LB) {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		empty := true
		err := ops.Maps(func(maps reconcilers.LBMaps) error {
			for _, bm := range maps.All() {
				m := bm.(*ebpf.Map)
				var k []byte = make([]byte, m.KeySize())
				if err := m.NextKey(nil, &k); err == nil {
					empty = false
				}
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
		if empty {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	b.Fatal("maps not empty in time")
}

func totalOps(ops *reconcilers.LB) uint64 {
	var sum uint64
	for _, name := range bpf.LBMapNames {
		sum += ops.Ops.Get(name, false) + ops.Ops.Get(name, true)
	}
	return sum
}

// benchObjects returns the i-th service and its slice: cluster IP
// 10.(96+i/65536).x.y, backends in 10.128.0.0/9; with ipv6, cluster IP
// fd00:96::i (i < 65536) and backends in fd01::/64.
func benchObjects(i, backends int, ipv6 bool) (*corev1.Service, *discoveryv1.EndpointSlice) {
	name := fmt.Sprintf("svc-%d", i)
	ip := fmt.Sprintf("10.%d.%d.%d", 96+i>>16, (i>>8)&0xff, i&0xff)
	if ipv6 {
		ip = fmt.Sprintf("fd00:96::%x", i)
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: name},
		Spec: corev1.ServiceSpec{
			ClusterIP: ip,
			Ports:     []corev1.ServicePort{{Port: 80, Protocol: corev1.ProtocolTCP}},
		},
	}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: name + "-1",
			Labels: map[string]string{discoveryv1.LabelServiceName: name}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Port: ptr.To[int32](8080)}},
	}
	if ipv6 {
		slice.AddressType = discoveryv1.AddressTypeIPv6
	}
	for j := range backends {
		k := i*backends + j
		addr := fmt.Sprintf("10.%d.%d.%d", 128+k>>16, (k>>8)&0xff, k&0xff)
		if ipv6 {
			addr = fmt.Sprintf("fd01::%x:%x", k>>16, k&0xffff)
		}
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{Addresses: []string{addr}})
	}
	return svc, slice
}

// chanResource is an event source fed by the benchmark, standing in for the
// informer so that what is measured is the load balancer.
type chanResource[T k8s.Object] struct{ ch chan k8s.Event[T] }

func newChanResource[T k8s.Object]() *chanResource[T] {
	return &chanResource[T]{ch: make(chan k8s.Event[T], 1024)}
}

func (r *chanResource[T]) Events(context.Context) <-chan k8s.Event[T] { return r.ch }
