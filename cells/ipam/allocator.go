package ipam

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// Retry timing: the first retry after backoffMin, doubling up to backoffMax.
// While waiting, a change of the CNI configuration file (it appears, or is
// rewritten) cuts the wait short; it is looked at every confPollInterval.
const (
	backoffMin       = time.Second
	backoffMax       = time.Minute
	confPollInterval = 500 * time.Millisecond
	lockPollInterval = 100 * time.Millisecond
)

// allocator runs the delegated IPAM protocol for every kind.
type allocator struct {
	log     *slog.Logger
	cfg     settings
	db      *statedb.DB
	table   statedb.RWTable[*tables.AgentIP]
	health  cell.Health
	records *records
	plugins *plugins
	// ipv6 asks for an IPv6 address per kind too (--enable-ipv6).
	ipv6 bool

	// done holds the kinds that need nothing more (allocated, checked or
	// released); errs the last error of the others.
	done map[string]bool
	errs map[string]error
}

// run works on every kind until each is allocated or released, retrying
// failures with backoff. It holds the IPAM lock while it works.
//
// Not a statedb reconciler with hive's job retries: the rows are the
// protocol's outcome (the plugin chooses the IP), not desired state to
// converge, so their Status names the protocol's steps (pending, ready,
// releasing) rather than reconciler.Status; and a retry must come at once
// when the CNI configuration file appears or changes (wait), which a
// job's fixed backoff cannot do.
func (a *allocator) run(ctx context.Context, _ cell.Health) error {
	lock, err := a.lock(ctx)
	if err != nil || lock == nil {
		return err
	}
	defer lock.Close()
	a.plugins.exec.lock = lock

	backoff := backoffMin
	for {
		a.pass(ctx)
		if a.finished() {
			a.reportOK()
			return nil
		}
		a.reportDegraded()
		if !a.wait(ctx, backoff) {
			return nil
		}
		backoff = min(2*backoff, backoffMax)
	}
}

// lock takes the IPAM lock, waiting while another agent, or a plugin an
// earlier (killed) agent started, holds it. It returns nil when ctx ends.
func (a *allocator) lock(ctx context.Context) (*os.File, error) {
	reported := false
	for {
		f, err := a.records.tryLock()
		if err != nil || f != nil {
			return f, err
		}
		if !reported {
			a.log.Info("Waiting for the IPAM lock held by another process (an agent or a plugin it started)")
			a.health.Degraded("Waiting for the IPAM lock", errors.New("another agent, or a plugin started by an earlier one, holds "+a.records.dir+"/"+lockFileName))
			reported = true
		}
		select {
		case <-ctx.Done():
			return nil, nil
		case <-time.After(lockPollInterval):
		}
	}
}

// finished reports whether every kind is done.
func (a *allocator) finished() bool {
	for _, kind := range a.cfg.kindOrder {
		if !a.done[kind] {
			return false
		}
	}
	return true
}

// pass makes one attempt for every kind not done yet.
func (a *allocator) pass(ctx context.Context) {
	var d *delegate
	var confErr error
	confLoaded := false
	for _, kind := range a.cfg.kindOrder {
		if a.done[kind] || ctx.Err() != nil {
			continue
		}
		var err error
		if a.cfg.enabledKind(kind) {
			if !confLoaded {
				d, confErr = loadDelegate(a.cfg.confFile)
				confLoaded = true
			}
			err = a.ensure(ctx, kind, d, confErr)
		} else {
			err = a.release(ctx, kind)
		}
		if err != nil {
			a.errs[kind] = err
			a.log.Warn("Agent IP not ready, will retry", "kind", kind, "error", err)
			continue
		}
		delete(a.errs, kind)
		a.done[kind] = true
	}
}

// ensure gives an enabled kind its IP: keep the recorded one if the plugin
// confirms it with CHECK, else DEL (errors ignored) and ADD a new one,
// recorded before use.
func (a *allocator) ensure(ctx context.Context, kind string, d *delegate, confErr error) error {
	containerID := tables.AgentIPContainerID(kind)
	row := a.begin(kind)
	fail := func(err error) error {
		row.Status, row.Error, row.IP, row.IPv6, row.Action = tables.AgentIPError, err.Error(), netip.Addr{}, netip.Addr{}, ""
		a.put(row)
		return err
	}
	if confErr != nil {
		return fail(confErr)
	}
	row.Network, row.Plugin = d.Network, d.Plugin

	rec, err := a.records.load(kind)
	if err != nil {
		// Without a usable record, DEL and ADD below release whatever the
		// container ID holds and start afresh.
		a.log.Warn("Ignoring an unusable IPAM record", "kind", kind, "error", err)
		rec = nil
	}

	// 1. A recorded IP of the same network is kept if CHECK confirms it.
	if rec != nil && rec.Delegate.sameLease(d) && a.ipv6 && !rec.IPv6.IsValid() {
		a.log.Info("Recorded agent IP has no IPv6 address, allocating anew for dual stack", "kind", kind, "ip", rec.IP)
	} else if rec != nil && rec.Delegate.sameLease(d) {
		if d.supportsCheck() {
			err := a.check(ctx, containerID, d, rec)
			if err == nil {
				a.log.Info("Agent IP restored", "kind", kind, "ip", rec.IP, "network", d.Network)
				row.IP, row.IPv6, row.Status, row.Action, row.Error = rec.IP, netip.Addr{}, tables.AgentIPReady, "checked", ""
				if a.ipv6 {
					row.IPv6 = rec.IPv6
				}
				a.put(row)
				return nil
			}
			a.log.Info("Recorded agent IP failed CHECK, allocating a new one", "kind", kind, "ip", rec.IP, "error", err)
		} else {
			a.log.Info("CNI version has no CHECK, allocating the agent IP anew", "kind", kind, "cniVersion", d.CNIVersion)
		}
	}

	// 2. A record of another network is released through the plugin that
	// allocated it, while the record still names it; then the record goes,
	// before anything changes the container ID's leases.
	if rec != nil && !rec.Delegate.sameLease(d) {
		if _, err := a.plugins.call(ctx, "DEL", containerID, &rec.Delegate, nil); err != nil {
			a.log.Warn("DEL of the IP of the previous network failed (ignored)", "kind", kind, "network", rec.Delegate.Network, "error", err)
		}
	}
	if err := a.records.remove(kind); err != nil {
		return fail(err)
	}
	row.IP, row.IPv6 = netip.Addr{}, netip.Addr{}
	if _, err := a.plugins.call(ctx, "DEL", containerID, d, nil); err != nil {
		a.log.Debug("DEL before ADD failed (ignored)", "kind", kind, "error", err)
	}

	// 3. ADD, and record the result before anyone uses it.
	res, err := a.plugins.call(ctx, "ADD", containerID, d, nil)
	if err != nil {
		return fail(err)
	}
	ip, ip6, err := pickIPs(res, a.ipv6)
	if err == nil {
		var raw []byte
		if raw, err = resultJSON(res); err == nil {
			err = a.records.store(&record{
				Kind: kind, ContainerID: containerID, IP: ip, IPv6: ip6, Delegate: *d, Result: raw, Allocated: time.Now(),
			})
		}
	}
	if err != nil {
		// Hand the lease back rather than hold an IP nobody records; if
		// this DEL fails too, the next attempt's DEL releases it.
		if _, delErr := a.plugins.call(ctx, "DEL", containerID, d, nil); delErr != nil {
			a.log.Warn("DEL after a failed ADD failed (the next attempt retries it)", "kind", kind, "error", delErr)
		}
		return fail(fmt.Errorf("%s ADD: %w", d.Plugin, err))
	}
	attrs := []any{"kind", kind, "ip", ip, "network", d.Network, "plugin", d.Plugin}
	if ip6.IsValid() {
		attrs = append(attrs, "ipv6", ip6)
	}
	a.log.Info("Agent IP allocated", attrs...)
	row.IP, row.IPv6, row.Status, row.Action, row.Error = ip, ip6, tables.AgentIPReady, "allocated", ""
	a.put(row)
	return nil
}

// check runs CHECK for a recorded IP.
func (a *allocator) check(ctx context.Context, containerID string, d *delegate, rec *record) error {
	prev, err := prevResult(rec.Result, d.CNIVersion)
	if err != nil {
		return err
	}
	_, err = a.plugins.call(ctx, "CHECK", containerID, d, prev)
	return err
}

// release hands back the recorded IP of a disabled kind. Unlike the DEL
// before an ADD, a failed DEL here keeps the record and is retried: the
// record is the only trace of the lease.
func (a *allocator) release(ctx context.Context, kind string) error {
	rec, err := a.records.load(kind)
	if err != nil {
		// Without the record there is no telling which plugin and network
		// hold the lease; a person has to.
		return a.failRelease(kind, nil, fmt.Errorf("%w (release the lease of container ID %s by hand, then delete the file)",
			err, tables.AgentIPContainerID(kind)))
	}
	if rec == nil {
		return nil
	}
	row := a.begin(kind)
	row.Status, row.IP, row.IPv6, row.Network, row.Plugin, row.Action = tables.AgentIPReleasing, netip.Addr{}, netip.Addr{}, rec.Delegate.Network, rec.Delegate.Plugin, ""
	a.put(row)
	if _, err := a.plugins.call(ctx, "DEL", rec.ContainerID, &rec.Delegate, nil); err != nil {
		return a.failRelease(kind, row, err)
	}
	if err := a.records.remove(kind); err != nil {
		return a.failRelease(kind, row, err)
	}
	a.log.Info("Agent IP released (its kind is disabled)", "kind", kind, "ip", rec.IP, "network", rec.Delegate.Network)
	wtxn := a.db.WriteTxn(a.table)
	a.table.Delete(wtxn, row) // cannot fail: wtxn is open and locks a.table
	wtxn.Commit()
	return nil
}

func (a *allocator) failRelease(kind string, row *tables.AgentIP, err error) error {
	if row == nil {
		row = a.begin(kind)
		row.Status = tables.AgentIPReleasing
	}
	err = fmt.Errorf("release: %w", err)
	row.Error = err.Error()
	a.put(row)
	return err
}

// begin returns a copy of the kind's row (a new one if it has none) for one
// attempt.
func (a *allocator) begin(kind string) *tables.AgentIP {
	row, _, found := a.table.Get(a.db.ReadTxn(), tables.AgentIPKindIndex.Query(kind))
	if !found {
		row = newRow(kind)
	}
	row = row.Clone()
	row.Attempts++
	return row
}

func newRow(kind string) *tables.AgentIP {
	return &tables.AgentIP{
		Kind:        kind,
		Owner:       tables.AgentIPOwner(kind),
		Labels:      []string{tables.AgentIPLabel(kind)},
		ContainerID: tables.AgentIPContainerID(kind),
		Status:      tables.AgentIPPending,
		Updated:     time.Now(),
	}
}

func (a *allocator) put(row *tables.AgentIP) {
	row.Updated = time.Now()
	wtxn := a.db.WriteTxn(a.table)
	a.table.Insert(wtxn, row) // cannot fail: wtxn is open and locks a.table
	wtxn.Commit()
}

func (a *allocator) reportOK() {
	var parts []string
	for _, kind := range a.cfg.kindOrder {
		row, _, found := a.table.Get(a.db.ReadTxn(), tables.AgentIPKindIndex.Query(kind))
		if found && row.Ready() {
			part := kind + " " + row.IP.String()
			if row.IPv6.IsValid() {
				part += " " + row.IPv6.String()
			}
			parts = append(parts, part)
		}
	}
	if len(parts) == 0 {
		a.health.OK("No agent IPs to allocate")
		return
	}
	a.health.OK("Agent IPs ready: " + strings.Join(parts, ", "))
}

func (a *allocator) reportDegraded() {
	var kinds []string
	var errs []error
	for _, kind := range a.cfg.kindOrder {
		if err, ok := a.errs[kind]; ok {
			kinds = append(kinds, kind)
			errs = append(errs, fmt.Errorf("%s IP: %w", kind, err))
		}
	}
	a.health.Degraded("Agent IPs not ready: "+strings.Join(kinds, ", ")+" (retrying)", errors.Join(errs...))
}

// wait sleeps for the backoff, or less if the CNI configuration file
// changes; it returns false when ctx ends.
func (a *allocator) wait(ctx context.Context, backoff time.Duration) bool {
	deadline := time.NewTimer(backoff)
	defer deadline.Stop()
	poll := time.NewTicker(confPollInterval)
	defer poll.Stop()
	before := a.confStamp()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-deadline.C:
			return true
		case <-poll.C:
			if a.confStamp() != before {
				return true
			}
		}
	}
}

// confStamp identifies the CNI configuration file's current content
// cheaply, "" when there is none.
func (a *allocator) confStamp() string {
	if !a.cfg.enabled {
		return ""
	}
	st, err := os.Stat(a.cfg.confFile)
	if err != nil {
		return ""
	}
	return fmt.Sprint(st.ModTime().UnixNano(), st.Size(), st.Mode())
}

// initialRows returns the rows the job starts from, inserted before the hive
// starts so that readers never miss a kind: pending for the enabled kinds,
// releasing for the disabled ones that have a record.
func initialRows(cfg settings, recs *records) []*tables.AgentIP {
	var rows []*tables.AgentIP
	for _, kind := range cfg.kindOrder {
		switch {
		case cfg.enabledKind(kind):
			rows = append(rows, newRow(kind))
		case recs.exists(kind):
			row := newRow(kind)
			row.Status = tables.AgentIPReleasing
			rows = append(rows, row)
		}
	}
	return rows
}
