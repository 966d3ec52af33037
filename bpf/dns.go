package bpf

import (
	"fmt"
	"log/slog"
	"net/netip"

	"github.com/cilium/ebpf"
)

// Names (and pin file names) of the maps of transparent DNS interception
// (bpf/c/dns_redirect.h), which the policy programs and the socket load
// balancer's share.
const (
	// DNSSockMap is the socket storage in which a socket whose DNS was
	// sent to the proxy remembers the resolver it asked (DNSSock).
	DNSSockMap = "dns_sk"
	// DNSOriginMap tells the proxy, by a query's source, whom the client
	// asked and which endpoint it is: a hash of maps keyed by endpoint ID,
	// one LRU (DNSOriginKey → DNSOrigin, DNSOriginInnerSpec) per endpoint
	// with DNS rules, so that no pod pushes out or overwrites another's
	// entries.
	DNSOriginMap = "dns_origin"
	// DNSOriginLostMap counts (one per-CPU counter) the queries whose
	// origin the programs could not publish: the endpoint has no map in
	// DNSOriginMap, or the write failed.
	DNSOriginLostMap = "dns_origin_lost"
	// DNSConfigMap holds the one DNSConfig: where intercepted DNS goes.
	DNSConfigMap = "dns_config"
)

// Byte sizes of the DNS maps' keys and values.
const (
	DNSSockValueSize   = 40
	DNSOriginKeySize   = 20
	DNSOriginValueSize = 24
	DNSConfigValueSize = 28
)

// DNSOriginMaxEntries sizes each endpoint's map in dns_origin: one entry
// per client socket of the endpoint that sent a query lately; the oldest
// go first.
const DNSOriginMaxEntries = 1024

// DNSOriginMaxEndpoints sizes dns_origin itself: the endpoints with DNS
// rules.
const DNSOriginMaxEndpoints = 65536

// DNSConfigIntercept (DNSConfig.Flags) sends DNS of endpoints with a DNS
// rule to the proxy; without it their DNS is denied, but for the proxy's
// own address.
const DNSConfigIntercept uint32 = 1 << 0

// DNSSock is the value of dns_sk (struct dns_sock).
type DNSSock struct {
	// Resolver is what the socket asked, after the socket load balancer,
	// IPv6 or IPv4-mapped; Proxy where it was sent instead.
	Resolver     [16]byte
	Proxy        [16]byte
	ResolverPort Be16
	ProxyPort    Be16
	EndpointID   uint32
}

// DNSConfig is the value of dns_config (struct dns_config).
type DNSConfig struct {
	// Proxy4 is the proxy's IPv4 address (zero: none), Port4 its port.
	Proxy4 [4]byte
	Port4  Be16
	Port6  Be16
	// Proxy6 is the proxy's IPv6 address (zero: none), Port6 its port.
	Proxy6 [16]byte
	// Flags are DNSConfig* bits.
	Flags uint32
}

// NewDNSConfig returns the configuration that sends intercepted DNS to
// proxy4 (an IPv4 address) and proxy6 (an IPv6 one); an invalid address
// port is none of that family. intercept false denies it instead.
func NewDNSConfig(proxy4, proxy6 netip.AddrPort, intercept bool) (DNSConfig, error) {
	var c DNSConfig
	if proxy4.IsValid() {
		a := proxy4.Addr().Unmap()
		if !a.Is4() {
			return c, fmt.Errorf("DNS proxy address %s is not IPv4", proxy4)
		}
		c.Proxy4 = a.As4()
		c.Port4 = NewBe16(proxy4.Port())
	}
	if proxy6.IsValid() {
		a := proxy6.Addr()
		if !a.Is6() || a.Is4In6() {
			return c, fmt.Errorf("DNS proxy address %s is not IPv6", proxy6)
		}
		c.Proxy6 = a.As16()
		c.Port6 = NewBe16(proxy6.Port())
	}
	if intercept {
		c.Flags |= DNSConfigIntercept
	}
	return c, nil
}

// DNSOriginKey is the key of dns_origin (struct dns_origin_key): a query's
// source as the proxy sees it.
type DNSOriginKey struct {
	// Client is IPv6 or IPv4-mapped.
	Client     [16]byte
	ClientPort Be16
	Protocol   uint8
	Pad        uint8
}

// NewDNSOriginKey returns the key of a query from client over protocol
// (6 TCP, 17 UDP).
func NewDNSOriginKey(protocol uint8, client netip.AddrPort) DNSOriginKey {
	a := client.Addr()
	if a.Is4() {
		a = netip.AddrFrom16(a.As16())
	}
	return DNSOriginKey{Client: a.As16(), ClientPort: NewBe16(client.Port()), Protocol: protocol}
}

// DNSOrigin is the value of dns_origin (struct dns_origin).
type DNSOrigin struct {
	Resolver     [16]byte
	ResolverPort Be16
	Pad          uint16
	EndpointID   uint32
}

// ResolverAddr returns the resolver, an IPv4 one unmapped.
func (o DNSOrigin) ResolverAddr() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(o.Resolver).Unmap(), o.ResolverPort.Uint16())
}

// DNSSockMapSpec returns the spec of dns_sk from a programs' object that
// has it (policy or socket LB): socket storage needs the BTF of its value.
func DNSSockMapSpec(spec *ebpf.CollectionSpec) (*ebpf.MapSpec, error) {
	ms := spec.Maps[DNSSockMap]
	if ms == nil {
		return nil, fmt.Errorf("the programs' object has no map %s", DNSSockMap)
	}
	ms = ms.Copy()
	ms.Pinning = ebpf.PinByName
	return ms, nil
}

// DNSOriginInnerSpec returns the spec of one endpoint's map in
// dns_origin.
func DNSOriginInnerSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       "dns_origins",
		Type:       ebpf.LRUHash,
		KeySize:    DNSOriginKeySize,
		ValueSize:  DNSOriginValueSize,
		MaxEntries: DNSOriginMaxEntries,
	}
}

// DNSOriginMapSpec returns the spec of dns_origin. A pinned dns_origin of
// an earlier layout (one LRU for all endpoints) is replaced, not migrated:
// what it holds is rebuilt by the next query.
func DNSOriginMapSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       DNSOriginMap,
		Type:       ebpf.HashOfMaps,
		KeySize:    4,
		ValueSize:  4,
		MaxEntries: DNSOriginMaxEndpoints,
		InnerMap:   DNSOriginInnerSpec(),
		Pinning:    ebpf.PinByName,
	}
}

// DNSOriginLostMapSpec returns the spec of dns_origin_lost.
func DNSOriginLostMapSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       DNSOriginLostMap,
		Type:       ebpf.PerCPUArray,
		KeySize:    4,
		ValueSize:  8,
		MaxEntries: 1,
		Pinning:    ebpf.PinByName,
	}
}

// DNSConfigMapSpec returns the spec of dns_config.
func DNSConfigMapSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       DNSConfigMap,
		Type:       ebpf.Array,
		KeySize:    4,
		ValueSize:  DNSConfigValueSize,
		MaxEntries: 1,
		Pinning:    ebpf.PinByName,
	}
}

// OpenDNSSockMap opens dns_sk pinned in pinDir, creating and pinning it
// if missing, from spec (DNSSockMapSpec). The policy programs and the
// socket load balancer's share it and open it independently: when both
// create it at once, the one whose pin loses opens the other's.
func OpenDNSSockMap(log *slog.Logger, spec *ebpf.MapSpec, pinDir string) (*ebpf.Map, error) {
	pm, err := OpenPinnedMap(log, spec, pinDir, nil)
	if err != nil {
		// The other side may have pinned it meanwhile.
		pm, err = OpenPinnedMap(log, spec, pinDir, nil)
	}
	if err != nil {
		return nil, err
	}
	return pm.Map, nil
}
