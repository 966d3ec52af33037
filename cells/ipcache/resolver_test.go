package ipcache

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/apiary-net/apiary/tables"
)

func TestNormalize(t *testing.T) {
	for _, tc := range []struct {
		name      string
		prefix    string
		labels    []string
		dualStack bool
		want      []string
	}{
		{"longest cidr kept", "192.0.2.128/25", []string{"cidr:192.0.2.128/25", "cidr:192.0.2.0/24", "reserved:world"}, false,
			[]string{"cidr:192.0.2.128/25", "reserved:world"}},
		{"labels from two owners", "198.51.100.7/32", []string{"cidr:198.51.100.7/32", "fqdn:*.example.com"}, false,
			[]string{"cidr:198.51.100.7/32", "fqdn:*.example.com", "reserved:world"}},
		{"pod in a policy CIDR", "10.0.1.5/32", []string{"k8s:app=web", "cidr:10.0.0.0/8", "reserved:world"}, false,
			[]string{"k8s:app=web"}},
		{"host loses fqdn", "192.168.1.10/32", []string{"reserved:host", "fqdn:*.example.com", "cidr:192.168.0.0/16"}, false,
			[]string{"reserved:host"}},
		{"dual stack v4", "192.0.2.0/24", []string{"cidr:192.0.2.0/24", "reserved:world"}, true,
			[]string{"cidr:192.0.2.0/24", "reserved:world-ipv4"}},
		{"dual stack v6", "2001:db8::/32", []string{"cidr:2001:db8::/32", "reserved:world"}, true,
			[]string{"cidr:2001:db8::/32", "reserved:world-ipv6"}},
		{"world added", "203.0.113.9/32", []string{"fqdn:a.example.com"}, false,
			[]string{"fqdn:a.example.com", "reserved:world"}},
		// ClusterNetworkPolicy networks: a pod keeps the longest podnet:
		// label; nothing else keeps any.
		{"pod in a networks CIDR", "10.0.1.5/32", []string{"k8s:app=web", "cidr:10.0.0.0/8", "podnet:10.0.0.0/8", "cidr:10.0.1.0/24", "podnet:10.0.1.0/24", "reserved:world"}, false,
			[]string{"k8s:app=web", "podnet:10.0.1.0/24"}},
		{"outside address in a networks CIDR", "10.9.0.0/16", []string{"cidr:10.0.0.0/8", "podnet:10.0.0.0/8", "reserved:world"}, false,
			[]string{"cidr:10.0.0.0/8", "reserved:world"}},
		{"host in a networks CIDR", "10.0.0.1/32", []string{"reserved:host", "cidr:10.0.0.0/8", "podnet:10.0.0.0/8"}, false,
			[]string{"reserved:host"}},
		{"another node in a networks CIDR", "10.0.0.2/32", []string{"reserved:remote-node", "cidr:10.0.0.0/8", "podnet:10.0.0.0/8"}, false,
			[]string{"reserved:remote-node"}},
		{"a Node claiming a pod's address", "10.0.2.7/32", []string{"k8s:app=web", "reserved:remote-node"}, false,
			[]string{"k8s:app=web"}},
		{"a Node claiming the host's address", "192.168.1.10/32", []string{"reserved:host", "reserved:remote-node"}, false,
			[]string{"reserved:host"}},
		{"a remote node's address", "192.168.1.11/32", []string{"reserved:remote-node", "cidr:192.168.0.0/16"}, false,
			[]string{"reserved:remote-node"}},
		{"the API server on a remote node", "192.168.1.12/32", []string{"reserved:kube-apiserver", "reserved:remote-node"}, false,
			[]string{"reserved:kube-apiserver", "reserved:remote-node"}},
	} {
		got := normalize(netip.MustParsePrefix(tc.prefix), tc.labels, tc.dualStack)
		if !slices.Equal(got, tables.NewLabels(tc.want...)) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
