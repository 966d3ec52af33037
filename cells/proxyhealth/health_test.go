package proxyhealth

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/tables"
)

// The health endpoint follows the frontends as kube-proxy's follows its
// proxier: healthy while nothing waits or the oldest waiting change is
// younger than the timeout.
func TestSyncState(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	type look struct {
		at          time.Duration // after t0
		initialized bool
		rev, oldest statedb.Revision
		failing     bool
		wantHealthy bool
	}
	for _, tt := range []struct {
		name  string
		looks []look
	}{{
		name: "in sync",
		looks: []look{
			{at: 0, initialized: true, rev: 5, wantHealthy: true},
			{at: time.Hour, initialized: true, rev: 9, wantHealthy: true},
		},
	}, {
		name: "not initialized: late after the timeout",
		looks: []look{
			{at: 0, rev: 1, wantHealthy: true},
			{at: 59 * time.Second, rev: 1, wantHealthy: true},
			{at: 61 * time.Second, rev: 1, wantHealthy: false},
			{at: 62 * time.Second, initialized: true, rev: 2, wantHealthy: true},
		},
	}, {
		name: "a change that waits",
		looks: []look{
			{at: 0, initialized: true, rev: 5, oldest: 5, wantHealthy: true},
			{at: 30 * time.Second, initialized: true, rev: 6, oldest: 5, wantHealthy: true},
			{at: 61 * time.Second, initialized: true, rev: 6, oldest: 5, wantHealthy: false},
		},
	}, {
		name: "steady churn, each change served: healthy",
		looks: []look{
			{at: 0, initialized: true, rev: 5, oldest: 5, wantHealthy: true},
			{at: 40 * time.Second, initialized: true, rev: 9, oldest: 8, wantHealthy: true},
			{at: 80 * time.Second, initialized: true, rev: 14, oldest: 12, wantHealthy: true},
			{at: 120 * time.Second, initialized: true, rev: 20, oldest: 15, wantHealthy: true},
		},
	}, {
		name: "a failing frontend rewritten by retries stays late",
		looks: []look{
			{at: 0, initialized: true, rev: 5, oldest: 5, failing: true, wantHealthy: true},
			{at: 40 * time.Second, initialized: true, rev: 9, oldest: 9, failing: true, wantHealthy: true},
			{at: 80 * time.Second, initialized: true, rev: 14, oldest: 14, failing: true, wantHealthy: false},
			{at: 90 * time.Second, initialized: true, rev: 15, wantHealthy: true},
		},
	}} {
		t.Run(tt.name, func(t *testing.T) {
			now := t0
			s := &syncState{now: func() time.Time { return now }, timeout: time.Minute}
			for i, l := range tt.looks {
				now = t0.Add(l.at)
				s.observe(l.initialized, l.rev, l.oldest, l.failing)
				if got := s.health().Healthy; got != l.wantHealthy {
					t.Errorf("look %d (%+v): healthy %v", i, l, got)
				}
			}
		})
	}
}

// The answers' shape is kube-proxy's.
func TestHandlers(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tt := range []struct {
		name      string
		pending   bool
		endpoints int
		wantHz    int
		wantSvc   int
	}{
		{"healthy, endpoints", false, 2, 200, 200},
		{"healthy, no endpoint", false, 0, 200, 503},
		{"late, endpoints", true, 1, 503, 503},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := &syncState{now: func() time.Time { return now }, timeout: time.Minute, lastUpdated: now.Add(-time.Hour)}
			if tt.pending {
				s.pendingSince = now.Add(-2 * time.Minute)
			}
			rec := httptest.NewRecorder()
			s.ServeHTTP(rec, httptest.NewRequest("GET", "/healthz", nil))
			var h map[string]any
			if err := json.Unmarshal(rec.Body.Bytes(), &h); err != nil {
				t.Fatalf("%s: %v", rec.Body, err)
			}
			if rec.Code != tt.wantHz || rec.Header().Get("Content-Type") != "application/json" || h["currentTime"] != now.Format(time.RFC3339) {
				t.Errorf("/healthz: %d %v %s", rec.Code, rec.Header(), rec.Body)
			}
			// Healthy: lastUpdated is now, as kube-proxy keeps it recent.
			if wantLast := map[bool]string{true: now.Format(time.RFC3339), false: now.Add(-time.Hour).Format(time.RFC3339)}[tt.wantHz == 200]; h["lastUpdated"] != wantLast {
				t.Errorf("lastUpdated %v, want %s", h["lastUpdated"], wantLast)
			}

			c := &serviceCheck{name: tables.ServiceName{Namespace: "ns", Name: "web"}, state: s}
			c.set(tt.endpoints)
			rec = httptest.NewRecorder()
			c.ServeHTTP(rec, httptest.NewRequest("GET", "/anything", nil))
			var body struct {
				Service struct {
					Namespace, Name string
				} `json:"service"`
				LocalEndpoints      int  `json:"localEndpoints"`
				ServiceProxyHealthy bool `json:"serviceProxyHealthy"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
				t.Fatalf("%s: %v", rec.Body, err)
			}
			if rec.Code != tt.wantSvc || body.LocalEndpoints != tt.endpoints || body.Service.Namespace != "ns" || body.Service.Name != "web" ||
				body.ServiceProxyHealthy != (tt.wantHz == http.StatusOK) {
				t.Errorf("health check: %d %s", rec.Code, rec.Body)
			}
			if got := rec.Header().Get("X-Load-Balancing-Endpoint-Weight"); got != string(rune('0'+tt.endpoints)) {
				t.Errorf("X-Load-Balancing-Endpoint-Weight %q", got)
			}
		})
	}
}

func TestLocalEndpoints(t *testing.T) {
	web := tables.ServiceName{Namespace: "ns", Name: "web"}
	other := tables.ServiceName{Namespace: "ns", Name: "other"}
	addr := func(s string) tables.L4Addr {
		return tables.L4Addr{Addr: netip.MustParseAddr(s), Port: 80}
	}
	be := func(ip string, port uint16, st tables.BackendState) tables.FrontendBackend {
		a := addr(ip)
		a.Port = port
		return tables.FrontendBackend{Address: a, State: st}
	}
	fes := []*tables.Frontend{
		// The cluster IP's backends are every node's (internal policy).
		{Service: web, Type: tables.FrontendClusterIP, Address: addr("10.96.0.1"), Backends: []tables.FrontendBackend{
			be("10.0.0.1", 8080, tables.BackendActive), be("10.0.9.9", 8080, tables.BackendActive)}},
		// Two ports of one endpoint count once; a terminating one not.
		{Service: web, Type: tables.FrontendNodePort, Address: addr("192.0.2.1"), Backends: []tables.FrontendBackend{
			be("10.0.0.1", 8080, tables.BackendActive), be("10.0.0.1", 8443, tables.BackendActive),
			be("10.0.0.2", 8080, tables.BackendTerminating)}},
		{Service: web, Type: tables.FrontendLoadBalancer, Address: addr("198.51.100.1"), Backends: []tables.FrontendBackend{
			be("10.0.0.3", 8080, tables.BackendActive)}},
		{Service: other, Type: tables.FrontendNodePort, Address: addr("192.0.2.1"), Backends: []tables.FrontendBackend{
			be("10.0.0.4", 8080, tables.BackendActive)}},
	}
	seq := func(yield func(*tables.Frontend, statedb.Revision) bool) {
		for i, fe := range fes {
			fe.Status = reconciler.StatusDone()
			if !yield(fe, statedb.Revision(i+1)) {
				return
			}
		}
	}
	got := localEndpoints(seq, map[tables.ServiceName]uint16{web: 31000})
	if len(got) != 1 || got[web] != 2 {
		t.Errorf("local endpoints %v, want web: 2 (10.0.0.1, 10.0.0.3)", got)
	}
}
