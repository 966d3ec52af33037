package identity

import (
	"fmt"
	"strings"

	"github.com/cilium/hive/cell"

	"github.com/apiary-net/apiary/tables"
)

// Identity number ranges.
const (
	// MinCluster and MaxCluster bound the cluster identities of workload
	// label sets.
	MinCluster uint32 = 256
	MaxCluster uint32 = 65535
	// MinLocal and MaxLocal bound the node-local identities of CIDR and
	// FQDN label sets.
	MinLocal = tables.MinLocalIdentity
	MaxLocal = tables.MaxLocalIdentity
	// MinTemporary and MaxTemporary bound the temporary identities the
	// operator mode gives a workload label set on this node until the
	// operator's Identity for it appears.
	MinTemporary uint32 = 0x01010000
	MaxTemporary uint32 = 0x010103FF
)

// Reserved identity numbers.
const (
	IDHost          uint32 = 1
	IDWorld         uint32 = 2
	IDUnmanaged     uint32 = 3
	IDHealth        uint32 = 4
	IDInit          uint32 = 5
	IDRemoteNode    uint32 = 6
	IDKubeAPIServer uint32 = 7
	IDIngress       uint32 = 8
	IDWorldIPv4     uint32 = 9
	IDWorldIPv6     uint32 = 10
)

// Reserved returns the reserved identities with their label sets.
func Reserved() []*tables.Identity {
	mk := func(id uint32, labels ...string) *tables.Identity {
		return &tables.Identity{ID: id, Labels: tables.NewLabels(labels...), Scope: tables.ScopeReserved, Source: SourceReserved}
	}
	return []*tables.Identity{
		mk(IDHost, tables.LabelHost),
		mk(IDWorld, tables.LabelWorld),
		mk(IDUnmanaged, tables.LabelUnmanaged),
		mk(IDHealth, tables.LabelHealth),
		mk(IDInit, tables.LabelInit),
		mk(IDRemoteNode, tables.LabelRemoteNode),
		mk(IDKubeAPIServer, tables.LabelKubeAPIServer, tables.LabelRemoteNode),
		mk(IDIngress, tables.LabelIngress),
		mk(IDWorldIPv4, tables.LabelWorldIPv4),
		mk(IDWorldIPv6, tables.LabelWorldIPv6),
	}
}

// Sources of identity numbers (tables.Identity.Source).
const (
	SourceReserved = "reserved"
	SourceAgent    = "agent"
	// SourceCluster: the number of an Identity object (operator mode).
	SourceCluster = "cluster"
	// SourceTemporary: a node-local stand-in until the Identity appears.
	SourceTemporary = "temporary"
)

// ReservedFor returns the reserved identity a label set resolves to. An
// in-cluster reserved label decides whatever else the set holds (the host
// is identity 1 whatever labels its addresses carry); the world identities
// stand only for sets holding nothing else.
func ReservedFor(l tables.Labels) (uint32, bool) {
	for _, r := range []struct {
		label string
		id    uint32
	}{
		{tables.LabelHost, IDHost},
		{tables.LabelHealth, IDHealth},
		{tables.LabelIngress, IDIngress},
		{tables.LabelKubeAPIServer, IDKubeAPIServer},
		{tables.LabelRemoteNode, IDRemoteNode},
		{tables.LabelInit, IDInit},
		{tables.LabelUnmanaged, IDUnmanaged},
	} {
		if !l.Has(r.label) {
			continue
		}
		// A remote node that ClusterNetworkPolicy nodes peers select
		// (nodes: labels) gets an identity of its own label set, so that
		// the peer selects it and not every remote node; it keeps
		// reserved:remote-node, which the remote-node entity selects.
		if r.id == IDRemoteNode && hasSource(l, tables.SourceNodes) {
			return 0, false
		}
		return r.id, true
	}
	if len(l) == 1 {
		switch l[0] {
		case tables.LabelWorld:
			return IDWorld, true
		case tables.LabelWorldIPv4:
			return IDWorldIPv4, true
		case tables.LabelWorldIPv6:
			return IDWorldIPv6, true
		}
	}
	return 0, false
}

// hasSource reports whether l holds a label of source src.
func hasSource(l tables.Labels, src string) bool {
	for _, s := range l {
		if strings.HasPrefix(s, src+":") {
			return true
		}
	}
	return false
}

// ScopeOf returns the scope of the identity of a label set that has no
// reserved identity: local when every label comes from cidr:, fqdn:,
// nodes: or reserved:, cluster otherwise (a workload's labels).
func ScopeOf(l tables.Labels) tables.IdentityScope {
	for _, s := range l {
		switch src, _, _, _ := tables.SplitLabel(s); src {
		case tables.SourceCIDR, tables.SourceFQDN, tables.SourceReserved, tables.SourceNodes:
		default:
			return tables.ScopeCluster
		}
	}
	return tables.ScopeLocal
}

// ScopeOfID returns the scope whose range holds id, or "" for none.
func ScopeOfID(id uint32) tables.IdentityScope {
	switch {
	case id >= IDHost && id <= IDWorldIPv6:
		return tables.ScopeReserved
	case id >= MinCluster && id <= MaxCluster:
		return tables.ScopeCluster
	case id >= MinLocal && id <= MaxLocal:
		return tables.ScopeLocal
	case id >= MinTemporary && id <= MaxTemporary:
		// Temporary numbers stand for workload label sets.
		return tables.ScopeCluster
	}
	return ""
}

// ExhaustedError says that a range has no free number left.
type ExhaustedError struct {
	Scope       tables.IdentityScope
	First, Last uint32
}

func (e *ExhaustedError) Error() string {
	return fmt.Sprintf("%s identity space exhausted: every number in %#x–%#x is in use", e.Scope, e.First, e.Last)
}

// NumberRange hands out numbers of one range next-after-last: the number
// after the one handed out last, wrapping around, so that a number just
// released is not reused at once (a stale policy entry for it would
// otherwise apply to the new label set).
type NumberRange struct {
	scope       tables.IdentityScope
	first, last uint32
	next        uint32
	// full is set when a whole scan found no free number, and cleared when
	// one is freed: an exhausted range fails at once instead of scanning
	// all its numbers for every label set that waits for one.
	full bool
}

// NewNumberRange returns a range of first..last.
func NewNumberRange(scope tables.IdentityScope, first, last uint32) *NumberRange {
	return &NumberRange{scope: scope, first: first, last: last, next: first}
}

// Contains reports whether id lies in the range.
func (r *NumberRange) Contains(id uint32) bool {
	return id >= r.first && id <= r.last
}

// Allocate returns hint if it lies in the range and is free, else the
// first free number after the last one handed out.
func (r *NumberRange) Allocate(free func(uint32) bool, hint uint32) (uint32, error) {
	if r.Contains(hint) && free(hint) {
		r.advancePast(hint)
		return hint, nil
	}
	if !r.full {
		size := uint64(r.last-r.first) + 1
		for range size {
			cand := r.next
			r.advancePast(cand)
			if free(cand) {
				return cand, nil
			}
		}
		r.full = true
	}
	return 0, &ExhaustedError{Scope: r.scope, First: r.first, Last: r.last}
}

// Freed tells the range that a number of it is free again.
func (r *NumberRange) Freed(id uint32) {
	if r.Contains(id) {
		r.full = false
	}
}

// advancePast moves the cursor after id if id is at or after it, so that
// restored and hinted numbers are not handed out again.
func (r *NumberRange) advancePast(id uint32) {
	if id >= r.next {
		if id == r.last {
			r.next = r.first
		} else {
			r.next = id + 1
		}
	}
}

// ClusterNumbers assigns the numbers of workload (cluster-scope) label
// sets. It is the seam where the identity management mode plugs in: in the
// agent mode (this issue) the agent hands numbers out itself from
// MinCluster–MaxCluster; an operator mode would look up the cluster's
// Identity objects and hand out temporary numbers until one appears.
type ClusterNumbers interface {
	// Source names who hands the numbers out (tables.Identity.Source).
	Source() string
	// Assign returns a number for the label set; free says whether a
	// number is unused, hint is a number the set had before (0: none).
	Assign(l tables.Labels, free func(uint32) bool, hint uint32) (uint32, error)
	// Contains reports whether id is one of the numbers it hands out.
	Contains(id uint32) bool
	// Freed tells it that a number is no longer used by this node.
	Freed(id uint32)
}

// Renumberer is a ClusterNumbers whose choice for a label set can change
// after it was made (the operator mode: a temporary number until the
// Identity appears). The allocator's Renumber asks it about every cluster
// identity when Changed's channel closes.
type Renumberer interface {
	ClusterNumbers
	// SourceOf names who handed out id.
	SourceOf(id uint32) string
	// Want returns the number l should have instead of cur, or cur.
	Want(l tables.Labels, cur uint32, free func(uint32) bool) (uint32, error)
	// Changed returns a channel closed at the next change of its choices.
	Changed() <-chan struct{}
}

// ModeNumbers lets a cell outside this package supply the ClusterNumbers
// (the identity management mode); nil or empty: the agent mode.
type ModeNumbers struct {
	ClusterNumbers
}

type modeParams struct {
	cell.In

	Mode *ModeNumbers `optional:"true"`
}

func newClusterNumbers(p modeParams) ClusterNumbers {
	if p.Mode != nil && p.Mode.ClusterNumbers != nil {
		return p.Mode.ClusterNumbers
	}
	return NewAgentClusterNumbers()
}

// agentNumbers is the agent mode: numbers from MinCluster–MaxCluster,
// next-after-last.
type agentNumbers struct {
	r *NumberRange
}

// NewAgentClusterNumbers returns the agent mode's ClusterNumbers.
func NewAgentClusterNumbers() ClusterNumbers {
	return &agentNumbers{r: NewNumberRange(tables.ScopeCluster, MinCluster, MaxCluster)}
}

func (a *agentNumbers) Source() string { return SourceAgent }

func (a *agentNumbers) Assign(_ tables.Labels, free func(uint32) bool, hint uint32) (uint32, error) {
	return a.r.Allocate(free, hint)
}

func (a *agentNumbers) Contains(id uint32) bool { return a.r.Contains(id) }

func (a *agentNumbers) Freed(id uint32) { a.r.Freed(id) }
