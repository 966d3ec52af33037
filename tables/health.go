package tables

import (
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// HealthTableName is the statedb name of the health table.
const HealthTableName = "health"

// HealthStatus is the latest report of one health scope: a module
// ("lb"), or a job or reconciler inside it ("lb.job-reconcile").
type HealthStatus struct {
	Scope   string     `json:"scope"`
	Level   cell.Level `json:"level"`
	Message string     `json:"message,omitempty"`
	Error   string     `json:"error,omitempty"`
	// Since is when the scope entered its current level.
	Since time.Time `json:"since"`
}

// Healthy reports whether the scope counts as healthy: OK, or not reported yet.
func (s *HealthStatus) Healthy() bool {
	return s.Level == cell.StatusOK || s.Level == cell.StatusUnknown
}

// TableHeader implements statedb.TableWritable.
func (*HealthStatus) TableHeader() []string {
	return []string{"Scope", "Level", "Message", "Error", "Since"}
}

// TableRow implements statedb.TableWritable.
func (s *HealthStatus) TableRow() []string {
	return []string{s.Scope, string(s.Level), s.Message, s.Error, s.Since.Format(time.RFC3339)}
}

// HealthScopeIndex is the primary index of the health table.
var HealthScopeIndex = statedb.Index[*HealthStatus, string]{
	Name:       "scope",
	FromObject: func(s *HealthStatus) index.KeySet { return index.NewKeySet(index.String(s.Scope)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// HealthLevelIndex finds the scopes at a level ("Degraded").
var HealthLevelIndex = statedb.Index[*HealthStatus, cell.Level]{
	Name: "level",
	FromObject: func(s *HealthStatus) index.KeySet {
		return index.NewKeySet(index.String(string(s.Level)))
	},
	FromKey:    func(l cell.Level) index.Key { return index.String(string(l)) },
	FromString: index.FromString,
	Unique:     false,
}

// NewHealthTable registers the health table with db.
func NewHealthTable(db *statedb.DB) (statedb.RWTable[*HealthStatus], error) {
	return statedb.NewTable(db, HealthTableName, HealthScopeIndex, HealthLevelIndex)
}
