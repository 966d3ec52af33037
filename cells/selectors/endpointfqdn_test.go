package selectors

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/apiary-net/apiary/tables"
)

// TestEndpointFQDNSelectors: a selector exists for each endpoint FQDN
// label while an identity carries it, selecting those identities; a
// plain fqdn: label, or another endpoint's, makes none.
func TestEndpointFQDNSelectors(t *testing.T) {
	const la, lb = "fqdn:*.example.com@default/a", "fqdn:*.example.com@default/b"
	steps := []struct {
		what   string
		id     uint32
		labels tables.Labels // nil: the identity goes
		want   map[string][]uint32
	}{
		{"a plain fqdn label makes none", 1, tables.NewLabels("fqdn:*.example.com", "reserved:world"), map[string][]uint32{}},
		{"a's label", 2, tables.NewLabels(la, "reserved:world"), map[string][]uint32{la: {2}}},
		{"a's and the plain label", 3, tables.NewLabels(la, "fqdn:*.example.com", "reserved:world"), map[string][]uint32{la: {2, 3}}},
		{"b's label", 4, tables.NewLabels(lb, "reserved:world"), map[string][]uint32{la: {2, 3}, lb: {4}}},
		{"identity 2 gone", 2, nil, map[string][]uint32{la: {3}, lb: {4}}},
		{"identity 3 loses a's label", 3, tables.NewLabels("fqdn:*.example.com", "reserved:world"), map[string][]uint32{lb: {4}}},
		{"identity 4 gone", 4, nil, map[string][]uint32{}},
	}
	cache, f := newSelectorCache(), newEndpointFQDN()
	for _, st := range steps {
		if st.labels == nil {
			cache.deleteIdentity(st.id)
		} else {
			cache.upsertIdentity(st.id, st.labels)
		}
		f.update(cache, st.id, st.labels)
		got := map[string][]uint32{}
		for key, s := range cache.selectors {
			got[key] = slices.Sorted(maps.Keys(s.ids))
			if !slices.Equal(s.users, []string{EndpointFQDNUser}) {
				t.Errorf("%s: selector %s users %v", st.what, key, s.users)
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(st.want) {
			t.Errorf("%s: selectors %v, want %v", st.what, got, st.want)
		}
	}
}
