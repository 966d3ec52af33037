package nodeport

import (
	"reflect"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"

	"github.com/apiary-net/apiary/bpf"
)

// affinityVal is struct np_affinity_val, which only the programs write.
type affinityVal struct {
	LastUsed  uint64
	BackendID uint32
	Pad       uint32
}

// affinityKey4 is struct np4_affinity_key.
type affinityKey4 struct {
	Client [4]byte
	RevNat bpf.Be16
	Pad    uint16
}

// affinityKey6 is struct np6_affinity_key.
type affinityKey6 struct {
	Client [16]byte
	RevNat bpf.Be16
	Pad    uint16
}

// TestLayout compares the C structs of the compiled object, through its
// BTF, with the Go types the agent reads and writes the maps with, and the
// maps the programs share with the load balancer with the agent's specs.
func TestLayout(t *testing.T) {
	spec, err := Spec()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		cStruct string
		goType  reflect.Type
	}{
		{"lb4_key", reflect.TypeFor[bpf.LB4ServiceKey]()},
		{"lb4_service", reflect.TypeFor[bpf.LB4ServiceValue]()},
		{"lb4_backend", reflect.TypeFor[bpf.LB4BackendValue]()},
		{"lb_affinity_match", reflect.TypeFor[bpf.LBAffinityMatchKey]()},
		{"np_device", reflect.TypeFor[Device]()},
		{"np4_key", reflect.TypeFor[NATKey]()},
		{"np4_entry", reflect.TypeFor[NATEntry]()},
		{"np_srcrange4_key", reflect.TypeFor[SourceRangeKey]()},
		{"np4_affinity_key", reflect.TypeFor[affinityKey4]()},
		{"np6_affinity_key", reflect.TypeFor[affinityKey6]()},
		{"lb6_key", reflect.TypeFor[bpf.LB6ServiceKey]()},
		{"lb6_backend", reflect.TypeFor[bpf.LB6BackendValue]()},
		{"np6_key", reflect.TypeFor[NAT6Key]()},
		{"np6_entry", reflect.TypeFor[NAT6Entry]()},
		{"np_srcrange6_key", reflect.TypeFor[SourceRange6Key]()},
		{"lb_maglev_key", reflect.TypeFor[MaglevKey]()},
		{"np_affinity_val", reflect.TypeFor[affinityVal]()},
	} {
		t.Run(tc.cStruct, func(t *testing.T) {
			var st *btf.Struct
			if err := spec.Types.TypeByName(tc.cStruct, &st); err != nil {
				t.Fatalf("struct %s in the object's BTF: %s", tc.cStruct, err)
			}
			if got, want := st.Size, uint32(tc.goType.Size()); got != want {
				t.Errorf("struct %s is %d bytes, %s is %d", tc.cStruct, got, tc.goType, want)
			}
			if got, want := len(st.Members), tc.goType.NumField(); got != want {
				t.Fatalf("struct %s has %d fields, %s has %d", tc.cStruct, got, tc.goType, want)
			}
			for i, m := range st.Members {
				f := tc.goType.Field(i)
				csize, err := btf.Sizeof(m.Type)
				if err != nil {
					t.Fatal(err)
				}
				if m.Offset.Bytes() != uint32(f.Offset) || uint32(csize) != uint32(f.Type.Size()) {
					t.Errorf("%s.%s at %d (%d bytes), %s.%s at %d (%d bytes)",
						tc.cStruct, m.Name, m.Offset.Bytes(), csize, tc.goType.Name(), f.Name, f.Offset, f.Type.Size())
				}
			}
		})
	}
	for _, name := range []string{bpf.LB4ServicesMap, bpf.LB4BackendsMap, bpf.LB6ServicesMap, bpf.LB6BackendsMap, bpf.LBAffinityMatchMap} {
		want, err := bpf.LBMapSpec(name, 16)
		if err != nil {
			t.Fatal(err)
		}
		got := spec.Maps[name]
		if got == nil {
			t.Fatalf("object has no map %s", name)
		}
		if got.Type != want.Type || got.KeySize != want.KeySize || got.ValueSize != want.ValueSize || got.Flags != want.Flags {
			t.Errorf("map %s: object says %v key %d value %d flags %#x, the agent %v key %d value %d flags %#x",
				name, got.Type, got.KeySize, got.ValueSize, got.Flags, want.Type, want.KeySize, want.ValueSize, want.Flags)
		}
	}
	for _, tc := range []struct {
		name       string
		typ        ebpf.MapType
		key, value reflect.Type
	}{
		{DevicesMap, ebpf.Hash, reflect.TypeFor[uint32](), reflect.TypeFor[Device]()},
		{NAT4Map, ebpf.Hash, reflect.TypeFor[NATKey](), reflect.TypeFor[NATEntry]()},
		{SourceRange4Map, ebpf.LPMTrie, reflect.TypeFor[SourceRangeKey](), reflect.TypeFor[uint8]()},
		{NAT6Map, ebpf.Hash, reflect.TypeFor[NAT6Key](), reflect.TypeFor[NAT6Entry]()},
		{SourceRange6Map, ebpf.LPMTrie, reflect.TypeFor[SourceRange6Key](), reflect.TypeFor[uint8]()},
		{Affinity4Map, ebpf.LRUHash, reflect.TypeFor[affinityKey4](), reflect.TypeFor[affinityVal]()},
		{Affinity6Map, ebpf.LRUHash, reflect.TypeFor[affinityKey6](), reflect.TypeFor[affinityVal]()},
	} {
		ms, err := MapSpec(tc.name, 16)
		if err != nil {
			t.Fatal(err)
		}
		if ms.Type != tc.typ || ms.KeySize != uint32(tc.key.Size()) || ms.ValueSize != uint32(tc.value.Size()) {
			t.Errorf("map %s: %v key %d value %d, want a %v of %s to %s", tc.name, ms.Type, ms.KeySize, ms.ValueSize, tc.typ, tc.key, tc.value)
		}
	}
	if ms, _ := MapSpec(NAT4Map, 1000); ms.MaxEntries != 1000 {
		t.Errorf("MapSpec(%s, 1000) has %d entries", NAT4Map, ms.MaxEntries)
	}
	if _, err := MapSpec(bpf.LB4ServicesMap, 16); err == nil {
		t.Errorf("MapSpec gave a spec of the agent's %s", bpf.LB4ServicesMap)
	}
}
