package tables

import (
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// CNIChainTableName is the statedb name of the cni-chain table.
const CNIChainTableName = "cni-chain"

// CNIChain is what the agent last did to one file of the node's CNI setup
// under --cni-chaining-mode: the configuration it chains apiary-cni into
// and the plugin binary it copies (cells/cnichain). Rewritten on every
// pass; a failed pass keeps its error here and in the module's health.
type CNIChain struct {
	// File is the path as the agent sees it (a host directory mounted in
	// the agent's container in deploy/).
	File string `json:"file" yaml:"file"`
	// State is a cnichain.State ("chained", "already chained",
	// "unchained", …), "installed"/"up to date" for the binary, or
	// "waiting" while the agent's interface programs are not pinned yet.
	State string `json:"state" yaml:"state"`
	// Error says why the file could not be chained; the file is left as
	// it was.
	Error string `json:"error,omitempty" yaml:"error,omitempty"`
}

// TableHeader implements statedb.TableWritable.
func (*CNIChain) TableHeader() []string { return []string{"File", "State", "Error"} }

// TableRow implements statedb.TableWritable.
func (c *CNIChain) TableRow() []string { return []string{c.File, c.State, c.Error} }

// CNIChainFileIndex is the primary index of the cni-chain table.
var CNIChainFileIndex = statedb.Index[*CNIChain, string]{
	Name:       "file",
	FromObject: func(c *CNIChain) index.KeySet { return index.NewKeySet(index.String(c.File)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewCNIChainTable registers the cni-chain table with db.
func NewCNIChainTable(db *statedb.DB) (statedb.RWTable[*CNIChain], error) {
	return statedb.NewTable(db, CNIChainTableName, CNIChainFileIndex)
}
