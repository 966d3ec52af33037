package api

import (
	"fmt"
	"net/http"
	"strconv"

	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/tables"
)

// healthzResponse is the body of /healthz.
type healthzResponse struct {
	// Status is "ok" when no scope is degraded or stopped, else "degraded".
	Status string `json:"status"`
	// Scopes is the number of health scopes reporting.
	Scopes int `json:"scopes"`
	// Unhealthy lists the degraded and stopped scopes.
	Unhealthy []*tables.HealthStatus `json:"unhealthy,omitempty"`
	// All lists every scope, when asked for with ?verbose.
	All []*tables.HealthStatus `json:"all,omitempty"`
}

// newHealthzHandler answers 200 when every scope in reg is healthy and 503
// otherwise, so that a liveness or readiness probe needs nothing but the
// status code.
func newHealthzHandler(reg *health.Registry) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		verbose, err := verboseParam(r)
		if err != nil {
			writeError(w, http.StatusBadRequest, "%v", err)
			return
		}
		// One snapshot for both the count and the unhealthy list, so they
		// agree.
		all := reg.All()
		resp := healthzResponse{Status: "ok", Scopes: len(all)}
		for _, s := range all {
			if !s.Healthy() {
				resp.Unhealthy = append(resp.Unhealthy, s)
			}
		}
		if verbose {
			resp.All = all
		}
		code := http.StatusOK
		if len(resp.Unhealthy) > 0 {
			resp.Status, code = "degraded", http.StatusServiceUnavailable
		}
		// Probes must see the current state, never a cached one.
		w.Header().Set("Cache-Control", "no-store")
		writeJSON(w, code, resp)
	})
}

// verboseParam reads ?verbose or its short form ?v; a bare parameter means
// true, otherwise the value must parse as a bool.
func verboseParam(r *http.Request) (bool, error) {
	q := r.URL.Query()
	for _, name := range []string{"verbose", "v"} {
		if !q.Has(name) {
			continue
		}
		v := q.Get(name)
		if v == "" {
			return true, nil
		}
		b, err := strconv.ParseBool(v)
		if err != nil {
			return false, fmt.Errorf("invalid ?%s=%q: want true, false, 1 or 0", name, v)
		}
		return b, nil
	}
	return false, nil
}
