package ipam

import (
	"context"
	"log/slog"
	"net/netip"
	"slices"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/tables"
)

// publishParams are what publishing the agent's IPs as prefixes needs. The
// ipcache cell is optional, so that IPAM works on its own.
type publishParams struct {
	cell.In

	Log      *slog.Logger
	DB       *statedb.DB
	Table    statedb.Table[*tables.AgentIP]
	Jobs     job.Group
	Prefixes ipcache.Prefixes `optional:"true"`
}

// publishPrefixes keeps one prefix per ready agent IP in the prefixes table,
// owned by ipam/<kind> and labelled reserved:health or reserved:ingress, so
// that the IP resolves to the reserved identity (4 or 8) in the ipcache.
// The ipcache map is not pruned before the first IPs are settled, so a
// restart does not drop the entries of the IPs it keeps.
func publishPrefixes(p publishParams) {
	if p.Prefixes == nil {
		return
	}
	done := p.Prefixes.RegisterInitializer("ipam")
	pub := &publisher{log: p.Log, prefixes: p.Prefixes, published: map[string][]netip.Addr{}}
	p.Jobs.Add(job.OneShot("publish-prefixes", func(ctx context.Context, health cell.Health) error {
		for {
			rows, watch := p.Table.AllWatch(p.DB.ReadTxn())
			settled := pub.sync(rows)
			if settled && done != nil {
				done()
				done = nil
			}
			select {
			case <-ctx.Done():
				return nil
			case <-watch:
			}
		}
	}))
}

// publisher remembers which IPs it published per owner.
type publisher struct {
	log       *slog.Logger
	prefixes  ipcache.Prefixes
	published map[string][]netip.Addr
}

// sync publishes the ready rows and withdraws the rest. It reports whether
// every row has settled (no allocation or release still in its first try).
func (p *publisher) sync(rows func(yield func(*tables.AgentIP, statedb.Revision) bool)) bool {
	settled := true
	want := map[string][]netip.Addr{}
	labels := map[string][]string{}
	for row := range rows {
		switch row.Status {
		case tables.AgentIPPending, tables.AgentIPReleasing:
			settled = false
		}
		if !row.Ready() {
			continue
		}
		ips := []netip.Addr{row.IP}
		if row.IPv6.IsValid() {
			ips = append(ips, row.IPv6)
		}
		want[row.Owner], labels[row.Owner] = ips, row.Labels
	}
	for owner, ips := range want {
		if slices.Equal(p.published[owner], ips) {
			continue
		}
		var changes []ipcache.Change
		for _, ip := range p.published[owner] {
			if !slices.Contains(ips, ip) {
				changes = append(changes, ipcache.Delete(tables.HostPrefix(ip), owner))
			}
		}
		for _, ip := range ips {
			changes = append(changes, ipcache.Upsert(tables.HostPrefix(ip), owner, labels[owner]...))
		}
		if _, err := p.prefixes.Update(changes...); err != nil {
			p.log.Warn("Could not publish agent IP as a prefix", "owner", owner, "error", err)
			continue
		}
		p.log.Info("Published agent IP", "owner", owner, "ips", ips)
		p.published[owner] = ips
	}
	for owner := range p.published {
		if _, ok := want[owner]; ok {
			continue
		}
		if _, err := p.prefixes.DeleteOwner(owner); err != nil {
			p.log.Warn("Could not withdraw agent IP prefix", "owner", owner, "error", err)
			continue
		}
		delete(p.published, owner)
	}
	return settled
}
