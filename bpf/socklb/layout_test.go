package socklb

import (
	"reflect"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// TestLayout compares the C structs of the compiled object, through its BTF,
// with the Go types the agent writes the maps with: same size, same number
// of fields, each at the same offset with the same size.
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
		{"lb4_reverse_nat", reflect.TypeFor[bpf.LB4RevNatValue]()},
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
						tc.cStruct, m.Name, m.Offset.Bytes(), csize,
						tc.goType.Name(), f.Name, f.Offset, f.Type.Size())
				}
			}
		})
	}

	// The maps' declared key and value sizes, which loading checks
	// against the pinned maps, agree with the agent's specs.
	for _, name := range bpf.LBMapNames {
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
}

// TestLoad loads the programs with the agent's pinned maps in place of the
// object's, sized differently from the object's defaults, as the agent does.
func TestLoad(t *testing.T) {
	pinDir := testenv.BPFPinDir(t)
	var m Maps
	for _, name := range bpf.LBMapNames {
		spec, err := bpf.LBMapSpec(name, 1024)
		if err != nil {
			t.Fatal(err)
		}
		pm, err := bpf.OpenPinnedMap(nil, spec, pinDir, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pm.Close() })
		switch name {
		case bpf.LB4ServicesMap:
			m.Services = pm.Map
		case bpf.LB4BackendsMap:
			m.Backends = pm.Map
		case bpf.LB4RevNatMap:
			m.RevNat = pm.Map
		}
	}
	srn, err := SockRevNatSpec(4096)
	if err != nil {
		t.Fatal(err)
	}
	m.SockRevNat, err = ebpf.NewMap(srn)
	if err != nil {
		t.Fatal(err)
	}
	defer m.SockRevNat.Close()

	progs, err := Load(m)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range Hooks {
		p := progs[h.Program]
		if p == nil {
			t.Errorf("no program %s for hook %s", h.Program, h.Name)
			continue
		}
		p.Close()
	}
	if len(progs) != len(Hooks) {
		t.Errorf("%d programs, %d hooks", len(progs), len(Hooks))
	}

	// A map of the wrong shape is refused.
	m.RevNat = m.Backends
	if _, err := Load(m); err == nil {
		t.Error("Load accepted lb4_backends as lb4_reverse_nat")
	}
}
