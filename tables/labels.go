package tables

import (
	"net/netip"
	"slices"
	"strings"
)

// Labels is a set of security labels, sorted and without duplicates, each
// written "source:key=value" or "source:key": "k8s:app=web",
// "reserved:world", "cidr:10.0.0.0/8", "fqdn:*.cilium.io". Values are
// immutable once stored in a table.
type Labels []string

// Label sources.
const (
	SourceK8s      = "k8s"
	SourceReserved = "reserved"
	SourceCIDR     = "cidr"
	SourceFQDN     = "fqdn"
	// SourcePodNet labels a pod whose address lies inside a prefix a
	// ClusterNetworkPolicy networks peer names ("podnet:10.0.0.0/8"):
	// the API matches cluster traffic against networks too, so those pods
	// are told apart from their workload's others by identity.
	SourcePodNet = "podnet"
	// SourceNodes labels the addresses of the nodes a ClusterNetworkPolicy
	// nodes peer selects: "nodes:{<selector>}" (see NodesLabel).
	SourceNodes = "nodes"
)

// NodesLabel returns the label of the nodes a nodes peer with the given
// canonical selector text selects: "nodes:{<selector>}". The braces keep
// it from ever reading as a pod label's key (no label key holds '{'), so
// pod selectors never select it.
func NodesLabel(selector string) string { return SourceNodes + ":{" + selector + "}" }

// Reserved labels.
const (
	LabelHost          = "reserved:host"
	LabelWorld         = "reserved:world"
	LabelWorldIPv4     = "reserved:world-ipv4"
	LabelWorldIPv6     = "reserved:world-ipv6"
	LabelUnmanaged     = "reserved:unmanaged"
	LabelHealth        = "reserved:health"
	LabelInit          = "reserved:init"
	LabelRemoteNode    = "reserved:remote-node"
	LabelKubeAPIServer = "reserved:kube-apiserver"
	LabelIngress       = "reserved:ingress"
)

// NewLabels returns the set of the given labels: a sorted copy without
// duplicates or empty strings.
func NewLabels(labels ...string) Labels {
	out := slices.Clone(labels)
	out = slices.DeleteFunc(out, func(s string) bool { return s == "" })
	slices.Sort(out)
	return Labels(slices.Compact(out))
}

// Key returns the set as one string, usable as a map or index key.
func (l Labels) Key() string {
	return strings.Join(l, ",")
}

// String implements fmt.Stringer.
func (l Labels) String() string {
	return l.Key()
}

// Has reports whether the set holds label.
func (l Labels) Has(label string) bool {
	_, ok := slices.BinarySearch(l, label)
	return ok
}

// HasSource reports whether a label of source is in the set.
func (l Labels) HasSource(source string) bool {
	for _, s := range l {
		if src, _, _, _ := SplitLabel(s); src == source {
			return true
		}
	}
	return false
}

// Union returns the set of the labels of l and o.
func (l Labels) Union(o Labels) Labels {
	if len(o) == 0 {
		return l
	}
	if len(l) == 0 {
		return o
	}
	return NewLabels(append(slices.Clone(l), o...)...)
}

// Equal reports whether both sets hold the same labels.
func (l Labels) Equal(o Labels) bool {
	return slices.Equal(l, o)
}

// SplitLabel splits "source:key=value" into its parts. A label without a
// colon has the source "any"; hasValue is false for "source:key".
func SplitLabel(label string) (source, key, value string, hasValue bool) {
	source, rest, ok := strings.Cut(label, ":")
	if !ok {
		source, rest = "any", label
	}
	// The key of a cidr label is a prefix, which never holds '='; an IPv6
	// one holds ':' though, which is why only the first ':' splits.
	key, value, hasValue = strings.Cut(rest, "=")
	return source, key, value, hasValue
}

// CIDRLabel returns the label "cidr:<prefix>" of prefix, canonicalised.
func CIDRLabel(p netip.Prefix) string { return prefixLabel(SourceCIDR, p) }

// ParseCIDRLabel returns the prefix of a "cidr:<prefix>" label.
func ParseCIDRLabel(label string) (netip.Prefix, bool) { return parsePrefixLabel(SourceCIDR, label) }

// PodNetLabel returns the label "podnet:<prefix>" of prefix (see
// SourcePodNet), canonicalised.
func PodNetLabel(p netip.Prefix) string { return prefixLabel(SourcePodNet, p) }

// ParsePodNetLabel returns the prefix of a "podnet:<prefix>" label.
func ParsePodNetLabel(label string) (netip.Prefix, bool) {
	return parsePrefixLabel(SourcePodNet, label)
}

func prefixLabel(source string, p netip.Prefix) string {
	return source + ":" + CanonicalPrefix(p).String()
}

func parsePrefixLabel(source, label string) (netip.Prefix, bool) {
	rest, ok := strings.CutPrefix(label, source+":")
	if !ok {
		return netip.Prefix{}, false
	}
	p, err := netip.ParsePrefix(rest)
	if err != nil {
		return netip.Prefix{}, false
	}
	return p, true
}

// CanonicalPrefix returns p with its host bits cleared and an IPv4-mapped
// IPv6 address turned into IPv4, so that one network has one spelling.
func CanonicalPrefix(p netip.Prefix) netip.Prefix {
	addr, bits := p.Addr(), p.Bits()
	if addr.Is4In6() {
		addr = addr.Unmap()
		bits -= 96
		if bits < 0 {
			bits = 0
		}
	}
	return netip.PrefixFrom(addr, bits).Masked()
}

// HostPrefix returns the prefix of exactly addr (/32 or /128).
func HostPrefix(addr netip.Addr) netip.Prefix {
	addr = addr.Unmap()
	return netip.PrefixFrom(addr, addr.BitLen())
}
