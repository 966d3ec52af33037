package nodeport

import (
	"context"
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/bpf/nodeport"
	"github.com/apiary-net/apiary/tables"
)

// sourceRanges keeps nodeport_srcrange4 in step with the LoadBalancer
// frontends and their services' loadBalancerSourceRanges.
type sourceRanges struct {
	a         *attacher
	db        *statedb.DB
	services  statedb.Table[*tables.Service]
	frontends statedb.Table[*tables.Frontend]
}

func newSourceRanges(a *attacher, db *statedb.DB, services statedb.Table[*tables.Service],
	frontends statedb.Table[*tables.Frontend]) *sourceRanges {
	return &sourceRanges{a: a, db: db, services: services, frontends: frontends}
}

// desired lists the entries the frontends in txn ask for: every
// reconciled LoadBalancer frontend of a service with source ranges, by
// family.
func (s *sourceRanges) desired(txn statedb.ReadTxn) (map[nodeport.SourceRangeKey]uint8, map[nodeport.SourceRange6Key]uint8) {
	out4, out6 := map[nodeport.SourceRangeKey]uint8{}, map[nodeport.SourceRange6Key]uint8{}
	for fe := range s.frontends.All(txn) {
		if fe.Type != tables.FrontendLoadBalancer || fe.ID == 0 {
			continue
		}
		svc, _, ok := s.services.Get(txn, tables.ServiceNameIndex.Query(fe.Service))
		if !ok || !svc.SourceRangesSet {
			continue
		}
		if fe.Address.Addr.Is4() {
			for k, v := range nodeport.SourceRangeKeys(fe.ID, svc.LoadBalancerSourceRanges) {
				out4[k] = v
			}
		} else {
			for k, v := range nodeport.SourceRange6Keys(fe.ID, svc.LoadBalancerSourceRanges) {
				out6[k] = v
			}
		}
	}
	return out4, out6
}

// syncRanges makes the map hold exactly want: new entries first, then the
// strays, so that no frontend is open for a moment while its ranges
// change.
func syncRanges[K comparable](m *ebpf.Map, want map[K]uint8) error {
	for k, v := range want {
		if err := m.Put(k, v); err != nil {
			return fmt.Errorf("write a source-range map: %w", err)
		}
	}
	var (
		k     K
		v     uint8
		stray []K
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		if _, ok := want[k]; !ok {
			stray = append(stray, k)
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("iterate a source-range map: %w", err)
	}
	for _, k := range stray {
		if err := m.Delete(k); err != nil {
			return fmt.Errorf("delete from a source-range map: %w", err)
		}
	}
	return nil
}

// run writes the map whenever the frontends or services change.
func (s *sourceRanges) run(ctx context.Context, health cell.Health) error {
	for {
		txn := s.db.ReadTxn()
		_, fw := s.frontends.AllWatch(txn)
		_, sw := s.services.AllWatch(txn)
		want4, want6 := s.desired(txn)
		s.a.mu.Lock()
		m := s.a.own[nodeport.SourceRange4Map]
		m6 := s.a.own[nodeport.SourceRange6Map]
		var err error
		if m != nil && m6 != nil {
			err = errors.Join(syncRanges(m, want4), syncRanges(m6, want6))
		}
		s.a.mu.Unlock()
		switch {
		case err != nil:
			health.Degraded("source ranges", err)
		case m == nil:
			health.OK("waiting for the programs' maps")
		default:
			health.OK(fmt.Sprintf("%d source-range entries", len(want4)+len(want6)))
		}
		var attached <-chan struct{}
		if m == nil {
			attached = s.a.attached
		}
		select {
		case <-ctx.Done():
			return nil
		case <-fw:
		case <-sw:
		case <-attached:
		}
	}
}
