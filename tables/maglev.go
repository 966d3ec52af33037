package tables

import (
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// MaglevTableName is the statedb name of the nodeport-maglev table.
const MaglevTableName = "nodeport-maglev"

// Maglev is the Maglev lookup table one north-south frontend (NodePort,
// LoadBalancer or external IP) should have in lb_maglev, with
// --lb-algorithm=maglev: derived from the frontends table, written by
// the maglev reconciler (reconcilers.Maglev), which records its result in
// Status.
type Maglev struct {
	// Frontend is the frontend's address.
	Frontend L4Addr `json:"frontend" yaml:"frontend"`
	// ID is its service ID (rev-NAT index), the map's key.
	ID uint16 `json:"id" yaml:"id"`
	// Backends are its active backends, sorted: the table is computed
	// from their addresses alone, so every node computes the same.
	Backends []L4Addr          `json:"backends" yaml:"backends"`
	Status   reconciler.Status `json:"status" yaml:"status"`
}

// Clone returns a shallow copy; Backends is shared and must not be
// modified.
func (m *Maglev) Clone() *Maglev {
	c := *m
	return &c
}

// GetStatus returns the reconciliation status.
func (m *Maglev) GetStatus() reconciler.Status { return m.Status }

// SetStatus sets the reconciliation status and returns the object.
func (m *Maglev) SetStatus(s reconciler.Status) *Maglev {
	m.Status = s
	return m
}

// TableHeader implements statedb.TableWritable.
func (*Maglev) TableHeader() []string {
	return []string{"Frontend", "ID", "Backends", "Status"}
}

// TableRow implements statedb.TableWritable.
func (m *Maglev) TableRow() []string {
	var bes []string
	for i, b := range m.Backends {
		if i == frontendRowBackends {
			bes = append(bes, "+"+strconv.Itoa(len(m.Backends)-i))
			break
		}
		bes = append(bes, b.String())
	}
	return []string{m.Frontend.String(), strconv.Itoa(int(m.ID)), strings.Join(bes, ", "), m.Status.String()}
}

// MaglevFrontendIndex is the primary index of the nodeport-maglev table.
var MaglevFrontendIndex = statedb.Index[*Maglev, L4Addr]{
	Name:       "frontend",
	FromObject: func(m *Maglev) index.KeySet { return index.NewKeySet(m.Frontend.Key()) },
	FromKey:    L4Addr.Key,
	FromString: l4AddrFromString,
	Unique:     true,
}

// NewMaglevTable registers the nodeport-maglev table with db.
func NewMaglevTable(db *statedb.DB) (statedb.RWTable[*Maglev], error) {
	return statedb.NewTable(db, MaglevTableName, MaglevFrontendIndex)
}
