package blockedports

import (
	"fmt"
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"

	"github.com/apiary-net/apiary/tables"
)

// TableName is the statedb name of the table, as `apiary db show` and
// db/show know it.
const TableName = "example-blocked-ports"

// BlockedPort is one port the datapath is to refuse: desired state, written
// by the cell from --example-blocked-ports, with the reconciler's result in
// Status.
type BlockedPort struct {
	Port  uint16       `json:"port" yaml:"port"`
	Proto tables.Proto `json:"proto" yaml:"proto"`
	// Status is the reconciler's: pending, done, or the error of the last
	// write of the map entry.
	Status reconciler.Status `json:"status" yaml:"status"`
}

// Key is the row's primary key, "<port>/<proto>".
func (b *BlockedPort) Key() string { return fmt.Sprintf("%d/%s", b.Port, b.Proto) }

// Clone returns a copy (the reconciler changes Status on copies).
func (b *BlockedPort) Clone() *BlockedPort { c := *b; return &c }

// GetStatus and SetStatus give the reconciler the row's status.
func (b *BlockedPort) GetStatus() reconciler.Status { return b.Status }

// SetStatus returns b with status s.
func (b *BlockedPort) SetStatus(s reconciler.Status) *BlockedPort { b.Status = s; return b }

// TableHeader implements statedb.TableWritable: the columns of db/show and
// `apiary db show`.
func (*BlockedPort) TableHeader() []string { return []string{"Port", "Protocol", "Status"} }

// TableRow implements statedb.TableWritable.
func (b *BlockedPort) TableRow() []string {
	return []string{strconv.Itoa(int(b.Port)), b.Proto.String(), tables.StatusText(b.Status)}
}

// KeyIndex is the primary index: one row per port and protocol.
var KeyIndex = statedb.Index[*BlockedPort, string]{
	Name:       "key",
	FromObject: func(b *BlockedPort) index.KeySet { return index.NewKeySet(index.String(b.Key())) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewTable creates the table and registers it with db.
func NewTable(db *statedb.DB) (statedb.RWTable[*BlockedPort], error) {
	return statedb.NewTable(db, TableName, KeyIndex)
}
