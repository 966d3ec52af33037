package tables

import (
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// IdentitiesTableName is the statedb name of the identities table.
const IdentitiesTableName = "identities"

// IdentityScope says which range an identity number comes from.
type IdentityScope string

// Identity scopes.
const (
	// ScopeReserved: the fixed numbers 1–10 (host, world, health, …).
	ScopeReserved IdentityScope = "reserved"
	// ScopeCluster: 256–65535, for workload (pod) label sets; the same
	// label set has the same number on every node.
	ScopeCluster IdentityScope = "cluster"
	// ScopeLocal: 0x01000001–0x0100FFFF, node-local numbers for label sets
	// made only of cidr:, fqdn: and reserved: labels.
	ScopeLocal IdentityScope = "local"
)

// MinLocalIdentity and MaxLocalIdentity bound ScopeLocal's numbers.
const (
	MinLocalIdentity uint32 = 0x01000001
	MaxLocalIdentity uint32 = 0x0100FFFF
)

// Identity is a security identity: a number standing for one set of labels.
// Each distinct label set has at most one identity.
type Identity struct {
	// ID is the number the datapath sees.
	ID uint32 `json:"id" yaml:"id"`
	// Labels is the label set the number stands for.
	Labels Labels `json:"labels" yaml:"labels"`
	// Scope is the range ID comes from.
	Scope IdentityScope `json:"scope" yaml:"scope"`
	// Source names who handed the number out: "reserved", "agent" (this
	// agent's allocator), and later "operator" or "temporary".
	Source string `json:"source" yaml:"source"`
	// RefCount is how many ipcache entries use the identity.
	RefCount uint32 `json:"refCount" yaml:"refCount"`
	// Restored is true for a number read back from the checkpoint that no
	// entry has claimed yet; it is kept for the restore grace period.
	Restored bool `json:"restored,omitempty" yaml:"restored,omitempty"`
}

// Clone returns a shallow copy; Labels is shared, as it is never modified.
func (i *Identity) Clone() *Identity {
	c := *i
	return &c
}

// TableHeader implements statedb.TableWritable.
func (*Identity) TableHeader() []string {
	return []string{"ID", "Labels", "Scope", "Source", "RefCount", "Restored"}
}

// TableRow implements statedb.TableWritable.
func (i *Identity) TableRow() []string {
	return []string{
		strconv.FormatUint(uint64(i.ID), 10), strings.Join(i.Labels, ", "), string(i.Scope), i.Source,
		strconv.FormatUint(uint64(i.RefCount), 10), strconv.FormatBool(i.Restored),
	}
}

// IdentityIDIndex is the primary index of the identities table.
var IdentityIDIndex = statedb.Index[*Identity, uint32]{
	Name:       "id",
	FromObject: func(i *Identity) index.KeySet { return index.NewKeySet(index.Uint32(i.ID)) },
	FromKey:    index.Uint32,
	FromString: index.Uint32String,
	Unique:     true,
}

// IdentityLabelsIndex finds the identity of a label set (Labels.Key()).
var IdentityLabelsIndex = statedb.Index[*Identity, string]{
	Name:       "labels",
	FromObject: func(i *Identity) index.KeySet { return index.NewKeySet(index.String(i.Labels.Key())) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewIdentitiesTable registers the identities table with db.
func NewIdentitiesTable(db *statedb.DB) (statedb.RWTable[*Identity], error) {
	return statedb.NewTable(db, IdentitiesTableName, IdentityIDIndex, IdentityLabelsIndex)
}
