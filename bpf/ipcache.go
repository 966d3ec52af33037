package bpf

import (
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// IPCacheMap is the name (and pin file name) of the map from IP prefixes to
// security identities.
const IPCacheMap = "ipcache"

// Byte sizes of the ipcache key and value, as the datapath's C structs
// (struct ipcache_key, struct remote_endpoint_info) lay them out.
const (
	IPCacheKeySize   = 24
	IPCacheValueSize = 24
)

// DefaultIPCacheMaxEntries is the default capacity of the ipcache map.
const DefaultIPCacheMaxEntries = 512000

// Address families of an ipcache key.
const (
	IPCacheFamilyIPv4 uint8 = 1
	IPCacheFamilyIPv6 uint8 = 2
)

// ipcacheStaticPrefixBits are the bits of the key between the LPM prefix
// length and the address (cluster ID, pad, family), which are always part
// of the match so that a lookup never crosses a cluster or a family.
const ipcacheStaticPrefixBits = 32

// IPCacheKey is the key of the ipcache LPM trie (struct ipcache_key).
type IPCacheKey struct {
	// PrefixLen is the LPM prefix length: 32 static bits plus the IP
	// prefix's bits.
	PrefixLen uint32
	ClusterID uint16
	Pad       uint8
	Family    uint8
	// Addr is the address in network order; IPv4 uses the first 4 bytes.
	Addr [16]byte
}

// IPCacheValue is the value of the ipcache map (struct remote_endpoint_info).
type IPCacheValue struct {
	// Identity is the security identity of the prefix.
	Identity uint32
	// TunnelEndpoint is the address of the node hosting the prefix, IPv4 in
	// the first 4 bytes; zero for local and outside prefixes.
	TunnelEndpoint [16]byte
	Pad            [2]byte
	// Key is the encryption key index.
	Key uint8
	// Flags: bit 0 skip tunnel, 1 has tunnel endpoint, 2 IPv6 tunnel
	// endpoint, 3 remote cluster.
	Flags uint8
}

// NewIPCacheKey returns the key of prefix p in the local cluster.
func NewIPCacheKey(p netip.Prefix) IPCacheKey {
	addr := p.Addr().Unmap()
	bits := p.Bits()
	if p.Addr().Is4In6() {
		bits -= 96
	}
	p = netip.PrefixFrom(addr, bits).Masked()
	k := IPCacheKey{PrefixLen: uint32(ipcacheStaticPrefixBits + p.Bits())}
	if p.Addr().Is4() {
		k.Family = IPCacheFamilyIPv4
		a := p.Addr().As4()
		copy(k.Addr[:], a[:])
	} else {
		k.Family = IPCacheFamilyIPv6
		k.Addr = p.Addr().As16()
	}
	return k
}

// Prefix returns the IP prefix of the key, or an error for a key the agent
// never writes (unknown family, impossible length).
func (k IPCacheKey) Prefix() (netip.Prefix, error) {
	bits := int(k.PrefixLen) - ipcacheStaticPrefixBits
	var addr netip.Addr
	switch k.Family {
	case IPCacheFamilyIPv4:
		addr = netip.AddrFrom4([4]byte(k.Addr[:4]))
	case IPCacheFamilyIPv6:
		addr = netip.AddrFrom16(k.Addr)
	default:
		return netip.Prefix{}, fmt.Errorf("ipcache key: unknown family %d", k.Family)
	}
	if bits < 0 || bits > addr.BitLen() {
		return netip.Prefix{}, fmt.Errorf("ipcache key: prefix length %d out of range", k.PrefixLen)
	}
	return netip.PrefixFrom(addr, bits), nil
}

// String names the key's prefix (and its cluster, when not 0), for errors.
func (k IPCacheKey) String() string {
	p, err := k.Prefix()
	if err != nil {
		return fmt.Sprintf("ipcache key of family %d, length %d", k.Family, k.PrefixLen)
	}
	if k.ClusterID != 0 {
		return fmt.Sprintf("%s@%d", p, k.ClusterID)
	}
	return p.String()
}

// PolicyPrefixesMap is the name (and pin file name) of the map from the
// prefixes policies name to the identities an address outside the cluster
// inside them has. Keys and values are the ipcache's; it never holds a
// pod's, node's or the host's own address, so that the policy programs
// find, for any address, the policy prefix holding it (see
// PolicyFlagPodAddrs).
const PolicyPrefixesMap = "policy_prefixes"

// PolicyPrefixesMapSpec returns the spec of the policy prefixes map with
// room for maxEntries prefixes.
func PolicyPrefixesMapSpec(maxEntries uint32) *ebpf.MapSpec {
	spec := IPCacheMapSpec(maxEntries)
	spec.Name = PolicyPrefixesMap
	return spec
}

// IPCacheMapSpec returns the spec of the ipcache map with room for
// maxEntries prefixes. The map is an LPM trie allocated as it fills
// (BPF_F_NO_PREALLOC, which LPM tries require).
func IPCacheMapSpec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       IPCacheMap,
		Type:       ebpf.LPMTrie,
		KeySize:    IPCacheKeySize,
		ValueSize:  IPCacheValueSize,
		MaxEntries: maxEntries,
		Flags:      unix.BPF_F_NO_PREALLOC,
	}
}
