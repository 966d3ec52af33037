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
// with the Go types the agent writes and reads the maps with: same size,
// same number of fields, each at the same offset with the same size. The
// socket reverse-NAT maps, which only the programs read, are checked
// against the types the tests read them with.
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
		{"lb6_key", reflect.TypeFor[bpf.LB6ServiceKey]()},
		{"lb6_service", reflect.TypeFor[bpf.LB6ServiceValue]()},
		{"lb6_backend", reflect.TypeFor[bpf.LB6BackendValue]()},
		{"lb6_reverse_nat", reflect.TypeFor[bpf.LB6RevNatValue]()},
		{"lb_affinity_match", reflect.TypeFor[bpf.LBAffinityMatchKey]()},
		{"lb4_affinity_key", reflect.TypeFor[bpf.LB4AffinityKey]()},
		{"lb6_affinity_key", reflect.TypeFor[bpf.LB6AffinityKey]()},
		{"lb_affinity_val", reflect.TypeFor[bpf.LBAffinityValue]()},
		{"lb4_sock_xlat", reflect.TypeFor[sockXlat4]()},
		{"lb4_sock_state", reflect.TypeFor[sockState4]()},
		{"lb6_sock_xlat", reflect.TypeFor[sockXlat6]()},
		{"lb6_sock_state", reflect.TypeFor[sockState6]()},
		{"xlate_event", reflect.TypeFor[XlateEvent]()},
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

	// The programs' own maps hold the types above: the socket
	// reverse-NAT maps are socket storage (key: a socket's fd, from user
	// space), the affinity maps LRU hashes.
	for _, tc := range []struct {
		name       string
		typ        ebpf.MapType
		key, value reflect.Type
	}{
		{SockRevNat4Map, ebpf.SkStorage, reflect.TypeFor[int32](), reflect.TypeFor[sockState4]()},
		{SockRevNat6Map, ebpf.SkStorage, reflect.TypeFor[int32](), reflect.TypeFor[sockState6]()},
		{bpf.LB4AffinityMap, ebpf.LRUHash, reflect.TypeFor[bpf.LB4AffinityKey](), reflect.TypeFor[bpf.LBAffinityValue]()},
		{bpf.LB6AffinityMap, ebpf.LRUHash, reflect.TypeFor[bpf.LB6AffinityKey](), reflect.TypeFor[bpf.LBAffinityValue]()},
	} {
		ms, err := MapSpec(tc.name, 16)
		if err != nil {
			t.Fatal(err)
		}
		if ms.Type != tc.typ || ms.KeySize != uint32(tc.key.Size()) || ms.ValueSize != uint32(tc.value.Size()) {
			t.Errorf("map %s: %v key %d value %d, want a %v of %s (%d) to %s (%d)",
				tc.name, ms.Type, ms.KeySize, ms.ValueSize, tc.typ, tc.key, tc.key.Size(), tc.value, tc.value.Size())
		}
	}
	if _, err := MapSpec(bpf.LB4ServicesMap, 16); err == nil {
		t.Errorf("MapSpec gave a spec of the agent's %s", bpf.LB4ServicesMap)
	}
}

// A socket's reverse translations (struct lb4_sock_state, ...): the
// backends it was sent to and the frontend each was chosen for.
type sockXlat4 struct {
	Backend      [4]byte
	BackendPort  bpf.Be16
	RevNat       bpf.Be16
	Frontend     [4]byte
	FrontendPort bpf.Be16
	Pad          uint16
}

type sockState4 struct {
	X    [sockXlats]sockXlat4
	Next uint32
	Pad  uint32
}

type sockXlat6 struct {
	Backend      [16]byte
	BackendPort  bpf.Be16
	RevNat       bpf.Be16
	Frontend     [16]byte
	FrontendPort bpf.Be16
	Pad          uint16
}

type sockState6 struct {
	X    [sockXlats]sockXlat6
	Next uint32
	Pad  uint32
}

// sockXlats is SOCK_XLATS: the backends a socket remembers.
const sockXlats = 8

// TestLoad loads the programs with pinned maps in place of the object's,
// sized differently from the object's defaults, as the agent does.
func TestLoad(t *testing.T) {
	pinDir := testenv.BPFPinDir(t)
	open := func(spec *ebpf.MapSpec, err error) *ebpf.Map {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		pm, err := bpf.OpenPinnedMap(nil, spec, pinDir, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pm.Close() })
		return pm.Map
	}
	lbMap := func(name string) *ebpf.Map { return open(bpf.LBMapSpec(name, 1024)) }
	ownMap := func(name string) *ebpf.Map { return open(MapSpec(name, 4096)) }
	m := Maps{
		Services4:     lbMap(bpf.LB4ServicesMap),
		Backends4:     lbMap(bpf.LB4BackendsMap),
		RevNat4:       lbMap(bpf.LB4RevNatMap),
		Services6:     lbMap(bpf.LB6ServicesMap),
		Backends6:     lbMap(bpf.LB6BackendsMap),
		RevNat6:       lbMap(bpf.LB6RevNatMap),
		AffinityMatch: lbMap(bpf.LBAffinityMatchMap),
		SockRevNat4:   ownMap(SockRevNat4Map),
		SockRevNat6:   ownMap(SockRevNat6Map),
		Affinity4:     ownMap(bpf.LB4AffinityMap),
		Affinity6:     ownMap(bpf.LB6AffinityMap),
	}

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

	// A map of the wrong shape is refused, and a missing one.
	bad := m
	bad.RevNat6 = m.Backends6
	if _, err := Load(bad); err == nil {
		t.Error("Load accepted lb6_backends as lb6_reverse_nat")
	}
	bad = m
	bad.Affinity6 = nil
	if _, err := Load(bad); err == nil {
		t.Error("Load accepted no lb6_affinity")
	}
}
