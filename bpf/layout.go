package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"

	"github.com/cilium/ebpf"
)

// Be16 is a 16-bit field stored in network byte order, for use in map keys and
// values. The library marshals integer fields in host order, so a port or a
// rev-NAT index that the datapath reads as __be16 must be a byte array.
type Be16 [2]byte

// NewBe16 returns v in network byte order.
func NewBe16(v uint16) Be16 {
	var b Be16
	binary.BigEndian.PutUint16(b[:], v)
	return b
}

// Uint16 returns the value in host terms.
func (b Be16) Uint16() uint16 {
	return binary.BigEndian.Uint16(b[:])
}

// Be32 is a 32-bit field stored in network byte order, for use in map keys and
// values. IPv4 addresses need no conversion: netip.Addr.As4 already yields
// network order.
type Be32 [4]byte

// NewBe32 returns v in network byte order.
func NewBe32(v uint32) Be32 {
	var b Be32
	binary.BigEndian.PutUint32(b[:], v)
	return b
}

// Uint32 returns the value in host terms.
func (b Be32) Uint32() uint32 {
	return binary.BigEndian.Uint32(b[:])
}

// CheckLayout verifies that the Go types K and V encode to exactly the key and
// value sizes of spec, so that a struct that drifted from its C counterpart is
// caught by a test or at startup instead of by the first failing map update.
// Only sizes are checked: fields swapped within the same size go unnoticed.
//
// Sizes are those of encoding/binary, which is how the library marshals types
// with implicit padding: Go's padding does not count, so C padding must be
// spelled out as explicit fields.
func CheckLayout[K, V any](spec *ebpf.MapSpec) error {
	if spec == nil {
		return errors.New("check layout: nil spec")
	}
	return errors.Join(
		checkSize[K](spec.Name, "key", spec.KeySize),
		checkSize[V](spec.Name, "value", spec.ValueSize),
	)
}

func checkSize[T any](mapName, what string, want uint32) error {
	typ := reflect.TypeFor[T]()
	size := binary.Size(new(T))
	// binary.Size measures a slice by its length, which says nothing about
	// the values a map would be given.
	if size < 0 || typ.Kind() == reflect.Slice {
		return fmt.Errorf("map %s: %s type %s has no fixed size", mapName, what, typ)
	}
	if uint32(size) != want {
		return fmt.Errorf("map %s: %s type %s is %d bytes, the spec says %d", mapName, what, typ, size, want)
	}
	return nil
}
