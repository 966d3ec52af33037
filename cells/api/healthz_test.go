package api

import (
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/cilium/hive/cell"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestHealthz(t *testing.T) {
	f := startFixture(t)

	type scope struct {
		Scope   string     `json:"scope"`
		Level   cell.Level `json:"level"`
		Message string     `json:"message"`
		Error   string     `json:"error"`
		Since   string     `json:"since"`
	}
	type body struct {
		Status    string  `json:"status"`
		Scopes    int     `json:"scopes"`
		Unhealthy []scope `json:"unhealthy"`
		All       []scope `json:"all"`
	}
	// isModule matches the scope of a module whether or not the health
	// package nests module scopes under the root scope's name.
	isModule := func(s scope, module string) bool {
		return s.Scope == module || strings.HasSuffix(s.Scope, "."+module)
	}
	find := func(ss []scope, module string) *scope {
		for i := range ss {
			if isModule(ss[i], module) {
				return &ss[i]
			}
		}
		return nil
	}

	tests := []struct {
		name   string
		before func()
		method string
		query  string
		code   int
		check  func(t *testing.T, b body)
	}{
		{
			name: "healthy", code: http.StatusOK,
			check: func(t *testing.T, b body) {
				assert.Equal(t, "ok", b.Status)
				assert.Positive(t, b.Scopes)
				assert.Empty(t, b.Unhealthy)
				assert.Empty(t, b.All, "only with ?verbose")
			},
		},
		{
			name: "healthy verbose", query: "?verbose=1", code: http.StatusOK,
			check: func(t *testing.T, b body) {
				assert.Len(t, b.All, b.Scopes)
				api := find(b.All, "api")
				require.NotNil(t, api, "the API reports into its module's scope: %v", b.All)
				assert.Equal(t, cell.StatusOK, api.Level)
				assert.Contains(t, api.Message, "Listening on 127.0.0.1:")
			},
		},
		{
			name:   "degraded",
			before: func() { f.probe.Degraded("disk on fire", errors.New("boom")) },
			code:   http.StatusServiceUnavailable,
			check: func(t *testing.T, b body) {
				assert.Equal(t, "degraded", b.Status)
				require.Len(t, b.Unhealthy, 1)
				u := b.Unhealthy[0]
				assert.True(t, isModule(u, "probe"), "scope %q", u.Scope)
				assert.Equal(t, cell.StatusDegraded, u.Level)
				assert.Equal(t, "disk on fire", u.Message)
				assert.Equal(t, "boom", u.Error)
				assert.NotEmpty(t, u.Since)
				assert.Empty(t, b.All)
			},
		},
		{
			name: "degraded verbose short", query: "?v", code: http.StatusServiceUnavailable,
			check: func(t *testing.T, b body) {
				assert.Len(t, b.Unhealthy, 1)
				assert.Len(t, b.All, b.Scopes)
				assert.NotNil(t, find(b.All, "api"))
			},
		},
		{
			name:   "recovered",
			before: func() { f.probe.OK("fine again") },
			code:   http.StatusOK,
			check:  func(t *testing.T, b body) { assert.Equal(t, "ok", b.Status) },
		},
		{name: "bad verbose", query: "?verbose=maybe", code: http.StatusBadRequest},
		{name: "POST", method: http.MethodPost, code: http.StatusMethodNotAllowed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.before != nil {
				tt.before()
			}
			r := f.do(cmpOr(tt.method, http.MethodGet), "/healthz"+tt.query, "")
			if tt.check == nil {
				requireJSONError(t, r, tt.code)
				return
			}
			require.Equal(t, tt.code, r.code, r.body)
			require.Equal(t, "application/json", r.contentType)
			var b body
			require.NoError(t, json.Unmarshal([]byte(r.body), &b), r.body)
			tt.check(t, b)
		})
	}
}
