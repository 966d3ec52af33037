// Package pattern implements the DNS name patterns of toFQDNs selectors:
// matchName (an exact name) and matchPattern (with wildcards).
//
// Rules, for both: names and patterns are case-insensitive and a trailing
// dot is implied ("www.cilium.io" and "WWW.cilium.io." are the same). In a
// pattern:
//
//   - `*` matches zero or more name characters ([-a-z0-9_]) inside one
//     label: `*.cilium.io` matches `www.cilium.io` but neither `cilium.io`
//     nor `a.b.cilium.io`; `sub*.cilium.io` matches `sub.cilium.io`.
//   - a leading `**.` (two or more stars, then a dot) matches one or more
//     whole labels: `**.cilium.io` matches `a.cilium.io` and
//     `a.b.cilium.io`, not `cilium.io`. Elsewhere `**` is the same as `*`.
//   - a pattern of only stars (`*`, `**`, `*.`) matches every name.
package pattern

import (
	"fmt"
	"strings"
)

// MaxLen is the longest name or pattern accepted, in characters, without
// the trailing dot.
const MaxLen = 255

// Pattern is a parsed matchName or matchPattern.
type Pattern struct {
	text   string   // normalised: lowercase, no trailing dot
	all    bool     // only stars: every name
	deep   bool     // leading "**.": one or more labels, then labels
	labels []string // the labels to match, after the "**." if deep
}

// Normalize returns name in the form patterns are matched against and names
// are stored in: lowercase, surrounding space and the trailing dot removed.
// The root name "." becomes "". A name is in the presentation form miekg/dns
// gives it: a label holding a literal dot has it escaped ("x\.ok.com." is
// the two labels "x.ok" and "com"), and such a dot is no trailing dot.
func Normalize(name string) string {
	name = strings.ToLower(strings.TrimSpace(name))
	if strings.HasSuffix(name, ".") && !escapedAt(name, len(name)-1) {
		name = name[:len(name)-1]
	}
	return name
}

// escapedAt tells whether the character at i of a name in presentation
// form is escaped: preceded by an odd number of backslashes.
func escapedAt(name string, i int) bool {
	n := 0
	for j := i - 1; j >= 0 && name[j] == '\\'; j-- {
		n++
	}
	return n%2 == 1
}

// splitLabels splits a normalised name into its labels at the dots that
// are not escaped. A label keeps its escapes ("x\.ok"), which no pattern
// character matches: a label with a literal dot (or any escaped byte) is
// matched only by a leading "**." as a whole label, never split into two.
func splitLabels(name string) []string {
	if !strings.Contains(name, "\\") {
		return strings.Split(name, ".")
	}
	var labels []string
	start := 0
	for i := 0; i < len(name); i++ {
		switch name[i] {
		case '\\':
			i++ // the escaped character, or the first digit of \DDD
		case '.':
			labels = append(labels, name[start:i])
			start = i + 1
		}
	}
	return append(labels, name[start:])
}

// ParseName parses a matchName: a DNS name without wildcards.
func ParseName(name string) (*Pattern, error) {
	return parse(name, false)
}

// ParsePattern parses a matchPattern.
func ParsePattern(pattern string) (*Pattern, error) {
	return parse(pattern, true)
}

func parse(s string, wildcards bool) (*Pattern, error) {
	what := "matchName"
	if wildcards {
		what = "matchPattern"
	}
	text := Normalize(s)
	if text == "" {
		return nil, fmt.Errorf("%s is empty", what)
	}
	if len(text) > MaxLen {
		return nil, fmt.Errorf("%s %q is longer than %d characters", what, s, MaxLen)
	}
	for _, c := range text {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-', c == '_', c == '.':
		case c == '*' && wildcards:
		default:
			return nil, fmt.Errorf("%s %q: character %q is not allowed", what, s, c)
		}
	}
	p := &Pattern{text: text}
	if wildcards && strings.Trim(text, "*") == "" {
		p.all = true
		return p, nil
	}
	labels := strings.Split(text, ".")
	if wildcards && len(labels) > 1 && len(labels[0]) >= 2 && strings.Trim(labels[0], "*") == "" {
		p.deep = true
		labels = labels[1:]
	}
	for _, l := range labels {
		if l == "" {
			return nil, fmt.Errorf("%s %q has an empty label", what, s)
		}
	}
	p.labels = labels
	return p, nil
}

// String returns the pattern in its normalised form: lowercase, without
// the trailing dot. Selector labels are "fqdn:" + String().
func (p *Pattern) String() string { return p.text }

// Match reports whether the pattern matches name (in any case, with or
// without the trailing dot).
func (p *Pattern) Match(name string) bool {
	if p.all {
		return true
	}
	name = Normalize(name)
	if name == "" {
		return false
	}
	labels := splitLabels(name)
	if p.deep {
		extra := len(labels) - len(p.labels)
		if extra < 1 {
			return false
		}
		for _, l := range labels[:extra] {
			if l == "" {
				return false
			}
		}
		labels = labels[extra:]
	} else if len(labels) != len(p.labels) {
		return false
	}
	for i, l := range labels {
		if !matchLabel(p.labels[i], l) {
			return false
		}
	}
	return true
}

// nameChar reports whether c may be matched by a star.
func nameChar(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}

// matchLabel matches one label of a name against one label of a pattern,
// where each run of stars matches zero or more name characters. Greedy
// with backtracking to the last star: linear for patterns with one star,
// at most len(pattern)·len(label) steps otherwise.
func matchLabel(pat, label string) bool {
	pi, li := 0, 0
	star, starLi := -1, 0
	for li < len(label) {
		switch {
		case pi < len(pat) && pat[pi] == '*':
			for pi < len(pat) && pat[pi] == '*' {
				pi++
			}
			star, starLi = pi, li
		case pi < len(pat) && pat[pi] == label[li]:
			pi++
			li++
		case star >= 0 && nameChar(label[starLi]):
			// Let the last star swallow one more character.
			starLi++
			pi, li = star, starLi
		default:
			return false
		}
	}
	for pi < len(pat) && pat[pi] == '*' {
		pi++
	}
	return pi == len(pat)
}
