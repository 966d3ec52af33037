package policy

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/apiary-net/apiary/cells/api"
)

// VerdictsPath is the API route that streams the policy verdicts, what
// `apiary monitor` reads.
const VerdictsPath = "/policy/verdicts"

// Query parameters of VerdictsPath. Each may be repeated; a verdict passes
// when it matches one of the values of every parameter given.
const (
	// VerdictsParamVerdict filters on Verdict.Verdict: allowed, denied or
	// audited; it also takes comma-separated values.
	VerdictsParamVerdict = "verdict"
	// VerdictsParamEndpoint filters on Verdict.Endpoint, the exact name.
	VerdictsParamEndpoint = "endpoint"
	// VerdictsParamPolicy filters on Verdict.Policy, the exact name.
	VerdictsParamPolicy = "policy"
	// VerdictsParamType filters on Verdict.Type: policy or dns.
	VerdictsParamType = "type"
)

// VerdictsDropped is a line of the stream, between verdicts, telling the
// client that verdicts it did not read in time were dropped.
type VerdictsDropped struct {
	// Dropped is how many verdicts this stream dropped since it started,
	// counted before filtering.
	Dropped uint64 `json:"dropped"`
}

// VerdictsLost is a line of the stream telling the client that the
// datapath could not hand over some verdicts.
type VerdictsLost struct {
	// Lost is how many events the datapath lost since this stream started.
	Lost uint64 `json:"lost"`
}

const (
	// monitorBuffer is how many verdicts each stream holds for a client
	// that reads slower than they are published.
	monitorBuffer = 1024
	// monitorInterval is how often a stream reports drops that no verdict
	// came to announce, and checks the datapath's lost count.
	monitorInterval = time.Second
)

// newMonitorHandler adds GET /policy/verdicts to the API: the verdicts m
// publishes, from the request on, as newline-delimited JSON, until the
// client goes away.
//
// Each line is one of: a Verdict; {"dropped": N}, before the next verdict
// and at least every second while this client loses verdicts because it
// reads too slowly (N counts all its losses so far); {"lost": N}, when the
// datapath lost events since the stream started (N counts them all).
// ?verdict=, ?endpoint=, ?policy= and ?type= filter the verdicts on the server; an
// unknown parameter or verdict is a 400 with a JSON error.
func newMonitorHandler(m *Monitor) api.HandlerOut {
	return api.HandlerOut{Handler: api.Handler{
		// With the method, so that the API's index lists it like its own
		// routes; other methods than GET and HEAD get the API's 404.
		Path:    http.MethodGet + " " + VerdictsPath,
		Handler: &monitorHandler{monitor: m, buffer: monitorBuffer, interval: monitorInterval},
	}}
}

// monitorHandler serves VerdictsPath.
type monitorHandler struct {
	monitor  *Monitor
	buffer   int
	interval time.Duration
}

// verdictFilter is what the query of a stream asks for; an empty field
// accepts anything.
type verdictFilter struct {
	verdicts, endpoints, policies, types []string
}

// parseVerdictFilter reads the query parameters of VerdictsPath.
func parseVerdictFilter(q url.Values) (verdictFilter, error) {
	var f verdictFilter
	// Sorted, so that of several bad parameters the same one is named.
	for _, name := range slices.Sorted(maps.Keys(q)) {
		values := q[name]
		switch name {
		case VerdictsParamVerdict:
			for _, v := range values {
				for part := range strings.SplitSeq(v, ",") {
					part = strings.ToLower(strings.TrimSpace(part))
					switch part {
					case VerdictAllowed, VerdictDenied, VerdictAudited:
						f.verdicts = append(f.verdicts, part)
					default:
						return f, fmt.Errorf("invalid ?%s=%q: want %s, %s or %s",
							name, v, VerdictAllowed, VerdictDenied, VerdictAudited)
					}
				}
			}
		case VerdictsParamType:
			for _, v := range values {
				switch v {
				case VerdictTypePolicy, VerdictTypeDNS:
					f.types = append(f.types, v)
				default:
					return f, fmt.Errorf("invalid ?%s=%q: want %s or %s", name, v, VerdictTypePolicy, VerdictTypeDNS)
				}
			}
		case VerdictsParamEndpoint, VerdictsParamPolicy:
			for _, v := range values {
				if v == "" {
					return f, fmt.Errorf("invalid ?%s=: empty; want a name", name)
				}
			}
			if name == VerdictsParamEndpoint {
				f.endpoints = values
			} else {
				f.policies = values
			}
		default:
			// A mistyped filter would otherwise stream everything.
			return f, fmt.Errorf("unknown parameter ?%s: want %s, %s, %s or %s",
				name, VerdictsParamVerdict, VerdictsParamEndpoint, VerdictsParamPolicy, VerdictsParamType)
		}
	}
	return f, nil
}

// match reports whether v passes the filter.
func (f verdictFilter) match(v *Verdict) bool {
	ok := func(allowed []string, s string) bool { return len(allowed) == 0 || slices.Contains(allowed, s) }
	return ok(f.verdicts, v.Verdict) && ok(f.endpoints, v.Endpoint) && ok(f.policies, v.Policy) && ok(f.types, v.Type)
}

func (h *monitorHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		// HEAD would hold a stream open with nothing to show.
		w.Header().Set("Allow", http.MethodGet)
		writeJSONError(w, http.StatusMethodNotAllowed, "method %s not allowed on %s; use GET", r.Method, r.URL.Path)
		return
	}
	filter, err := parseVerdictFilter(r.URL.Query())
	if err != nil {
		writeJSONError(w, http.StatusBadRequest, "%v", err)
		return
	}

	verdicts, dropped, cancel := h.monitor.Subscribe(h.buffer)
	defer cancel()
	s := &verdictStream{
		w:        w,
		rc:       http.NewResponseController(w),
		dropped:  dropped,
		lastLost: h.monitor.Lost(),
	}

	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusOK)
	// The client learns at once that it is subscribed, not with the first
	// verdict.
	if err := s.rc.Flush(); err != nil {
		return
	}

	ticker := time.NewTicker(h.interval)
	defer ticker.Stop()
	ctx := r.Context()
	for {
		select {
		case <-ctx.Done():
			return
		case v, ok := <-verdicts:
			if !ok {
				return
			}
			if err := s.reportDropped(); err != nil {
				return
			}
			if !filter.match(&v) {
				continue
			}
			if err := s.writeLine(&v); err != nil {
				return
			}
		case <-ticker.C:
			if err := s.reportDropped(); err != nil {
				return
			}
			if err := s.reportLost(h.monitor.Lost()); err != nil {
				return
			}
		}
	}
}

// verdictStream writes the lines of one client's stream and remembers what
// it has told the client.
type verdictStream struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	dropped func() uint64

	// sentDropped is the drop count of the last {"dropped"} line.
	sentDropped uint64
	// lastLost is the datapath's lost count when last looked at, lost the
	// total since the stream started.
	lastLost, lost uint64
}

// writeLine writes v as one JSON line and flushes it to the client; an
// error means the client is gone.
func (s *verdictStream) writeLine(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode %T: %w", v, err)
	}
	if _, err := s.w.Write(append(b, '\n')); err != nil {
		return err
	}
	return s.rc.Flush()
}

// reportDropped writes {"dropped": N} if this client lost verdicts since
// the last such line.
func (s *verdictStream) reportDropped() error {
	d := s.dropped()
	if d <= s.sentDropped {
		return nil
	}
	s.sentDropped = d
	return s.writeLine(VerdictsDropped{Dropped: d})
}

// reportLost writes {"lost": N} if the datapath's lost count, now cur, grew
// since it was last looked at. A count that went down was reset (the
// programs' counters were created anew) and counts from zero.
func (s *verdictStream) reportLost(cur uint64) error {
	delta := cur - s.lastLost
	if cur < s.lastLost {
		delta = cur
	}
	s.lastLost = cur
	if delta == 0 {
		return nil
	}
	s.lost += delta
	return s.writeLine(VerdictsLost{Lost: s.lost})
}

// writeJSONError answers with code and the API's JSON error body,
// {"error": "..."}.
func writeJSONError(w http.ResponseWriter, code int, format string, args ...any) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	// A failed write means the client went away; nobody is left to tell.
	_ = json.NewEncoder(w).Encode(struct {
		Error string `json:"error"`
	}{fmt.Sprintf(format, args...)})
}
