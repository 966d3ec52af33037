package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"slices"
	"strings"
)

// errorBody is the shape of every error the API returns, so that clients
// can decode errors the same way whatever the route.
type errorBody struct {
	Error string `json:"error"`
}

// writeError answers with code and a JSON error body.
func writeError(w http.ResponseWriter, code int, format string, args ...any) {
	writeJSON(w, code, errorBody{Error: fmt.Sprintf(format, args...)})
}

// writeJSON answers with code and v as JSON.
func writeJSON(w http.ResponseWriter, code int, v any) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	// Error bodies replace whatever the failing handler meant to send.
	h.Del("Content-Length")
	w.WriteHeader(code)
	// The header is out; a failed write means the client went away and
	// there is nobody left to tell.
	_ = json.NewEncoder(w).Encode(v)
}

// notFound answers 404 for any path no route matches.
func notFound(w http.ResponseWriter, r *http.Request) {
	writeError(w, http.StatusNotFound, "no such path %q; GET / lists the routes", r.URL.Path)
}

// allowMethods answers 405 to methods other than the given ones, in the same
// JSON shape as every other error (ServeMux's own 405 is plain text).
func allowMethods(next http.Handler, methods ...string) http.Handler {
	allow := strings.Join(methods, ", ")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !slices.Contains(methods, r.Method) {
			w.Header().Set("Allow", allow)
			writeError(w, http.StatusMethodNotAllowed, "method %s not allowed on %s; use %s", r.Method, r.URL.Path, allow)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// recoverPanics turns a panic in next into a logged error and, if nothing
// was sent yet, a 500 JSON answer. Without it net/http would drop the
// connection, which clients report as an empty reply with no explanation;
// statedb v0.8.3's handler panics on write errors and on bad queries.
func recoverPanics(log *slog.Logger, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tw := &trackingWriter{ResponseWriter: w}
		defer func() {
			v := recover()
			if v == nil {
				return
			}
			if v == http.ErrAbortHandler {
				// A deliberate abort: let net/http drop the connection
				// quietly, as the handler asked.
				panic(v)
			}
			if tw.writeErr != nil || r.Context().Err() != nil {
				// Writing to a client that is gone fails, and statedb
				// panics on that; nothing is wrong with the agent.
				log.Debug("HTTP client went away",
					"method", r.Method, "path", r.URL.Path, "panic", v, "writeError", tw.writeErr)
				return
			}
			log.Error("Panic in HTTP handler",
				"method", r.Method, "path", r.URL.Path, "panic", v, "stack", string(debug.Stack()))
			if !tw.wroteHeader {
				writeError(tw, http.StatusInternalServerError, "internal error serving %s: %v", r.URL.Path, v)
			}
			// Otherwise the status is already out: returning normally at
			// least ends the response cleanly instead of dropping it.
		}()
		next.ServeHTTP(tw, r)
	})
}

// trackingWriter remembers whether the response has started and whether a
// write failed, for recoverPanics.
type trackingWriter struct {
	http.ResponseWriter
	wroteHeader bool
	writeErr    error
}

func (w *trackingWriter) WriteHeader(code int) {
	// 1xx responses are informational; the final status can still follow.
	if code >= 200 {
		w.wroteHeader = true
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *trackingWriter) Write(b []byte) (int, error) {
	w.wroteHeader = true
	n, err := w.ResponseWriter.Write(b)
	if err != nil && w.writeErr == nil {
		w.writeErr = err
	}
	return n, err
}

// Flush implements http.Flusher: statedb's /changes handler type-asserts
// its writer to http.Flusher, so the wrapper has to be one.
func (w *trackingWriter) Flush() {
	w.wroteHeader = true
	err := http.NewResponseController(w.ResponseWriter).Flush()
	if err != nil && !errors.Is(err, http.ErrNotSupported) && w.writeErr == nil {
		w.writeErr = err
	}
}

// Unwrap lets http.ResponseController reach the connection underneath.
func (w *trackingWriter) Unwrap() http.ResponseWriter {
	return w.ResponseWriter
}
