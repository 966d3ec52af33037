package tables

import (
	"strconv"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// CTMapsTableName is the statedb name of the conntrack maps table.
const CTMapsTableName = "ct-maps"

// CTMap is one conntrack map: the size the configuration asks for, what the
// pinned map looks like after reconciliation, what the last resize carried
// over and what the last garbage collection found.
//
// The ct cell inserts the desired fields (Name, MaxEntries, SizedBy) with a
// pending status; the reconciler fills in the pin's fields; the ct cell's
// garbage collector fills in the GC fields of reconciled rows.
type CTMap struct {
	// Name is the map's name and pin file name ("ct4_global").
	Name string `json:"name" yaml:"name"`
	// MaxEntries is the desired size in entries.
	MaxEntries uint32 `json:"maxEntries" yaml:"maxEntries"`
	// SizedBy names the flag MaxEntries comes from: the map's own size flag
	// or --bpf-map-dynamic-size-ratio.
	SizedBy string `json:"sizedBy" yaml:"sizedBy"`

	// ActualMaxEntries is the size of the pinned map, 0 until reconciled.
	ActualMaxEntries uint32 `json:"actualMaxEntries" yaml:"actualMaxEntries"`
	// Pin says what the last reconciliation did with the pin: "created",
	// "reused" or "replaced", or "kept" when a resize failed and the map
	// already pinned stays in service (the status then holds the error).
	Pin string `json:"pin,omitempty" yaml:"pin,omitempty"`
	// Change says which attributes of the old pin differed when it was
	// replaced, e.g. "max entries 4096 → 8192".
	Change string `json:"change,omitempty" yaml:"change,omitempty"`
	// Copied is how many live entries were copied into the replacement.
	Copied uint64 `json:"copied" yaml:"copied"`
	// Dropped is how many live entries did not fit into a smaller
	// replacement; those that expire first are dropped.
	Dropped uint64 `json:"dropped" yaml:"dropped"`
	// Expired is how many expired entries the replacement left behind.
	Expired uint64 `json:"expired" yaml:"expired"`

	// Entries is how many entries the map held after the last garbage
	// collection (or after the replacement, before the first one).
	Entries uint64 `json:"entries" yaml:"entries"`
	// GCDeleted is how many expired entries the last garbage collection
	// deleted.
	GCDeleted uint64 `json:"gcDeleted" yaml:"gcDeleted"`
	// LastGC is when the last garbage collection of the map started, so
	// every entry that had expired by then is gone; zero if none has run.
	LastGC time.Time `json:"lastGC,omitzero" yaml:"lastGC,omitempty"`

	// Status is the reconciliation status of the pin.
	Status reconciler.Status `json:"status" yaml:"status"`
}

// Clone returns a shallow copy, for the reconciler and for writers that
// change a stored object.
func (m *CTMap) Clone() *CTMap {
	c := *m
	return &c
}

// GetStatus returns the reconciliation status.
func (m *CTMap) GetStatus() reconciler.Status {
	return m.Status
}

// SetStatus sets the reconciliation status and returns the object.
func (m *CTMap) SetStatus(s reconciler.Status) *CTMap {
	m.Status = s
	return m
}

// TableHeader implements statedb.TableWritable.
func (*CTMap) TableHeader() []string {
	return []string{"Name", "MaxEntries", "SizedBy", "ActualMaxEntries", "Pin", "Copied", "Dropped", "Expired",
		"Entries", "GCDeleted", "LastGC", "Status"}
}

// TableRow implements statedb.TableWritable.
func (m *CTMap) TableRow() []string {
	lastGC := "never"
	if !m.LastGC.IsZero() {
		lastGC = m.LastGC.Format(time.RFC3339)
	}
	status := StatusText(m.Status)
	u := func(v uint64) string { return strconv.FormatUint(v, 10) }
	return []string{
		m.Name, u(uint64(m.MaxEntries)), m.SizedBy, u(uint64(m.ActualMaxEntries)), m.Pin,
		u(m.Copied), u(m.Dropped), u(m.Expired), u(m.Entries), u(m.GCDeleted), lastGC, status,
	}
}

// CTMapNameIndex is the primary index of the conntrack maps table.
var CTMapNameIndex = statedb.Index[*CTMap, string]{
	Name:       "name",
	FromObject: func(m *CTMap) index.KeySet { return index.NewKeySet(index.String(m.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewCTMapsTable registers the conntrack maps table with db.
func NewCTMapsTable(db *statedb.DB) (statedb.RWTable[*CTMap], error) {
	return statedb.NewTable(db, CTMapsTableName, CTMapNameIndex)
}
