package selectors

import (
	"slices"

	"github.com/apiary-net/apiary/tables"
)

// EndpointFQDNUser is the user (in place of a policy) of the selectors
// of one endpoint's FQDN labels in the selectors table.
const EndpointFQDNUser = "fqdn-endpoint"

// endpointFQDN keeps a selector for every label "fqdn:<pattern>@<endpoint>"
// an identity carries. The DNS proxy gives an address such a label when a
// resolver the node does not trust answered that endpoint: only that
// endpoint's policy may allow the address (policy enforcement adds the
// selector to the endpoint's toFQDNs rules of the pattern). The selectors
// follow the identities rather than the policies, since the labels are
// made per endpoint at run time; each exists while an identity carries
// its label.
type endpointFQDN struct {
	byID map[uint32][]string // the endpoint FQDN labels of each identity
	refs map[string]int      // identities carrying each label
}

func newEndpointFQDN() *endpointFQDN {
	return &endpointFQDN{byID: map[uint32][]string{}, refs: map[string]int{}}
}

// update follows identity id to its labels (nil: the identity is gone),
// adding the selectors of labels that appear to cache and removing those
// of labels no identity carries any more. It runs after cache has the
// identity's change, so that a new selector finds it.
func (f *endpointFQDN) update(cache *selectorCache, id uint32, labels tables.Labels) {
	var next []string
	for _, l := range labels {
		if _, _, ok := tables.SplitEndpointFQDNLabel(l); ok {
			next = append(next, l)
		}
	}
	old := f.byID[id]
	if len(next) == 0 {
		delete(f.byID, id)
	} else {
		f.byID[id] = next
	}
	for _, l := range next {
		if slices.Contains(old, l) {
			continue
		}
		if f.refs[l]++; f.refs[l] == 1 {
			cache.addUser(&FQDNPeer{Label: l}, EndpointFQDNUser)
		}
	}
	for _, l := range old {
		if slices.Contains(next, l) {
			continue
		}
		if f.refs[l]--; f.refs[l] <= 0 {
			delete(f.refs, l)
			cache.removeUser(l, EndpointFQDNUser)
		}
	}
}
