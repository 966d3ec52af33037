package lb

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"runtime"
	"slices"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/tables"
)

// maxBatch bounds the events applied in one write transaction, so that
// readers and the reconciler are never held up for long.
const maxBatch = 1000

// maxReportedProblems is how many invalid objects health lists by name.
const maxReportedProblems = 10

// reflector feeds Services and EndpointSlices into the tables through the
// writer, a batch of events per write transaction.
type reflector struct {
	log      *slog.Logger
	db       *statedb.DB
	w        *writer
	services k8s.Resource[*corev1.Service]
	slices   k8s.Resource[*discoveryv1.EndpointSlice]
	// initDone marks the tables initialized once both kinds have synced,
	// which lets the reconciler prune.
	initDone []func(statedb.WriteTxn)

	// sliceService is the service each EndpointSlice was last seen with.
	sliceService map[k8s.Key]tables.ServiceName
	// proxyName is --k8s-service-proxy-name: the services of other
	// proxies are left out (see servedBy).
	proxyName string
	// nodePorts is --node-port-range.
	nodePorts portRange
	// problems are the invalid objects, by "Kind namespace/name".
	problems map[string]string
	// problemsChanged says that health must be updated.
	problemsChanged bool
	// change is what the batch being applied touched.
	change *change
}

// event is a Service or EndpointSlice event, held by value: a batch is
// one allocation, not one per event.
type event struct {
	svc     k8s.Event[*corev1.Service]
	slice   k8s.Event[*discoveryv1.EndpointSlice]
	isSlice bool
	// row and parsed are what parse made of an upsert, before the
	// write transaction (parsedOK is sliceFromK8s's ok).
	row      *tables.Service
	parsed   parsedSlice
	parsedOK bool
}

// parse converts the objects of the batch's upserts into what the writer
// takes. It runs before the write transaction, which then holds the
// tables (and keeps the reconciler from writing its status back) for
// less time.
func (r *reflector) parse(batch []event) {
	for i := range batch {
		ev := &batch[i]
		switch {
		case ev.isSlice && ev.slice.Kind == k8s.Upsert:
			ev.parsed, ev.parsedOK = sliceFromK8s(ev.slice.Object)
		case !ev.isSlice && ev.svc.Kind == k8s.Upsert && servedBy(ev.svc.Object.Labels, r.proxyName):
			ev.row = serviceFromK8s(ev.svc.Object, r.nodePorts)
		}
	}
}

func (r *reflector) run(ctx context.Context, health cell.Health) error {
	svcCh := r.services.Events(ctx)
	sliceCh := r.slices.Events(ctx)
	svcSynced, sliceSynced, initialized := false, false, false
	var initial []event
	health.OK("Waiting for Services and EndpointSlices")
	var batch []event
	onSvc := func(e k8s.Event[*corev1.Service]) { batch = append(batch, event{svc: e}) }
	onSlice := func(e k8s.Event[*discoveryv1.EndpointSlice]) { batch = append(batch, event{slice: e, isSlice: true}) }
	var noWake <-chan struct{} // nil: only events (or the end) end the wait
	for {
		// The last batch's array is reused, emptied so that it keeps no
		// object alive.
		clear(batch)
		batch = batch[:0]
		// Without a wake, no event means that ctx is done or a stream
		// closed; a stream that closes after some events ends the loop on
		// the next wait, once this batch is applied.
		n, _ := k8s.ReceiveBatch2(ctx, noWake, maxBatch, svcCh, onSvc, sliceCh, onSlice)
		if n == 0 {
			return nil
		}
		if n < maxBatch {
			// Give a busy source a moment to add to the batch: one bigger
			// transaction costs less than several small ones.
			runtime.Gosched()
			k8s.DrainBatch2(maxBatch-n, svcCh, onSvc, sliceCh, onSlice)
		}

		for _, ev := range batch {
			svcSynced = svcSynced || !ev.isSlice && ev.svc.Kind == k8s.Sync
			sliceSynced = sliceSynced || ev.isSlice && ev.slice.Kind == k8s.Sync
		}
		if !initialized && !(svcSynced && sliceSynced) {
			// Until both kinds have synced, hold everything back: a
			// frontend written with only part of its backends would make
			// a restarted agent delete the slots (and release the IDs) of
			// backends whose slice has not been read yet.
			initial = append(initial, batch...)
			continue
		}
		finishInit := !initialized
		if finishInit {
			batch = append(initial, batch...)
			initial = nil
		}
		r.apply(batch, finishInit)
		if finishInit {
			initialized = true
			r.log.Info("Services and EndpointSlices synced")
		}
		if r.problemsChanged || finishInit {
			r.reportHealth(health, initialized)
			r.problemsChanged = false
		}
	}
}

// apply writes a batch of events in one write transaction.
func (r *reflector) apply(batch []event, finishInit bool) {
	r.parse(batch)
	txn := r.db.WriteTxn(r.w.services, r.w.frontends, r.w.backends)
	defer txn.Abort()
	c := r.change
	c.reset()
	for i := range batch {
		if ev := &batch[i]; ev.isSlice {
			r.applySlice(txn, ev, c)
		} else {
			r.applyService(txn, ev, c)
		}
	}
	r.w.refresh(txn, c)
	for name, problems := range c.problems {
		r.setProblem("Service "+name.String(), problems)
	}
	if finishInit {
		for _, done := range r.initDone {
			done(txn)
		}
	}
	txn.Commit()
}

func (r *reflector) applyService(txn statedb.WriteTxn, e *event, c *change) {
	ev := e.svc
	name := tables.ServiceName{Namespace: ev.Key.Namespace, Name: ev.Key.Name}
	switch ev.Kind {
	case k8s.Upsert:
		if e.row == nil {
			// Another proxy's (parse left it out): as if deleted, so
			// that labelling a served service hands it over at once.
			r.w.deleteService(txn, name, c)
			return
		}
		r.w.upsertService(txn, e.row, c)
	case k8s.Delete:
		r.w.deleteService(txn, name, c)
	}
}

// servedBy reports whether the proxy named proxyName serves an object (a
// Service or an EndpointSlice) with these labels: the value of its
// service.kubernetes.io/service-proxy-name label, or no label when
// proxyName is empty, as kube-proxy and Cilium decide it.
func servedBy(labels map[string]string, proxyName string) bool {
	v, labelled := labels[serviceProxyNameLabel]
	if !labelled {
		return proxyName == ""
	}
	return proxyName != "" && v == proxyName
}

func (r *reflector) applySlice(txn statedb.WriteTxn, e *event, c *change) {
	ev := e.slice
	prev, hadPrev := r.sliceService[ev.Key]
	switch ev.Kind {
	case k8s.Upsert:
		p, ok := e.parsed, e.parsedOK
		if _, headless := ev.Object.Labels[headlessLabel]; headless || !servedBy(ev.Object.Labels, r.proxyName) {
			// kube-proxy ignores such a slice, whatever its service
			// says: as if deleted.
			ok = false
		}
		r.setSliceProblem(ev.Key, p.errs)
		if hadPrev && (!ok || prev != p.service) {
			r.w.deleteSlice(txn, prev, ev.Key.Name, c)
			delete(r.sliceService, ev.Key)
		}
		if ok {
			r.w.upsertSlice(txn, p, c)
			r.sliceService[ev.Key] = p.service
		}
	case k8s.Delete:
		r.setSliceProblem(ev.Key, nil)
		if hadPrev {
			r.w.deleteSlice(txn, prev, ev.Key.Name, c)
			delete(r.sliceService, ev.Key)
		}
	}
}

// setSliceProblem is setProblem for an EndpointSlice. Most slices have no
// problem, now or before, and skip making the key.
func (r *reflector) setSliceProblem(key k8s.Key, problems []string) {
	if len(problems) == 0 && len(r.problems) == 0 {
		return
	}
	r.setProblem("EndpointSlice "+key.String(), problems)
}

// setProblem records what is invalid about an object; nothing clears it.
func (r *reflector) setProblem(key string, problems []string) {
	old, had := r.problems[key]
	if len(problems) == 0 {
		if had {
			delete(r.problems, key)
			r.problemsChanged = true
		}
		return
	}
	if msg := strings.Join(problems, "; "); !had || old != msg {
		r.problems[key] = msg
		r.problemsChanged = true
	}
}

// reportHealth lists the invalid objects, which are left out while
// everything else keeps working.
func (r *reflector) reportHealth(health cell.Health, initialized bool) {
	if len(r.problems) == 0 {
		if initialized {
			health.OK("Services and EndpointSlices synced")
		}
		return
	}
	keys := slices.Sorted(maps.Keys(r.problems))
	var b strings.Builder
	for i, k := range keys {
		if i == maxReportedProblems {
			fmt.Fprintf(&b, "; and %d more", len(keys)-i)
			break
		}
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(k + ": " + r.problems[k])
	}
	health.Degraded(fmt.Sprintf("%d invalid object(s); their invalid parts are left out", len(keys)),
		errors.New(b.String()))
}
