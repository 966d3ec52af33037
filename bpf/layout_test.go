package bpf_test

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
)

func TestBe16(t *testing.T) {
	for _, c := range []struct {
		v    uint16
		want bpf.Be16
	}{
		{0, bpf.Be16{0, 0}},
		{80, bpf.Be16{0x00, 0x50}},
		{8080, bpf.Be16{0x1f, 0x90}},
		{0xffff, bpf.Be16{0xff, 0xff}},
	} {
		got := bpf.NewBe16(c.v)
		if got != c.want {
			t.Errorf("NewBe16(%d) = %#v, want %#v", c.v, got, c.want)
		}
		if back := got.Uint16(); back != c.v {
			t.Errorf("NewBe16(%d).Uint16() = %d", c.v, back)
		}
	}
}

func TestBe32(t *testing.T) {
	for _, c := range []struct {
		v    uint32
		want bpf.Be32
	}{
		{0, bpf.Be32{0, 0, 0, 0}},
		{0x0a000001, bpf.Be32{10, 0, 0, 1}},
		{0xdeadbeef, bpf.Be32{0xde, 0xad, 0xbe, 0xef}},
	} {
		got := bpf.NewBe32(c.v)
		if got != c.want {
			t.Errorf("NewBe32(%#x) = %#v, want %#v", c.v, got, c.want)
		}
		if back := got.Uint32(); back != c.v {
			t.Errorf("NewBe32(%#x).Uint32() = %#x", c.v, back)
		}
	}
}

// TestNetworkOrderInHostOrderStruct shows what the types are for: in a struct
// the library marshals in (little-endian) host order, they keep network order
// while plain integers do not.
func TestNetworkOrderInHostOrderStruct(t *testing.T) {
	type backend struct {
		Address [4]byte
		Port    bpf.Be16
		Slot    uint16
		ID      bpf.Be32
	}
	v := backend{
		Address: netip.MustParseAddr("10.0.0.1").As4(),
		Port:    bpf.NewBe16(8080),
		Slot:    1,
		ID:      bpf.NewBe32(0x01020304),
	}
	got, err := binary.Append(nil, binary.LittleEndian, v)
	if err != nil {
		t.Fatal(err)
	}
	want := []byte{10, 0, 0, 1, 0x1f, 0x90, 0x01, 0x00, 1, 2, 3, 4}
	if !bytes.Equal(got, want) {
		t.Errorf("encoded % x, want % x", got, want)
	}
}

// Types shaped like the lb4_services map's key and value.
type serviceKey struct {
	Address [4]byte
	Port    bpf.Be16
	Slot    uint16
	Proto   uint8
	Scope   uint8
	Pad     [2]uint8
}

type serviceValue struct {
	BackendID   uint32
	Count       uint16
	RevNatIndex bpf.Be16
	Flags       uint8
	Flags2      uint8
	QCount      uint16
}

// paddedKey has Go padding but no explicit field for it: 5 bytes encoded, 8 in memory.
type paddedKey struct {
	Proto uint8
	Addr  uint32
}

func TestCheckLayout(t *testing.T) {
	spec := &ebpf.MapSpec{Name: "lb4_services", Type: ebpf.Hash, KeySize: 12, ValueSize: 12, MaxEntries: 16}
	small := &ebpf.MapSpec{Name: "lb4_services", Type: ebpf.Hash, KeySize: 8, ValueSize: 12, MaxEntries: 16}

	cases := []struct {
		name  string
		check func() error
		want  []string // substrings of the error; none means no error
	}{
		{"match", func() error { return bpf.CheckLayout[serviceKey, serviceValue](spec) }, nil},
		{"scalars", func() error {
			return bpf.CheckLayout[uint32, [12]byte](&ebpf.MapSpec{Name: "lb4_backends", KeySize: 4, ValueSize: 12})
		}, nil},
		{"key_too_big", func() error { return bpf.CheckLayout[serviceKey, serviceValue](small) },
			[]string{"lb4_services", "key", "12 bytes", "says 8"}},
		{"value_wrong", func() error { return bpf.CheckLayout[serviceKey, uint64](spec) },
			[]string{"lb4_services", "value", "uint64", "8 bytes", "says 12"}},
		{"both_wrong", func() error { return bpf.CheckLayout[uint32, uint32](spec) },
			[]string{"key type uint32 is 4 bytes", "value type uint32 is 4 bytes"}},
		{"implicit_padding", func() error {
			return bpf.CheckLayout[paddedKey, uint32](&ebpf.MapSpec{Name: "m", KeySize: 8, ValueSize: 4})
		}, []string{"5 bytes", "says 8"}},
		{"not_fixed_size", func() error { return bpf.CheckLayout[[]byte, uint32](spec) },
			[]string{"no fixed size"}},
		{"nil_spec", func() error { return bpf.CheckLayout[uint32, uint32](nil) }, []string{"nil spec"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.check()
			if len(c.want) == 0 {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}
