package proxyhealth

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/tables"
)

// syncState follows whether the frontends table's changes have reached
// the maps, as kube-proxy's health server follows its proxier: an update
// is queued when a frontend is not Done, and the queue is served when
// every frontend that was waiting then is Done. Unhealthy once the oldest
// waiting change has waited longer than the timeout.
type syncState struct {
	mu      sync.Mutex
	now     func() time.Time
	timeout time.Duration
	// lastUpdated is when the frontends were last all in the maps.
	lastUpdated time.Time
	// pendingSince is when the oldest change still waiting was seen; zero
	// when none waits. markRev is the table's revision then.
	pendingSince time.Time
	markRev      statedb.Revision
}

// observe records one look at the frontends: rev is the table's revision,
// oldestPending the lowest revision of a frontend not Done (0: none), and
// failing whether one failed (it is retried with its revision unchanged
// or not: it waits either way).
func (s *syncState) observe(initialized bool, rev, oldestPending statedb.Revision, failing bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	switch {
	case initialized && oldestPending == 0:
		s.lastUpdated, s.pendingSince = now, time.Time{}
	case s.pendingSince.IsZero():
		s.pendingSince, s.markRev = now, rev
	case !failing && initialized && oldestPending > s.markRev:
		// What waited at the mark is done; newer changes wait since now.
		s.pendingSince, s.markRev = now, rev
	}
}

// proxyHealth is kube-proxy's answer on /healthz and /livez (without
// nodeEligible: the agent does not follow the Node's taints).
type proxyHealth struct {
	LastUpdated time.Time `json:"lastUpdated"`
	CurrentTime time.Time `json:"currentTime"`
	Healthy     bool      `json:"healthy"`
}

func (s *syncState) health() proxyHealth {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	return proxyHealth{
		LastUpdated: s.lastUpdated,
		CurrentTime: now,
		Healthy:     s.pendingSince.IsZero() || now.Sub(s.pendingSince) < s.timeout,
	}
}

// ServeHTTP answers /healthz and /livez as kube-proxy does: 200 when
// healthy, with lastUpdated the current time, as kube-proxy keeps it
// "recent" for older clients; 503 otherwise.
func (s *syncState) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	h := s.health()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if h.Healthy {
		h.LastUpdated = h.CurrentTime
		w.WriteHeader(http.StatusOK)
	} else {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	out, _ := json.Marshal(h)
	w.Write(out)
}

// frontendsState is what observe needs from a snapshot of the frontends.
func frontendsState(fes func(yield func(*tables.Frontend, statedb.Revision) bool)) (oldestPending statedb.Revision, failing bool) {
	for fe, rev := range fes {
		if fe.Status.Kind == reconciler.StatusKindDone {
			continue
		}
		if oldestPending == 0 || rev < oldestPending {
			oldestPending = rev
		}
		failing = failing || fe.Status.Kind == reconciler.StatusKindError
	}
	return oldestPending, failing
}

// serviceCheck answers one Service's health check node port.
type serviceCheck struct {
	name tables.ServiceName
	mu   sync.Mutex
	// endpoints is the count of the Service's ready endpoints here.
	endpoints int
	state     *syncState
}

func (c *serviceCheck) set(n int) {
	c.mu.Lock()
	c.endpoints = n
	c.mu.Unlock()
}

// ServeHTTP answers as kube-proxy's health check server does, whatever
// the path: 200 with local endpoints and the proxy healthy, 503
// otherwise, the count in the body and in
// X-Load-Balancing-Endpoint-Weight.
func (c *serviceCheck) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	c.mu.Lock()
	count := c.endpoints
	c.mu.Unlock()
	healthy := c.state.health().Healthy
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("X-Load-Balancing-Endpoint-Weight", strconv.Itoa(count))
	if count != 0 && healthy {
		w.WriteHeader(http.StatusOK)
	} else {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	fmt.Fprintf(w, "{\n\t\"service\": {\n\t\t\"namespace\": %q,\n\t\t\"name\": %q\n\t},\n\t\"localEndpoints\": %d,\n\t\"serviceProxyHealthy\": %v\n}",
		c.name.Namespace, c.name.Name, count, healthy)
}
