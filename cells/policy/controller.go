package policy

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/tables"
)

// controller feeds the engine with the changes of the policies, selectors
// and endpoints tables and writes what it computes.
type controller struct {
	controllerParams

	markEntries, markEndpoints func(statedb.WriteTxn)
	// computeSeconds is the time spent computing entries (the engine),
	// writeSeconds the time spent writing them and the endpoints' rows
	// into the tables: where a change's time goes before the map.
	computeSeconds, writeSeconds prometheus.Counter
}

// mapsOpened is closed once the controller has opened the maps (the
// loader waits for it).
type mapsOpened chan struct{}

func newMapsOpened() mapsOpened { return make(mapsOpened) }

func newController(p controllerParams) *controller {
	wtxn := p.DB.WriteTxn(p.Entries, p.EndpointPolicy)
	c := &controller{
		controllerParams: p,
		markEntries:      p.Entries.RegisterInitializer(wtxn, "policy-computed"),
		markEndpoints:    p.EndpointPolicy.RegisterInitializer(wtxn, "policy-computed"),
		computeSeconds: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "compute_seconds_total",
			Help: "Time spent computing the endpoints' policy entries from the policies, selectors and endpoints (table writes not included)",
		}),
		writeSeconds: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "policy", Name: "table_write_seconds_total",
			Help: "Time spent writing the computed entries and endpoints' rows into the policy-entries and endpoint-policy tables",
		}),
	}
	wtxn.Commit()
	return c
}

// writeChunk bounds the rows of one write transaction (at endpoint
// boundaries), so that a big policy does not hold the tables for long.
const writeChunk = 2000

func (c *controller) run(ctx context.Context, health cell.Health) error {
	restored, err := c.Ops.OpenWith(c.Maps, string(c.PinDir), c.Config.BPFPolicyMapMax, endpointsMax)
	if err != nil {
		return fmt.Errorf("open policy maps: %w", err)
	}
	close(c.Opened)
	if err := c.writeAgentRow(); err != nil {
		return fmt.Errorf("write the agent's own row: %w", err)
	}
	if len(restored) > 0 {
		c.Log.Info("Read the old policy maps", "endpoints", len(restored), "entries", c.Ops.Entries())
	}
	eng := newEngine(c.Config.EnablePolicy, c.Config.PolicyAuditMode, restored)
	eng.shareMin = int(c.Config.PolicyShareMinIdentities)
	eng.denyPending = c.Config.UnclassifiedPods == UnclassifiedDeny
	trees := newPodTrees(c)
	eng.allowLocalhost = c.Config.AllowLocalhost == LocalhostAlways
	eng.dnsProxy = c.FQDN.DNSProxyAddr != "" && c.FQDN.DNSIntercept

	wtxn := c.DB.WriteTxn(c.Policies, c.Selectors, c.Endpoints)
	policies, err := c.Policies.Changes(wtxn)
	if err == nil {
		defer policies.Close()
	}
	selectors, err2 := c.Selectors.Changes(wtxn)
	if err2 == nil {
		defer selectors.Close()
	}
	endpoints, err3 := c.Endpoints.Changes(wtxn)
	if err3 == nil {
		defer endpoints.Close()
	}
	wtxn.Commit()
	ifaces, err4 := c.interfaceChanges()
	if err4 == nil {
		defer ifaces.Close()
	}
	if err := errors.Join(err, err2, err3, err4); err != nil {
		return fmt.Errorf("watch tables: %w", err)
	}

	status := newStatusRows(c.DB, c.Status)
	initDone, marked := false, false
	for {
		rtxn := c.DB.ReadTxn()
		polSeq, polWatch := policies.Next(rtxn)
		for ch := range polSeq {
			p := ch.Object
			status.policy(p.Name, ch.Deleted)
			switch {
			case ch.Deleted:
				eng.setPolicy(p.Name, nil, false, "")
			case p.Status == tables.PolicyOK:
				eng.setPolicy(p.Name, p.Specs, p.Audit, "")
			case p.FailClosed:
				// Its specs allow nothing: they deny the endpoints it
				// selects in its directions (--policy-invalid-mode).
				eng.setPolicy(p.Name, p.Specs, p.Audit, p.Error)
			default:
				eng.setPolicy(p.Name, nil, false, "")
			}
		}
		selSeq, selWatch := selectors.Next(rtxn)
		for ch := range selSeq {
			if ch.Deleted {
				eng.setSelector(ch.Object.Selector, nil)
			} else {
				eng.setSelector(ch.Object.Selector, ch.Object.Identities)
			}
		}
		epSeq, epWatch := endpoints.Next(rtxn)
		for ch := range epSeq {
			if ch.Deleted {
				eng.setEndpoint(ch.Object.Name, nil)
			} else {
				eng.setEndpoint(ch.Object.Name, ch.Object)
			}
		}
		ifSeq, ifWatch := ifaces.Next(rtxn)
		for ch := range ifSeq {
			why := ""
			if !ch.Deleted && ch.Object.FailClosed {
				why = ch.Object.Error
			}
			eng.setNoInterface(ch.Object.Name, why)
			done, peer := uint64(0), 0
			if !ch.Deleted && ch.Object.Ifindex != 0 && ch.Object.Status.Kind == reconciler.StatusKindDone {
				done, peer = ch.Object.CgroupID, ch.Object.PeerIfindex
			}
			eng.setInterfaceDone(ch.Object.Name, done, peer)
		}
		// Nothing is written until the inputs have been read whole
		// (prefixes resolved into identities, the selectors and endpoints
		// tables written from them): the maps keep enforcing what they
		// hold until then, and an unchanged restart writes nothing.
		var waitInit <-chan struct{}
		if !initDone {
			for _, t := range []statedb.TableMeta{c.IPCache, c.Policies, c.Selectors, c.Endpoints} {
				if ok, ch := t.Initialized(rtxn); !ok {
					waitInit = ch
					break
				}
			}
			initDone = waitInit == nil || c.Config.EnablePolicy == ModeNever
		}
		if initDone {
			if err := trees.sync(); err != nil {
				return fmt.Errorf("write pod tree rows: %w", err)
			}
			t0 := time.Now()
			w := &writer{c: c}
			eng.flush(w)
			err := w.commit()
			c.computeSeconds.Add((time.Since(t0) - w.elapsed).Seconds())
			c.writeSeconds.Add(w.elapsed.Seconds())
			if err != nil {
				return err
			}
			if err := status.sync(eng.warnings()); err != nil {
				return fmt.Errorf("write policy-status rows: %w", err)
			}
			c.Progress.set(c.Selectors.Revision(rtxn))
			if !marked {
				marked = true
				wtxn := c.DB.WriteTxn(c.Entries, c.EndpointPolicy)
				c.markEntries(wtxn)
				c.markEndpoints(wtxn)
				wtxn.Commit()
				c.Log.Info("Policy computed", "endpoints", len(eng.endpoints), "policies", len(eng.specs))
			}
		}
		c.reportHealth(health, eng)

		select {
		case <-ctx.Done():
			return nil
		case <-polWatch:
		case <-selWatch:
		case <-epWatch:
		case <-ifWatch:
		case <-waitInit:
		case <-time.After(podTreeRecheck):
		}
	}
}

// interfaceChanges follows the pod-interfaces table: rows failing closed
// deny their pods (see engine.setNoInterface).
func (c *controller) interfaceChanges() (statedb.ChangeIterator[*tables.PodInterface], error) {
	wtxn := c.DB.WriteTxn(c.Interfaces)
	defer wtxn.Commit()
	return c.Interfaces.Changes(wtxn)
}

func (c *controller) reportHealth(h cell.Health, eng *engine) {
	enforced, entries, noCgroup := 0, 0, 0
	// failClosed: the endpoints each invalid policy denies.
	failClosed := map[string][]string{}
	for name, ep := range eng.endpoints {
		if ep.id != 0 && (ep.ingress != tables.EnforceOff || ep.egress != tables.EnforceOff) {
			enforced++
		}
		if ep.id == 0 && c.Config.EnablePolicy != ModeNever {
			noCgroup++
		}
		for _, p := range ep.failClosed {
			failClosed[p] = append(failClosed[p], name)
		}
		entries += ep.emittedCount
	}
	msg := fmt.Sprintf("%d endpoints, %d enforced, %d entries (--%s=%s)",
		len(eng.endpoints), enforced, entries, EnableFlag, c.Config.EnablePolicy)
	if noCgroup > 0 {
		msg += fmt.Sprintf("; %d without a cgroup, not enforced", noCgroup)
	}
	if len(failClosed) == 0 {
		h.OK(msg)
		return
	}
	var parts []string
	for _, p := range slices.Sorted(maps.Keys(failClosed)) {
		eps := failClosed[p]
		slices.Sort(eps)
		parts = append(parts, fmt.Sprintf("%s (%s)", p, strings.Join(eps, ", ")))
	}
	first := slices.Min(slices.Collect(maps.Keys(failClosed)))
	h.Degraded(fmt.Sprintf("%s; failing closed on %d invalid policies: %s", msg, len(failClosed), strings.Join(parts, "; ")),
		fmt.Errorf("%s: %s", first, eng.invalid[first]))
}

// writer applies the engine's output in transactions of about writeChunk
// rows, each ending after an endpoint's row. The endpoint-policy row of
// every endpoint whose entries change is marked pending in the same
// transaction: the reconciler of that table writes the entries too.
type writer struct {
	c       *controller
	pending []func(statedb.WriteTxn) error
	// touched are the endpoints whose entries the pending changes write;
	// written, those whose row the pending changes write (marked pending
	// by them).
	touched, written map[string]struct{}
	// elapsed is the time spent in commit.
	elapsed time.Duration
}

func (w *writer) upsertEntry(e *tables.PolicyEntry) {
	w.touch(e.Endpoint)
	w.pending = append(w.pending, func(txn statedb.WriteTxn) error {
		_, _, err := w.c.Entries.Insert(txn, e)
		return err
	})
}

func (w *writer) deleteEntry(e *tables.PolicyEntry) {
	w.touch(e.Endpoint)
	w.pending = append(w.pending, func(txn statedb.WriteTxn) error {
		_, _, err := w.c.Entries.Delete(txn, e)
		return err
	})
}

func (w *writer) touch(endpoint string) {
	if w.touched == nil {
		w.touched = map[string]struct{}{}
	}
	w.touched[endpoint] = struct{}{}
}

func (w *writer) wrote(endpoint string) {
	if w.written == nil {
		w.written = map[string]struct{}{}
	}
	w.written[endpoint] = struct{}{}
}

func (w *writer) upsertEndpoint(e *tables.EndpointPolicy) {
	w.wrote(e.Name)
	e.Status = reconciler.StatusPending()
	w.pending = append(w.pending, func(txn statedb.WriteTxn) error {
		_, _, err := w.c.EndpointPolicy.Insert(txn, e)
		return err
	})
	w.endOfEndpoint()
}

func (w *writer) deleteEndpoint(name string) {
	w.wrote(name)
	w.pending = append(w.pending, func(txn statedb.WriteTxn) error {
		_, _, err := w.c.EndpointPolicy.Delete(txn, &tables.EndpointPolicy{Name: name})
		return err
	})
	w.endOfEndpoint()
}

// endOfEndpoint commits once enough rows are pending.
func (w *writer) endOfEndpoint() {
	if len(w.pending) >= writeChunk {
		// An error is kept for commit to return: the engine's output
		// cannot be interrupted.
		if err := w.commit(); err != nil {
			w.pending = append(w.pending, func(statedb.WriteTxn) error { return err })
		}
	}
}

func (w *writer) commit() error {
	if len(w.pending) == 0 {
		return nil
	}
	t0 := time.Now()
	defer func() { w.elapsed += time.Since(t0) }()
	wtxn := w.c.DB.WriteTxn(w.c.Entries, w.c.EndpointPolicy)
	defer wtxn.Abort()
	for _, f := range w.pending {
		if err := f(wtxn); err != nil {
			return fmt.Errorf("write policy tables: %w", err)
		}
	}
	// A row already pending is marked anew all the same: the reconciler
	// may be applying it with the entries before this transaction, and
	// would otherwise mark it done (the status's ID unchanged) without
	// these.
	for name := range w.touched {
		if _, ok := w.written[name]; ok {
			continue
		}
		row, _, found := w.c.EndpointPolicy.Get(wtxn, tables.EndpointPolicyNameIndex.Query(name))
		if !found {
			continue
		}
		if _, _, err := w.c.EndpointPolicy.Insert(wtxn, row.Clone().SetStatus(reconciler.StatusPending())); err != nil {
			return fmt.Errorf("write policy tables: %w", err)
		}
	}
	wtxn.Commit()
	w.pending = slices.Delete(w.pending, 0, len(w.pending))
	clear(w.touched)
	clear(w.written)
	return nil
}
