package tables

import (
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// PolicyStatusTableName is the name of the policy-status table.
const PolicyStatusTableName = "policy-status"

// PolicyStatus is what enforcing one policy on this node shows about it.
// Policy enforcement writes it, one row per row of the policies table (its
// input, which the selectors cell writes and which stays input only).
type PolicyStatus struct {
	// Name is the policy's name, as in the policies table.
	Name string `json:"name" yaml:"name"`
	// Verdicts count the connections and flows the policy's entries
	// decided on this node since the agent started.
	Verdicts VerdictCounts `json:"verdicts" yaml:"verdicts"`
	// Warnings say what enforcement found wrong with a valid policy on
	// this node, such as a port name that stands for two numbers (the rule
	// then uses neither).
	Warnings []string `json:"warnings,omitempty" yaml:"warnings,omitempty"`
}

// TableHeader implements statedb.TableWritable.
func (*PolicyStatus) TableHeader() []string {
	return []string{"Name", "Allowed", "Denied", "Audited", "Warnings"}
}

// TableRow implements statedb.TableWritable.
func (s *PolicyStatus) TableRow() []string {
	return []string{
		s.Name,
		strconv.FormatUint(s.Verdicts.Allowed, 10), strconv.FormatUint(s.Verdicts.Denied, 10),
		strconv.FormatUint(s.Verdicts.Audited, 10), strings.Join(s.Warnings, "; "),
	}
}

// PolicyStatusNameIndex is the primary index of the policy-status table.
var PolicyStatusNameIndex = statedb.Index[*PolicyStatus, string]{
	Name:       "name",
	FromObject: func(s *PolicyStatus) index.KeySet { return index.NewKeySet(index.String(s.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewPolicyStatusTable registers the policy-status table with db.
func NewPolicyStatusTable(db *statedb.DB) (statedb.RWTable[*PolicyStatus], error) {
	return statedb.NewTable(db, PolicyStatusTableName, PolicyStatusNameIndex)
}
