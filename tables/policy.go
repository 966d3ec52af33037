package tables

import (
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// Table names of the policy tables.
const (
	PoliciesTableName  = "policies"
	SelectorsTableName = "selectors"
)

// Policy is one CiliumNetworkPolicy or CiliumClusterwideNetworkPolicy as the
// agent understood it.
type Policy struct {
	// Name is "cnp/<namespace>/<name>" or "ccnp/<name>".
	Name string `json:"name" yaml:"name"`
	// Subjects are the selectors of the endpoints the policy applies to.
	Subjects []string `json:"subjects" yaml:"subjects"`
	// Peers are the selectors of the peers the policy allows.
	Peers []string `json:"peers" yaml:"peers"`
	// CIDRs are the prefixes the policy names, which get cidr: labels.
	CIDRs []string `json:"cidrs,omitempty" yaml:"cidrs,omitempty"`
	// Status is "OK" or "Error".
	Status string `json:"status" yaml:"status"`
	// Error says what is wrong with an invalid policy; the valid rules of
	// the other policies keep working.
	Error string `json:"error,omitempty" yaml:"error,omitempty"`
}

// Policy statuses.
const (
	PolicyOK    = "OK"
	PolicyError = "Error"
)

// TableHeader implements statedb.TableWritable.
func (*Policy) TableHeader() []string {
	return []string{"Name", "Subjects", "Peers", "CIDRs", "Status", "Error"}
}

// TableRow implements statedb.TableWritable.
func (p *Policy) TableRow() []string {
	return []string{
		p.Name, strings.Join(p.Subjects, "; "), strings.Join(p.Peers, "; "),
		strings.Join(p.CIDRs, ", "), p.Status, p.Error,
	}
}

// PolicyNameIndex is the primary index of the policies table.
var PolicyNameIndex = statedb.Index[*Policy, string]{
	Name:       "name",
	FromObject: func(p *Policy) index.KeySet { return index.NewKeySet(index.String(p.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewPoliciesTable registers the policies table with db.
func NewPoliciesTable(db *statedb.DB) (statedb.RWTable[*Policy], error) {
	return statedb.NewTable(db, PoliciesTableName, PolicyNameIndex)
}

// Selector is one distinct selector of the policies and the identities it
// selects now.
type Selector struct {
	// Selector is the selector in its canonical form: label requirements
	// "k8s:app=web, k8s:io.kubernetes.pod.namespace=default", a CIDR
	// "cidr:10.0.0.0/8" (with " except cidr:…" parts) or "fqdn:<pattern>".
	Selector string `json:"selector" yaml:"selector"`
	// Identities are the numbers of the identities selected, sorted.
	Identities []uint32 `json:"identities" yaml:"identities"`
	// Policies are the policies that use the selector.
	Policies []string `json:"policies" yaml:"policies"`
}

// Clone returns a copy whose slices may be modified.
func (s *Selector) Clone() *Selector {
	c := *s
	c.Identities = slices.Clone(s.Identities)
	c.Policies = slices.Clone(s.Policies)
	return &c
}

// TableHeader implements statedb.TableWritable.
func (*Selector) TableHeader() []string {
	return []string{"Selector", "Identities", "Policies"}
}

// TableRow implements statedb.TableWritable.
func (s *Selector) TableRow() []string {
	ids := make([]string, len(s.Identities))
	for i, id := range s.Identities {
		ids[i] = formatUint(id)
	}
	return []string{s.Selector, strings.Join(ids, ", "), strings.Join(s.Policies, ", ")}
}

// SelectorIndex is the primary index of the selectors table.
var SelectorIndex = statedb.Index[*Selector, string]{
	Name:       "selector",
	FromObject: func(s *Selector) index.KeySet { return index.NewKeySet(index.String(s.Selector)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewSelectorsTable registers the selectors table with db.
func NewSelectorsTable(db *statedb.DB) (statedb.RWTable[*Selector], error) {
	return statedb.NewTable(db, SelectorsTableName, SelectorIndex)
}

func formatUint(v uint32) string {
	return strconv.FormatUint(uint64(v), 10)
}
