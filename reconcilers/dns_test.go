package reconcilers_test

import (
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// TestDNSMaps: dns_origin through a bpf.Opener, as the endpoint-policy
// reconciler keeps it: an endpoint with DNS rules gets a map of its own,
// kept while it has them, removed when it has none or is pruned.
func TestDNSMaps(t *testing.T) {
	onEveryOpener(t, func(t *testing.T, opener bpf.Opener, dir string, raw func(string) bpf.Map) {
		sockSpec := func() (*ebpf.MapSpec, error) {
			// The programs' own definition is a socket storage map; a
			// hash of the same name stands for it here.
			return &ebpf.MapSpec{Name: bpf.DNSSockMap, Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1}, nil
		}
		d := reconcilers.NewDNSMaps(nil, opener, dir, sockSpec)
		t.Cleanup(d.Close)
		dns := []tables.DNSRule{{Pattern: "*", Policy: "cnp/default/dns"}}
		for _, id := range []uint32{1, 2, 3} {
			if err := d.Ensure(&tables.EndpointPolicy{ID: id, DNS: dns}); err != nil {
				t.Fatal(err)
			}
		}
		origin := raw(bpf.DNSOriginMap)
		first := innerID(t, origin, 1)
		if first == 0 || innerID(t, origin, 2) == 0 {
			t.Fatal("no dns_origin map for the endpoints with DNS rules")
		}
		if err := d.Ensure(&tables.EndpointPolicy{ID: 1, DNS: dns}); err != nil {
			t.Fatal(err)
		}
		if innerID(t, origin, 1) != first {
			t.Error("an endpoint's map was replaced while it kept its DNS rules")
		}
		if err := d.Ensure(&tables.EndpointPolicy{ID: 2}); err != nil {
			t.Fatal(err)
		}
		if innerID(t, origin, 2) != 0 {
			t.Error("an endpoint without DNS rules kept its map")
		}
		// What endpoint 1's sockets publish, the DNS proxy finds; an
		// entry naming another endpoint is not its.
		key := bpf.NewDNSOriginKey(17, netip.MustParseAddrPort("10.0.0.1:5353"))
		published := bpf.DNSOrigin{Resolver: netip.MustParseAddr("::ffff:10.96.0.10").As16(), ResolverPort: bpf.NewBe16(53), EndpointID: 1}
		inner, err := bpf.LookupInner(origin, uint32(1))
		if err != nil {
			t.Fatal(err)
		}
		defer inner.Close()
		if err := inner.Put(key, published); err != nil {
			t.Fatal(err)
		}
		if got, ok := d.Origin(1, key); !ok || got != published {
			t.Errorf("Origin(1) = %+v, %v; want %+v", got, ok, published)
		}
		if _, ok := d.Origin(3, key); ok {
			t.Error("Origin(3) found endpoint 1's entry")
		}
		if err := d.Prune(map[uint32]struct{}{1: {}}); err != nil {
			t.Fatal(err)
		}
		if innerID(t, origin, 1) != first || innerID(t, origin, 3) != 0 {
			t.Error("Prune kept an endpoint not listed, or removed one listed")
		}
		cfg, err := bpf.NewDNSConfig(netip.MustParseAddrPort("127.0.0.1:53"), netip.AddrPort{}, true)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.SetConfig(cfg); err != nil {
			t.Fatal(err)
		}
		var got bpf.DNSConfig
		if err := raw(bpf.DNSConfigMap).Lookup(uint32(0), &got); err != nil || got != cfg {
			t.Errorf("dns_config = %+v, %v; want %+v", got, err, cfg)
		}
	})
}
