package tables

import (
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// FQDNNamesTableName is the statedb name of the DNS cache of the fqdn cell.
const FQDNNamesTableName = "fqdn-names"

// FQDNName is a DNS name the proxy saw answered that at least one FQDN
// selector matches, with the addresses of its answers. Each labelled
// address carries the Selectors' labels under the owner "fqdn/<Key>" in
// the prefixes table.
//
// A row without Endpoint holds the answers of the resolvers the node
// trusts, which label addresses for every pod's toFQDNs. A row with one
// holds the answers a resolver the node does not trust gave that endpoint
// alone: its Selectors are "fqdn:<pattern>@<endpoint>", which only that
// endpoint's policy selects (see EndpointFQDNLabel).
type FQDNName struct {
	// Name is the question name, lowercase, without the trailing dot.
	Name string `json:"name" yaml:"name"`
	// Endpoint is the endpoint ("namespace/pod") whose untrusted answers
	// the row holds; empty for trusted answers.
	Endpoint string `json:"endpoint,omitempty" yaml:"endpoint,omitempty"`
	// IPs are the addresses of the name's A and AAAA answers, sorted.
	IPs []FQDNIP `json:"ips" yaml:"ips"`
	// Selectors are the labels "fqdn:<pattern>" of the selectors matching
	// Name, sorted.
	Selectors Labels `json:"selectors" yaml:"selectors"`
}

// FQDNIP is one address of a name.
type FQDNIP struct {
	IP netip.Addr `json:"ip" yaml:"ip"`
	// Expires is when the address expires: the answer's TTL (raised to
	// --tofqdns-min-ttl) after the last answer holding it, rounded up to
	// a whole second.
	Expires time.Time `json:"expires" yaml:"expires"`
	// Seen is the time of the last answer holding the address, to within
	// a second (an answer repeating a row seen less than a second ago is
	// not written); when a name has too many addresses, the least
	// recently seen go first.
	Seen time.Time `json:"seen" yaml:"seen"`
	// Unlabelled is true when the --tofqdns-max-identities circuit
	// breaker refused the address a new selector combination: it stays
	// a world address.
	Unlabelled bool `json:"unlabelled,omitempty" yaml:"unlabelled,omitempty"`
	// By is the endpoint whose answer brought the address to the row
	// (empty: the node, or a query sent to the proxy directly): it counts
	// towards that endpoint's --tofqdns-max-ips-per-pod.
	By string `json:"by,omitempty" yaml:"by,omitempty"`
}

// FQDNKey is the primary key of the fqdn-names row of name's answers for
// endpoint: the name alone for trusted answers (endpoint empty),
// "<name>@<endpoint>" for one endpoint's untrusted ones. A name never
// holds '@'.
func FQDNKey(name, endpoint string) string {
	if endpoint == "" {
		return name
	}
	return name + "@" + endpoint
}

// Key returns the row's primary key (see FQDNKey).
func (n *FQDNName) Key() string { return FQDNKey(n.Name, n.Endpoint) }

// EndpointFQDNLabel returns the label an address gets from an FQDN
// selector label ("fqdn:<pattern>") through an answer for endpoint alone:
// "fqdn:<pattern>@<endpoint>". A pattern never holds '@'.
func EndpointFQDNLabel(selector, endpoint string) string {
	return selector + "@" + endpoint
}

// SplitEndpointFQDNLabel returns the selector label and the endpoint of a
// label made by EndpointFQDNLabel; ok is false for any other label.
func SplitEndpointFQDNLabel(label string) (selector, endpoint string, ok bool) {
	if !strings.HasPrefix(label, SourceFQDN+":") {
		return "", "", false
	}
	selector, endpoint, ok = strings.Cut(label, "@")
	return selector, endpoint, ok && endpoint != ""
}

// Clone returns a copy whose IPs may be modified.
func (n *FQDNName) Clone() *FQDNName {
	c := *n
	c.IPs = slices.Clone(n.IPs)
	return &c
}

// TableHeader implements statedb.TableWritable.
func (*FQDNName) TableHeader() []string {
	return []string{"Name", "Endpoint", "IPs", "Selectors", "Unlabelled", "Expires"}
}

// TableRow implements statedb.TableWritable. Expires is the time until the
// earliest address expires.
func (n *FQDNName) TableRow() []string {
	var ips, unlabelled []string
	var first time.Time
	for _, ip := range n.IPs {
		ips = append(ips, ip.IP.String())
		if ip.Unlabelled {
			unlabelled = append(unlabelled, ip.IP.String())
		}
		if first.IsZero() || ip.Expires.Before(first) {
			first = ip.Expires
		}
	}
	expires := ""
	if !first.IsZero() {
		expires = time.Until(first).Truncate(time.Second).String()
	}
	return []string{n.Name, n.Endpoint, strings.Join(ips, ", "), strings.Join(n.Selectors, ", "), strings.Join(unlabelled, ", "), expires}
}

// FQDNNameIndex is the primary index of the fqdn-names table, by FQDNKey:
// Query(name) finds the trusted row of name.
var FQDNNameIndex = statedb.Index[*FQDNName, string]{
	Name:       "name",
	FromObject: func(n *FQDNName) index.KeySet { return index.NewKeySet(index.String(n.Key())) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// The table has no index by address on purpose: a name with thousands of
// addresses would re-index all of them on every answer. The fqdn cell keeps
// the reverse map (address → names) in memory.

// NewFQDNNamesTable registers the fqdn-names table with db.
func NewFQDNNamesTable(db *statedb.DB) (statedb.RWTable[*FQDNName], error) {
	return statedb.NewTable(db, FQDNNamesTableName, FQDNNameIndex)
}
