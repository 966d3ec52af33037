package tables

import (
	"net/netip"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// PrefixesTableName, IPCacheTableName and PolicyPrefixesTableName are the
// statedb names of the prefix label tables.
const (
	PrefixesTableName = "prefixes"
	IPCacheTableName  = "ipcache"
	// PolicyPrefixesTableName is the table of the prefixes policies name
	// (those an owner gives a cidr: label), each with the labels and
	// identity an address outside the cluster inside it has, even where
	// the ipcache gives the prefix a pod's or the host's identity. Its
	// rows are IPCacheEntry; it is reconciled into the policy prefixes
	// map, where the datapath finds the policy prefix holding any
	// address (a NetworkPolicy ipBlock matches pods by address).
	PolicyPrefixesTableName = "policy-prefixes"
)

// PrefixLabels is what one owner says about one prefix: the labels it gives
// it. Owners are strings "kind/name": "policy" (CIDRs of policies),
// "pod/<namespace>/<name>", "node", "fqdn/<name>", "ipam/health".
type PrefixLabels struct {
	// Prefix is canonical (see CanonicalPrefix).
	Prefix netip.Prefix `json:"prefix" yaml:"prefix"`
	Owner  string       `json:"owner" yaml:"owner"`
	Labels Labels       `json:"labels" yaml:"labels"`
}

// TableHeader implements statedb.TableWritable.
func (*PrefixLabels) TableHeader() []string {
	return []string{"Prefix", "Owner", "Labels"}
}

// TableRow implements statedb.TableWritable.
func (p *PrefixLabels) TableRow() []string {
	return []string{p.Prefix.String(), p.Owner, strings.Join(p.Labels, ", ")}
}

// PrefixKey is the index key of a prefix: family (4 or 6), address bytes,
// prefix length. Keys of one family sort by address then length, so the
// prefixes inside P are a contiguous run starting at PrefixKey(P) (with, at
// most, P's own ancestors that start at the same address interleaved).
func PrefixKey(p netip.Prefix) index.Key {
	p = CanonicalPrefix(p)
	addr := p.Addr()
	if addr.Is4() {
		a := addr.As4()
		return index.Key{4, a[0], a[1], a[2], a[3], byte(p.Bits())}
	}
	a := addr.As16()
	k := make(index.Key, 0, 18)
	k = append(k, 6)
	k = append(k, a[:]...)
	return append(k, byte(p.Bits()))
}

func prefixFromString(s string) (index.Key, error) {
	p, err := netip.ParsePrefix(s)
	if err != nil {
		addr, err2 := netip.ParseAddr(s)
		if err2 != nil {
			return nil, err
		}
		p = HostPrefix(addr)
	}
	return PrefixKey(p), nil
}

// PrefixLabelsIndex is the primary index of the prefixes table: prefix and
// owner. Query it with PrefixOwners to list the owners of one prefix.
var PrefixLabelsIndex = statedb.Index[*PrefixLabels, PrefixOwner]{
	Name: "prefix",
	FromObject: func(p *PrefixLabels) index.KeySet {
		return index.NewKeySet(PrefixOwner{p.Prefix, p.Owner}.Key())
	},
	FromKey:    PrefixOwner.Key,
	FromString: prefixFromString,
	Unique:     true,
}

// PrefixOwner identifies a row of the prefixes table.
type PrefixOwner struct {
	Prefix netip.Prefix
	Owner  string
}

// Key returns the primary key of the row.
func (po PrefixOwner) Key() index.Key {
	return append(PrefixKey(po.Prefix), po.Owner...)
}

// PrefixOwners queries the rows of one prefix (use with Table.Prefix).
func PrefixOwners(p netip.Prefix) statedb.Query[*PrefixLabels] {
	return PrefixLabelsIndex.Query(PrefixOwner{Prefix: p})
}

// PrefixOwnerIndex finds the rows of an owner.
var PrefixOwnerIndex = statedb.Index[*PrefixLabels, string]{
	Name:       "owner",
	FromObject: func(p *PrefixLabels) index.KeySet { return index.NewKeySet(index.String(p.Owner)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     false,
}

// NewPrefixesTable registers the prefixes table with db.
func NewPrefixesTable(db *statedb.DB) (statedb.RWTable[*PrefixLabels], error) {
	return statedb.NewTable(db, PrefixesTableName, PrefixLabelsIndex, PrefixOwnerIndex)
}

// PodOwner returns the owner of a pod's addresses in the prefixes table,
// "pod/<namespace>/<name>".
func PodOwner(namespace, name string) string {
	return podOwnerPrefix + namespace + "/" + name
}

// PodOfOwner is the inverse of PodOwner: the namespace and name of the pod
// owner stands for, ok false for an owner that is no pod. Whoever has the
// ipcache table can so name the pod behind an address on any node.
func PodOfOwner(owner string) (namespace, name string, ok bool) {
	rest, ok := strings.CutPrefix(owner, podOwnerPrefix)
	if !ok {
		return "", "", false
	}
	return strings.Cut(rest, "/") // namespaces have no '/'
}

const podOwnerPrefix = "pod/"

// IPCacheEntry is a prefix with its resolved labels and identity: what the
// ipcache map holds for it.
type IPCacheEntry struct {
	Prefix netip.Prefix `json:"prefix" yaml:"prefix"`
	// Identity is the number of Labels; 0 when none could be had (Error
	// says why), in which case the map has no entry for the prefix.
	Identity uint32 `json:"identity" yaml:"identity"`
	// Labels are the owners' labels, those inherited from shorter prefixes
	// containing this one, then normalised (only the longest cidr: label,
	// world label for prefixes outside the cluster).
	Labels Labels `json:"labels" yaml:"labels"`
	// Owners are the owners of the prefix itself.
	Owners []string `json:"owners" yaml:"owners"`
	// Error says why the prefix has no identity.
	Error string `json:"error,omitempty" yaml:"error,omitempty"`
	// Status is the reconciliation status of the map entry.
	Status reconciler.Status `json:"status" yaml:"status"`
}

// Clone returns a shallow copy.
func (e *IPCacheEntry) Clone() *IPCacheEntry {
	c := *e
	return &c
}

// GetStatus returns the reconciliation status.
func (e *IPCacheEntry) GetStatus() reconciler.Status { return e.Status }

// SetStatus sets the reconciliation status and returns the entry.
func (e *IPCacheEntry) SetStatus(s reconciler.Status) *IPCacheEntry {
	e.Status = s
	return e
}

// TableHeader implements statedb.TableWritable.
func (*IPCacheEntry) TableHeader() []string {
	return []string{"Prefix", "Identity", "Labels", "Owners", "Error", "Status"}
}

// TableRow implements statedb.TableWritable.
func (e *IPCacheEntry) TableRow() []string {
	return []string{
		e.Prefix.String(), formatUint(e.Identity), strings.Join(e.Labels, ", "),
		strings.Join(e.Owners, ", "), e.Error, StatusText(e.Status),
	}
}

// IPCachePrefixIndex is the primary index of the ipcache table.
var IPCachePrefixIndex = statedb.Index[*IPCacheEntry, netip.Prefix]{
	Name:       "prefix",
	FromObject: func(e *IPCacheEntry) index.KeySet { return index.NewKeySet(PrefixKey(e.Prefix)) },
	FromKey:    PrefixKey,
	FromString: prefixFromString,
	Unique:     true,
}

// NewPolicyPrefixesTable registers the policy-prefixes table with db.
func NewPolicyPrefixesTable(db *statedb.DB) (statedb.RWTable[*IPCacheEntry], error) {
	return statedb.NewTable(db, PolicyPrefixesTableName, IPCachePrefixIndex)
}

// NewIPCacheTable registers the ipcache table with db.
func NewIPCacheTable(db *statedb.DB) (statedb.RWTable[*IPCacheEntry], error) {
	// No secondary index: every index costs on each of the table's writes,
	// which include a status write per entry by the reconciler.
	return statedb.NewTable(db, IPCacheTableName, IPCachePrefixIndex)
}
