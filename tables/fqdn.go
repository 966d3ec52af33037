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
// address carries the Selectors' labels under the owner "fqdn/<Name>" in
// the prefixes table.
type FQDNName struct {
	// Name is the question name, lowercase, without the trailing dot.
	Name string `json:"name" yaml:"name"`
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
}

// Clone returns a copy whose IPs may be modified.
func (n *FQDNName) Clone() *FQDNName {
	c := *n
	c.IPs = slices.Clone(n.IPs)
	return &c
}

// TableHeader implements statedb.TableWritable.
func (*FQDNName) TableHeader() []string {
	return []string{"Name", "IPs", "Selectors", "Unlabelled", "Expires"}
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
	return []string{n.Name, strings.Join(ips, ", "), strings.Join(n.Selectors, ", "), strings.Join(unlabelled, ", "), expires}
}

// FQDNNameIndex is the primary index of the fqdn-names table.
var FQDNNameIndex = statedb.Index[*FQDNName, string]{
	Name:       "name",
	FromObject: func(n *FQDNName) index.KeySet { return index.NewKeySet(index.String(n.Name)) },
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
