package api

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"

	"github.com/cilium/statedb"
)

// StateDBPrefix is where statedb's HTTP handler is mounted.
const StateDBPrefix = "/statedb"

// maxQueryBody bounds the /query body we buffer; a real query is a table
// name, an index name and one key, far below this.
const maxQueryBody = 1 << 20

// revisionIndex is statedb's built-in index of objects by revision, valid in
// queries on every table but not listed by TableMeta.Indexes.
const revisionIndex = "__revision__"

// newStateDBHandler serves db.HTTPHandler() under StateDBPrefix, checking
// requests first so that statedb v0.8.3 never answers an unknown table with
// an empty 200 (/dump) and never panics on an unknown index (/query): those
// become 404 and 400 with a JSON error.
func newStateDBHandler(db *statedb.DB) http.Handler {
	h := &stateDBHandler{db: db, upstream: db.HTTPHandler()}
	mux := http.NewServeMux()
	mux.Handle("/dump", h.upstream)
	mux.HandleFunc("/dump/{table}", h.tableExists)
	mux.HandleFunc("/changes/{table}", h.tableExists)
	mux.HandleFunc("/query", h.query)
	mux.HandleFunc("/tables", h.tables)
	mux.HandleFunc("/", notFound)
	// Every statedb route is a GET (/query too, with a body); HEAD is left
	// out as it would hold a /changes stream open with nothing to show.
	return allowMethods(http.StripPrefix(StateDBPrefix, mux), http.MethodGet)
}

type stateDBHandler struct {
	db       *statedb.DB
	upstream http.Handler
}

// tableExists passes /dump/{table} and /changes/{table} on to statedb if the
// table exists.
func (h *stateDBHandler) tableExists(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("table")
	if h.db.GetTable(h.db.ReadTxn(), name) == nil {
		writeError(w, http.StatusNotFound, "table %q not found", name)
		return
	}
	if strings.HasPrefix(r.URL.Path, "/changes/") {
		// statedb streams newline-delimited JSON without a Content-Type.
		w.Header().Set("Content-Type", "application/x-ndjson")
	}
	h.upstream.ServeHTTP(w, r)
}

// query validates a /query request and passes it on to statedb with its body
// rewound.
func (h *stateDBHandler) query(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxQueryBody))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			writeError(w, http.StatusRequestEntityTooLarge, "query body larger than %d bytes", tooLarge.Limit)
			return
		}
		writeError(w, http.StatusBadRequest, "read query body: %v", err)
		return
	}
	if code, err := h.checkQuery(body); err != nil {
		writeError(w, code, "%v", err)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	w.Header().Set("Content-Type", "application/x-ndjson")
	h.upstream.ServeHTTP(w, r)
}

// checkQuery returns the HTTP status and error for an invalid query body.
func (h *stateDBHandler) checkQuery(body []byte) (int, error) {
	var q statedb.QueryRequest
	if err := json.Unmarshal(body, &q); err != nil {
		return http.StatusBadRequest, fmt.Errorf(
			`malformed query: %w; want {"table": "...", "index": "...", "key": "<base64>", "lowerbound": false}`, err)
	}
	if q.Table == "" {
		return http.StatusBadRequest, errors.New(`query has no "table"`)
	}
	table := h.db.GetTable(h.db.ReadTxn(), q.Table)
	if table == nil {
		return http.StatusNotFound, fmt.Errorf("table %q not found", q.Table)
	}
	indexes := append(table.Indexes(), revisionIndex)
	valid := strings.Join(indexes, ", ")
	switch {
	case q.Index == "":
		return http.StatusBadRequest, fmt.Errorf(`query has no "index"; table %q has indexes %s`, q.Table, valid)
	case !slices.Contains(indexes, q.Index):
		return http.StatusBadRequest, fmt.Errorf("table %q has no index %q; it has %s", q.Table, q.Index, valid)
	}
	if _, err := base64.StdEncoding.DecodeString(q.Key); err != nil {
		return http.StatusBadRequest, fmt.Errorf(`query "key" is not standard base64: %w`, err)
	}
	return http.StatusOK, nil
}

// tableInfo is one entry of /statedb/tables, what `apiary db tables` prints.
type tableInfo struct {
	Name        string   `json:"name"`
	Objects     int      `json:"objects"`
	Revision    uint64   `json:"revision"`
	Indexes     []string `json:"indexes"`
	Initialized bool     `json:"initialized"`
	// Pending lists the initializers the table still waits for.
	Pending []string `json:"pending,omitempty"`
}

// tables lists every table with its size and state, sorted by name; statedb
// v0.8.3 has no such route and /dump would send every object.
func (h *stateDBHandler) tables(w http.ResponseWriter, r *http.Request) {
	txn := h.db.ReadTxn()
	metas := h.db.GetTables(txn)
	infos := make([]tableInfo, 0, len(metas))
	for _, t := range metas {
		initialized, _ := t.Initialized(txn)
		infos = append(infos, tableInfo{
			Name:        t.Name(),
			Objects:     t.NumObjects(txn),
			Revision:    t.Revision(txn),
			Indexes:     t.Indexes(),
			Initialized: initialized,
			Pending:     t.PendingInitializers(txn),
		})
	}
	slices.SortFunc(infos, func(a, b tableInfo) int { return strings.Compare(a.Name, b.Name) })
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(infos)
}
