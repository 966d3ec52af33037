package policy

import (
	"fmt"
	"maps"
	"math/bits"
	"slices"
	"strconv"
	"strings"

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
// have contributes nothing, as a port that does not exist. A name that
// stands for more than one number of a protocol contributes nothing for
// that protocol either, as in the reference (which cannot tell which
// number is meant): it is returned in ambiguous, to be reported.
func portKeys(ports []tables.PortRule, named func(name string) []tables.NamedPort) (out []portKey, ambiguous []string) {
	if len(ports) == 0 {
		return []portKey{anyPort}, nil
	}
	for _, pr := range ports {
		switch {
		case pr.Name != "":
			byProto := map[uint8][]uint16{}
			for _, np := range named(pr.Name) {
				proto := protocolNumber(np.Protocol)
				if pr.Protocol != tables.ProtoAny && pr.Protocol != "" && !slices.Contains(protocols(pr.Protocol), proto) {
					continue
				}
				if !slices.Contains(byProto[proto], np.Port) {
					byProto[proto] = append(byProto[proto], np.Port)
				}
			}
			for _, proto := range slices.Sorted(maps.Keys(byProto)) {
				numbers := byProto[proto]
				if len(numbers) > 1 {
					slices.Sort(numbers)
					ambiguous = append(ambiguous, ambiguousName(pr.Name, proto, numbers))
					continue
				}
				out = append(out, portKey{proto: proto, port: numbers[0], bits: 16})
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
	return out, ambiguous
}

// ambiguousName is the warning about a port name of several numbers.
func ambiguousName(name string, proto uint8, numbers []uint16) string {
	nums := make([]string, len(numbers))
	for i, n := range numbers {
		nums[i] = strconv.Itoa(int(n))
	}
	return fmt.Sprintf("port name %q is %s %s: ambiguous, the rule uses none of them",
		name, tables.Proto(proto), strings.Join(nums, " and "))
}
