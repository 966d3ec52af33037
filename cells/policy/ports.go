package policy

import (
	"math/bits"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/tables"
)

// portKey is the protocol and port prefix of a policy entry. proto 0 is
// any protocol and port.
type portKey struct {
	proto uint8
	port  uint16
	bits  uint8 // 0–16 leading bits of port
}

// covers reports whether k matches everything o matches.
func (k portKey) covers(o portKey) bool {
	if k.proto == 0 {
		return true
	}
	if k.proto != o.proto || k.bits > o.bits {
		return false
	}
	if k.bits == 0 {
		return true
	}
	mask := ^uint16(0) << (16 - k.bits)
	return o.port&mask == k.port
}

// anyPort is the entry key of every protocol and port.
var anyPort = portKey{}

// rangePrefixes returns the fewest port prefixes that cover first..last
// exactly: the reference's way of putting ranges in an LPM trie, which
// costs at most 2·16−2 entries per range (30 for 1–65535).
func rangePrefixes(proto uint8, first, last uint16) []portKey {
	if first == 0 && last == 0xffff {
		return []portKey{{proto: proto}}
	}
	var out []portKey
	lo, hi := uint32(first), uint32(last)
	for lo <= hi {
		// The largest aligned block starting at lo that fits in lo..hi.
		size := uint32(1) << bits.TrailingZeros32(lo|1<<16)
		for lo+size-1 > hi {
			size >>= 1
		}
		out = append(out, portKey{proto: proto, port: uint16(lo), bits: uint8(16 - bits.TrailingZeros32(size))})
		lo += size
	}
	return out
}

// protocols returns the protocol numbers of a PortRule protocol.
func protocols(p string) []uint8 {
	switch p {
	case tables.ProtoTCP:
		return []uint8{unix.IPPROTO_TCP}
	case tables.ProtoUDP:
		return []uint8{unix.IPPROTO_UDP}
	case tables.ProtoSCTP:
		return []uint8{unix.IPPROTO_SCTP}
	}
	return []uint8{unix.IPPROTO_TCP, unix.IPPROTO_UDP, unix.IPPROTO_SCTP}
}

// protocolNumber returns the number of a named port's protocol.
func protocolNumber(p string) uint8 {
	switch p {
	case tables.ProtoUDP:
		return unix.IPPROTO_UDP
	case tables.ProtoSCTP:
		return unix.IPPROTO_SCTP
	}
	return unix.IPPROTO_TCP
}

// portKeys returns the entry keys of a rule's ports: anyPort for a rule
// without ports. Named ports are looked up in named; a name it does not
// have contributes nothing, as a port that does not exist.
func portKeys(ports []tables.PortRule, named func(name string) []tables.NamedPort) []portKey {
	if len(ports) == 0 {
		return []portKey{anyPort}
	}
	var out []portKey
	for _, pr := range ports {
		switch {
		case pr.Name != "":
			for _, np := range named(pr.Name) {
				proto := protocolNumber(np.Protocol)
				if pr.Protocol != tables.ProtoAny && pr.Protocol != "" && !slices.Contains(protocols(pr.Protocol), proto) {
					continue
				}
				out = append(out, portKey{proto: proto, port: np.Port, bits: 16})
			}
		case pr.Port == 0 && (pr.Protocol == tables.ProtoAny || pr.Protocol == ""):
			out = append(out, anyPort)
		case pr.Port == 0:
			for _, proto := range protocols(pr.Protocol) {
				out = append(out, portKey{proto: proto})
			}
		default:
			last := pr.Port
			if pr.EndPort > pr.Port {
				last = pr.EndPort
			}
			for _, proto := range protocols(pr.Protocol) {
				out = append(out, rangePrefixes(proto, pr.Port, last)...)
			}
		}
	}
	return out
}
