package proxyhealth

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// batchDelay gathers a burst of changes into one pass.
const batchDelay = 50 * time.Millisecond

type syncer struct {
	log       *slog.Logger
	cfg       Config
	db        *statedb.DB
	table     statedb.RWTable[*tables.ProxyHealthListener]
	services  statedb.Table[*tables.Service]
	frontends statedb.Table[*tables.Frontend]
	state     *syncState
	// checks are the open health check node ports, by Service.
	checks map[tables.ServiceName]*listener
}

// listener is one Service's health check node port.
type listener struct {
	port  uint16
	check *serviceCheck
	srv   *http.Server // nil when it could not listen
	err   error
}

func newSyncer(p params, now func() time.Time) *syncer {
	return &syncer{
		log: p.Log, cfg: p.Config, db: p.DB, table: p.Table, services: p.Services, frontends: p.Frontends,
		state:  &syncState{now: now, timeout: p.Config.KubeProxyHealthzTimeout},
		checks: map[tables.ServiceName]*listener{},
	}
}

func newServer(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute}
}

// serveHealthz answers /healthz and /livez on --kube-proxy-healthz-addr
// until the agent stops; a failure to listen is retried.
func (s *syncer) serveHealthz(ctx context.Context, h cell.Health) error {
	row := &tables.ProxyHealthListener{Name: tables.ProxyHealthzName, Address: s.cfg.KubeProxyHealthzAddr}
	ln, err := net.Listen("tcp", s.cfg.KubeProxyHealthzAddr)
	if err != nil {
		err = fmt.Errorf("--%s: %w", HealthzAddrFlag, err)
		row.Error = err.Error()
		s.write(row)
		return err
	}
	row.Address = ln.Addr().String()
	s.write(row)
	s.log.Info("Answering kube-proxy's health endpoint", "address", row.Address)
	mux := http.NewServeMux()
	mux.Handle("/healthz", s.state)
	mux.Handle("/livez", s.state)
	srv := newServer(mux)
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	h.OK("listening on " + row.Address)
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("--%s: %w", HealthzAddrFlag, err)
	}
	return nil
}

func (s *syncer) write(rows ...*tables.ProxyHealthListener) {
	txn := s.db.WriteTxn(s.table)
	for _, r := range rows {
		s.table.Insert(txn, r)
	}
	txn.Commit()
}

// run follows the frontends (and, with health check node ports, the
// services) until the agent stops.
func (s *syncer) run(ctx context.Context, h cell.Health) error {
	defer s.closeAll()
	for {
		txn := s.db.ReadTxn()
		initialized, initWatch := s.frontends.Initialized(txn)
		if initialized {
			initWatch = nil
		}
		fes, feWatch := s.frontends.AllWatch(txn)
		oldest, failing := frontendsState(fes)
		s.state.observe(initialized, s.frontends.Revision(txn), oldest, failing)

		var svcWatch <-chan struct{}
		if s.cfg.EnableHealthCheckNodePort {
			var svcs func(func(*tables.Service, statedb.Revision) bool)
			svcs, svcWatch = s.services.AllWatch(txn)
			want := map[tables.ServiceName]uint16{}
			for svc := range svcs {
				if svc.HealthCheckNodePort != 0 && svc.ExternalTrafficPolicy == tables.TrafficPolicyLocal {
					want[svc.Name] = svc.HealthCheckNodePort
				}
			}
			if err := s.syncChecks(want, localEndpoints(s.frontends.All(txn), want)); err != nil {
				h.Degraded("health check node ports", err)
			} else {
				h.OK(fmt.Sprintf("%d health check node ports", len(s.checks)))
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-feWatch:
		case <-svcWatch:
		case <-initWatch:
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(batchDelay):
		}
	}
}

// localEndpoints counts, per Service of want, its ready endpoints on this
// node, by address, as kube-proxy does: those of the frontends its
// external traffic policy (Local) applies to hold only this node's.
func localEndpoints(fes func(func(*tables.Frontend, statedb.Revision) bool), want map[tables.ServiceName]uint16) map[tables.ServiceName]int {
	addrs := map[tables.ServiceName]map[netip.Addr]struct{}{}
	for fe := range fes {
		if _, ok := want[fe.Service]; !ok || fe.Type == tables.FrontendClusterIP {
			continue
		}
		for _, b := range fe.Backends {
			if b.State != tables.BackendActive {
				continue
			}
			if addrs[fe.Service] == nil {
				addrs[fe.Service] = map[netip.Addr]struct{}{}
			}
			addrs[fe.Service][b.Address.Addr] = struct{}{}
		}
	}
	out := map[tables.ServiceName]int{}
	for name, set := range addrs {
		out[name] = len(set)
	}
	return out
}

// syncChecks opens the health check node ports of want, closes the ones
// no longer wanted (or moved), sets the counts and writes the table. It
// returns the errors of ports it could not open; they are tried again on
// the next change.
func (s *syncer) syncChecks(want map[tables.ServiceName]uint16, counts map[tables.ServiceName]int) error {
	for name, l := range s.checks {
		if port, ok := want[name]; !ok || port != l.port || l.srv == nil {
			s.close(name, l)
		}
	}
	var errs []error
	for name, port := range want {
		l, ok := s.checks[name]
		if !ok {
			l = s.open(name, port)
			s.checks[name] = l
		}
		l.check.set(counts[name])
		if l.err != nil {
			errs = append(errs, l.err)
		}
	}
	s.writeChecks()
	return errors.Join(errs...)
}

func (s *syncer) open(name tables.ServiceName, port uint16) *listener {
	l := &listener{port: port, check: &serviceCheck{name: name, state: s.state}}
	ln, err := net.Listen("tcp", net.JoinHostPort("", strconv.Itoa(int(port))))
	if err != nil {
		l.err = fmt.Errorf("service %s: healthCheckNodePort %d: %w", name, port, err)
		s.log.Warn("Cannot answer a health check node port", "service", name, "port", port, "error", err)
		return l
	}
	l.srv = newServer(l.check)
	go l.srv.Serve(ln)
	s.log.Info("Answering a health check node port", "service", name, "port", port)
	return l
}

func (s *syncer) close(name tables.ServiceName, l *listener) {
	if l.srv != nil {
		l.srv.Close()
		s.log.Info("Closed a health check node port", "service", name, "port", l.port)
	}
	delete(s.checks, name)
}

func (s *syncer) closeAll() {
	for name, l := range s.checks {
		s.close(name, l)
	}
}

// writeChecks makes the table's Service rows those of s.checks.
func (s *syncer) writeChecks() {
	txn := s.db.WriteTxn(s.table)
	defer txn.Commit()
	for row := range s.table.All(txn) {
		if row.Name == tables.ProxyHealthzName {
			continue
		}
		if n, err := tables.ParseServiceName(row.Name); err != nil || s.checks[n] == nil {
			s.table.Delete(txn, row)
		}
	}
	for name, l := range s.checks {
		row := &tables.ProxyHealthListener{Name: name.String(), Address: ":" + strconv.Itoa(int(l.port))}
		l.check.mu.Lock()
		row.LocalEndpoints = l.check.endpoints
		l.check.mu.Unlock()
		if l.err != nil {
			row.Error = l.err.Error()
		}
		if old, _, ok := s.table.Get(txn, tables.ProxyHealthNameIndex.Query(row.Name)); ok && *old == *row {
			continue
		}
		s.table.Insert(txn, row)
	}
}
