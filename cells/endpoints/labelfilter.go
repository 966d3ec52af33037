package endpoints

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/apiary-net/apiary/tables"
)

// IdentityLabelsFlag names the flag, of the agent and of the operator
// alike, that adds patterns to the identity label filter. Both must use
// the same patterns: the agents look up the Identities the operator
// creates by label set.
const IdentityLabelsFlag = "identity-labels"

// IdentityLabelsHelp is the help text of IdentityLabelsFlag.
const IdentityLabelsHelp = "Patterns added to the default identity label filter, in the reference's syntax: [source:][!]regexp, " +
	"anchored at the start of the label key, ! to leave matching labels out; one pattern without ! keeps only the labels " +
	"an inclusive pattern matches. The agents and the operator must use the same patterns"

// DefaultIdentityLabels are the patterns of the reference's default filter
// (Cilium's labelsfilter): what a pod's identity is made of unless
// --identity-labels adds to them. The namespace, its labels, app.kubernetes.io
// and reserved labels count; the other labels Kubernetes and its
// controllers put on pods, which differ between the pods of one workload
// or say nothing about what it is, do not.
var DefaultIdentityLabels = []string{
	`reserved:.*`,
	`io\.kubernetes\.pod\.namespace`,
	`io\.cilium\.k8s\.namespace\.labels`,
	`app\.kubernetes\.io`,
	`io\.cilium\.k8s\.policy\.cluster`,
	`io\.cilium\.k8s\.policy\.serviceaccount`,
	`!io\.kubernetes`,
	`!kubernetes\.io`, // anywhere in the key: see unanchoredDefaults
	`!statefulset\.kubernetes\.io/pod-name`,
	`!apps\.kubernetes\.io/pod-index`,
	`!batch\.kubernetes\.io/job-completion-index`,
	`!batch\.kubernetes\.io/controller-uid`,
	`!.*beta\.kubernetes\.io`,
	`!k8s\.io`,
	`!pod-template-generation`,
	`!pod-template-hash`,
	`!controller-revision-hash`,
	`!annotation.*`,
	`!controller-uid`,
	`!etcd_node`,
}

// LabelFilter decides which labels make an identity. Each pattern is
// [source:][!]regexp: it matches a label of that source (any source when
// it has none, or "any") whose key starts with a match of the regexp, and
// counts the length of that match (the default kubernetes.io exclusion
// matches anywhere in the key, as the reference's does). A label is kept when an inclusive
// pattern (without !) matches more of its key than every exclusive one
// (with !) that matches it, or, while the patterns added to the defaults
// are all exclusive, when no exclusive pattern matches it.
type LabelFilter struct {
	patterns []labelPattern
	// inclusive: a pattern added to the defaults is inclusive, so a label
	// no inclusive pattern matches is left out.
	inclusive bool
}

type labelPattern struct {
	source  string // "" for any
	exclude bool
	// anywhere: the pattern matches anywhere in the key, counting the
	// length of the matched text (defaults only; see unanchoredDefaults).
	anywhere bool
	expr     *regexp.Regexp
}

// unanchoredDefaults are the default patterns that match anywhere in the
// key, not only at its start. The reference leaves kubernetes.io out
// wherever it appears (its pattern is not anchored there), so
// topology.kubernetes.io/zone and node.kubernetes.io/* go too; an
// inclusive pattern matching more text, app.kubernetes.io, still wins.
// The patterns of --identity-labels are always anchored.
var unanchoredDefaults = map[string]bool{`!kubernetes\.io`: true}

// NewLabelFilter returns the default filter with the patterns added.
func NewLabelFilter(added []string) (*LabelFilter, error) {
	f := &LabelFilter{}
	for _, s := range DefaultIdentityLabels {
		p, err := parseLabelPattern(s)
		if err != nil {
			panic(fmt.Sprintf("default identity label pattern %q: %v", s, err)) // a bug
		}
		p.anywhere = unanchoredDefaults[s]
		f.patterns = append(f.patterns, p)
	}
	for _, s := range added {
		for _, field := range strings.Fields(s) {
			p, err := parseLabelPattern(field)
			if err != nil {
				return nil, fmt.Errorf("--%s: %q: %w", IdentityLabelsFlag, field, err)
			}
			f.patterns = append(f.patterns, p)
			f.inclusive = f.inclusive || !p.exclude
		}
	}
	return f, nil
}

func parseLabelPattern(s string) (labelPattern, error) {
	var p labelPattern
	expr := s
	if src, rest, ok := strings.Cut(s, ":"); ok {
		p.source, expr = src, rest
	}
	if p.source == "any" {
		p.source = ""
	}
	if rest, ok := strings.CutPrefix(expr, "!"); ok {
		p.exclude, expr = true, rest
	}
	if expr == "" {
		return p, fmt.Errorf("no regular expression")
	}
	re, err := regexp.Compile(expr)
	if err != nil {
		return p, err
	}
	p.expr = re
	return p, nil
}

// match returns the length of the match of p at the start of the key of
// a label of source (anywhere in it for an unanchored default), or 0.
func (p labelPattern) match(source, key string) int {
	if p.source != "" && p.source != source {
		return 0
	}
	loc := p.expr.FindStringIndex(key)
	if loc == nil || (loc[0] != 0 && !p.anywhere) {
		return 0
	}
	// An empty match at the start still matches; count it as 1 so that
	// it is told from no match.
	return max(loc[1]-loc[0], 1)
}

// Keep reports whether a label of source with key is part of identities.
func (f *LabelFilter) Keep(source, key string) bool {
	included, excluded := 0, 0
	for _, p := range f.patterns {
		n := p.match(source, key)
		switch {
		case n == 0:
		case p.exclude:
			// The shortest exclusive match is the one an inclusive
			// pattern must beat.
			if excluded == 0 || n < excluded {
				excluded = n
			}
		default:
			included = max(included, n)
		}
	}
	return (!f.inclusive && excluded == 0) || included > excluded
}

// KeepLabel is Keep for a label "source:key[=value]".
func (f *LabelFilter) KeepLabel(label string) bool {
	source, key, _, _ := tables.SplitLabel(label)
	return f.Keep(source, key)
}
