package nodeport

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// healthChecks answers each healthCheckNodePort as kube-proxy does, so
// that a cloud load balancer sends a Local service's traffic only to the
// nodes with one of its endpoints: 200 with the number of this node's
// endpoints, 503 with none.
type healthChecks struct {
	log       *slog.Logger
	db        *statedb.DB
	services  statedb.Table[*tables.Service]
	frontends statedb.Table[*tables.Frontend]

	mu      sync.Mutex
	servers map[uint16]*http.Server // by port
}

func newHealthChecks(log *slog.Logger, db *statedb.DB, services statedb.Table[*tables.Service],
	frontends statedb.Table[*tables.Frontend]) *healthChecks {
	return &healthChecks{log: log, db: db, services: services, frontends: frontends, servers: map[uint16]*http.Server{}}
}

// healthCheckBody is kube-proxy's answer.
type healthCheckBody struct {
	Service struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"service"`
	LocalEndpoints      int  `json:"localEndpoints"`
	ServiceProxyHealthy bool `json:"serviceProxyHealthy"`
}

// localEndpoints counts the distinct active backends of the service's
// external frontends: a Local service's are this node's only.
func (h *healthChecks) localEndpoints(txn statedb.ReadTxn, name tables.ServiceName) int {
	var seen []tables.L4Addr
	for fe := range h.frontends.All(txn) {
		if fe.Service != name || fe.Type == tables.FrontendClusterIP {
			continue
		}
		for _, be := range fe.Backends {
			if be.State == tables.BackendActive && !slices.Contains(seen, be.Address) {
				seen = append(seen, be.Address)
			}
		}
	}
	return len(seen)
}

func (h *healthChecks) handler(port uint16) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		txn := h.db.ReadTxn()
		var body healthCheckBody
		body.ServiceProxyHealthy = true
		for svc := range h.services.All(txn) {
			if svc.HealthCheckNodePort == port {
				body.Service.Namespace, body.Service.Name = svc.Name.Namespace, svc.Name.Name
				body.LocalEndpoints = h.localEndpoints(txn, svc.Name)
				break
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		if body.LocalEndpoints == 0 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		json.NewEncoder(w).Encode(body)
	})
}

// run keeps one server on each health check port the services name.
func (h *healthChecks) run(ctx context.Context, health cell.Health) error {
	defer h.closeAll()
	for {
		txn := h.db.ReadTxn()
		svcs, watch := h.services.AllWatch(txn)
		want := map[uint16]bool{}
		for svc := range svcs {
			if svc.HealthCheckNodePort != 0 {
				want[svc.HealthCheckNodePort] = true
			}
		}
		var errs []error
		h.mu.Lock()
		for port, srv := range h.servers {
			if !want[port] {
				srv.Close()
				delete(h.servers, port)
			}
		}
		for port := range want {
			if h.servers[port] != nil {
				continue
			}
			ln, err := net.Listen("tcp", ":"+strconv.Itoa(int(port)))
			if err != nil {
				errs = append(errs, fmt.Errorf("health check port %d: %w", port, err))
				continue
			}
			srv := &http.Server{Handler: h.handler(port)}
			h.servers[port] = srv
			go srv.Serve(ln)
		}
		n := len(h.servers)
		h.mu.Unlock()
		var retry <-chan time.Time
		if err := errors.Join(errs...); err != nil {
			health.Degraded("health check ports", err)
			// A port taken by another process may be freed.
			retry = time.After(5 * time.Second)
		} else {
			health.OK(fmt.Sprintf("%d health check ports", n))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		case <-retry:
		}
	}
}

func (h *healthChecks) closeAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for port, srv := range h.servers {
		srv.Close()
		delete(h.servers, port)
	}
}
