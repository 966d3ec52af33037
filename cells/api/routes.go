package api

import (
	"cmp"
	"fmt"
	"log"
	"net/http"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// route is one entry of the index at "/".
type route struct{ pattern, help string }

// newMux routes the built-in paths and the handlers added by other cells.
func newMux(p serverParams, errorLog *log.Logger) (*http.ServeMux, error) {
	routes := []route{
		{"GET " + StateDBPrefix + "/dump", "all tables as JSON"},
		{"GET " + StateDBPrefix + "/dump/{table}", "one table as JSON"},
		{"GET " + StateDBPrefix + "/query", `objects by index key; JSON body {"table", "index", "key" (base64), "lowerbound"}`},
		{"GET " + StateDBPrefix + "/changes/{table}", "the objects of a table, then its changes as they happen (NDJSON)"},
		{"GET /healthz", "200 when every module is healthy, else 503 with the unhealthy ones (?verbose lists all)"},
		{"GET /metrics", "Prometheus metrics"},
	}

	mux := http.NewServeMux()
	mux.Handle(StateDBPrefix+"/", newStateDBHandler(p.DB))
	mux.Handle("/healthz", allowMethods(newHealthzHandler(p.Registry), http.MethodGet, http.MethodHead))
	mux.Handle("/metrics", allowMethods(
		promhttp.InstrumentMetricHandler(p.Metrics, promhttp.HandlerFor(p.Metrics, promhttp.HandlerOpts{
			ErrorLog: errorLog,
			// A failing collector should cost its own series, not the scrape.
			ErrorHandling: promhttp.ContinueOnError,
			Registry:      p.Metrics,
		})),
		http.MethodGet, http.MethodHead))

	// Sorted so that the index lists them in a stable order.
	handlers := slices.SortedFunc(slices.Values(p.Handlers), func(a, b Handler) int { return cmp.Compare(a.Path, b.Path) })
	for _, h := range handlers {
		if err := handle(mux, h); err != nil {
			return nil, err
		}
		routes = append(routes, route{h.Path, "added by a cell"})
	}

	mux.Handle("/{$}", allowMethods(indexHandler(routes), http.MethodGet, http.MethodHead))
	mux.HandleFunc("/", notFound)
	return mux, nil
}

// handle registers an added handler, turning ServeMux's panic on a bad or
// clashing pattern into an error that names the pattern.
func handle(mux *http.ServeMux, h Handler) (err error) {
	if h.Path == "" || h.Handler == nil {
		return fmt.Errorf("api handler %q: needs both a path and a handler", h.Path)
	}
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("api handler %q: %v", h.Path, v)
		}
	}()
	mux.Handle(h.Path, h.Handler)
	return nil
}

// indexHandler lists the routes in plain text, for humans with curl.
func indexHandler(routes []route) http.Handler {
	var b strings.Builder
	b.WriteString("apiary HTTP API\n\n")
	width := 0
	for _, r := range routes {
		width = max(width, len(r.pattern))
	}
	for _, r := range routes {
		fmt.Fprintf(&b, "%-*s  %s\n", width, r.pattern, r.help)
	}
	page := b.String()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte(page))
	})
}
