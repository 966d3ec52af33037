package policyprog

import (
	"encoding/binary"
	"net/netip"
	"reflect"
	"strings"
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
		{"policy_key", reflect.TypeFor[bpf.PolicyKey]()},
		{"policy_value", reflect.TypeFor[bpf.PolicyValue]()},
		{"policy_endpoint", reflect.TypeFor[bpf.PolicyEndpointValue]()},
		{"policy_event", reflect.TypeFor[bpf.PolicyEvent]()},
		{"event_budget", reflect.TypeFor[bpf.PolicyEventBudget]()},
		{"ipcache_key", reflect.TypeFor[bpf.IPCacheKey]()},
		{"remote_endpoint_info", reflect.TypeFor[bpf.IPCacheValue]()},
		{"dns_sock", reflect.TypeFor[bpf.DNSSock]()},
		{"dns_config", reflect.TypeFor[bpf.DNSConfig]()},
		{"dns_origin_key", reflect.TypeFor[bpf.DNSOriginKey]()},
		{"dns_origin", reflect.TypeFor[bpf.DNSOrigin]()},
		{"policy_iface", reflect.TypeFor[bpf.PolicyIfaceValue]()},
		{"iface_flow", reflect.TypeFor[bpf.PolicyIfaceFlowKey]()},
		{"iface_frag", reflect.TypeFor[bpf.PolicyIfaceFragKey]()},
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

	// The maps' declared type, key and value sizes and flags, which loading
	// checks against the agent's maps, agree with the agent's specs.
	for _, want := range []*ebpf.MapSpec{
		bpf.PolicyMapSpec(16),
		bpf.PolicyEndpointsMapSpec(16),
		bpf.PolicyEndpointsGenMapSpec(),
		bpf.PolicyStatsMapSpec(),
		bpf.IPCacheMapSpec(16),
		bpf.PolicyEventsMapSpec(4096),
		bpf.DNSOriginMapSpec(),
		bpf.DNSConfigMapSpec(),
	} {
		got := spec.Maps[want.Name]
		if got == nil {
			t.Errorf("object has no map %s", want.Name)
			continue
		}
		if got.Type != want.Type || got.KeySize != want.KeySize || got.ValueSize != want.ValueSize || got.Flags != want.Flags {
			t.Errorf("map %s: object says %v key %d value %d flags %#x, the agent %v key %d value %d flags %#x",
				want.Name, got.Type, got.KeySize, got.ValueSize, got.Flags, want.Type, want.KeySize, want.ValueSize, want.Flags)
		}
	}
	// A socket's flows: the size the agent documents, and its slots.
	if got := spec.Maps[bpf.PolicySockMap]; got == nil || got.Type != ebpf.SkStorage || got.ValueSize != bpf.PolicySockValueSize {
		t.Errorf("map %s: %+v, want socket storage of %d bytes", bpf.PolicySockMap, got, bpf.PolicySockValueSize)
	}
	var sk *btf.Struct
	if err := spec.Types.TypeByName("policy_sk", &sk); err != nil {
		t.Fatal(err)
	}
	for _, m := range sk.Members {
		if arr, ok := m.Type.(*btf.Array); ok && m.Name == "slots" && arr.Nelems != bpf.PolicyFlowSlots {
			t.Errorf("policy_sk has %d slots, the agent says %d", arr.Nelems, bpf.PolicyFlowSlots)
		}
	}
	// Stats are indexed by direction and verdict: the object must have
	// room for every index the agent reads.
	if got := spec.Maps[bpf.PolicyStatsMap].MaxEntries; got != bpf.PolicyStatsEntries {
		t.Errorf("map %s has %d entries, the agent reads %d", bpf.PolicyStatsMap, got, bpf.PolicyStatsEntries)
	}
	// The object's own ring (replaced by the agent's) is the default size.
	if got := spec.Maps[bpf.PolicyEventsMap].MaxEntries; got != bpf.DefaultPolicyEventsSize {
		t.Errorf("map %s is %d bytes, the agent's default %d", bpf.PolicyEventsMap, got, bpf.DefaultPolicyEventsSize)
	}
}

// TestParsePolicyEvent decodes an event as the library would marshal the
// Go type, which TestLayout compares with the C struct.
func TestParsePolicyEvent(t *testing.T) {
	want := bpf.PolicyEvent{
		TimeNs: 0x0102030405060708, EndpointID: 9, RemoteIdentity: 0x10203, Cookie: 0xa0b0c0d,
		LocalAddr: netip.MustParseAddr("10.0.0.1").As16(), RemoteAddr: netip.MustParseAddr("2001:db8::7").As16(),
		LocalPort: bpf.NewBe16(8080), RemotePort: bpf.NewBe16(40000),
		Protocol: 6, Direction: bpf.PolicyEgress, Verdict: bpf.PolicyVerdictAudited,
		Reason: bpf.PolicyReasonDefaultDeny, Hook: bpf.PolicyHookSendmsg6, Family: 6, Pad: [2]byte{1, 2},
	}
	raw, err := binary.Append(nil, binary.NativeEndian, want)
	if err != nil {
		t.Fatal(err)
	}
	if len(raw) != bpf.PolicyEventSize {
		t.Fatalf("PolicyEvent marshals to %d bytes, PolicyEventSize is %d", len(raw), bpf.PolicyEventSize)
	}
	got, err := bpf.ParsePolicyEvent(raw)
	if err != nil || got != want {
		t.Errorf("ParsePolicyEvent: %+v, %v; want %+v", got, err, want)
	}
	if _, err := bpf.ParsePolicyEvent(raw[:bpf.PolicyEventSize-1]); err == nil {
		t.Error("ParsePolicyEvent accepted a short record")
	}
}

// TestLoad loads the programs with the agent's pinned maps in place of the
// object's, sized differently from the object's defaults, as the agent does.
func TestLoad(t *testing.T) {
	pinDir := testenv.BPFPinDir(t)
	open := func(spec *ebpf.MapSpec) *ebpf.Map {
		pm, err := bpf.OpenPinnedMap(nil, spec, pinDir, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pm.Close() })
		return pm.Map
	}
	m := Maps{
		Policy:    open(bpf.PolicyMapSpec(1024)),
		Endpoints: open(bpf.PolicyEndpointsMapSpec(128)),
		Sock:      open(sockSpec(t)),
		Stats:     open(bpf.PolicyStatsMapSpec()),
		IPCache:   open(bpf.IPCacheMapSpec(1024)),
		Prefixes:  open(bpf.PolicyPrefixesMapSpec(1024)),
		Events:    open(bpf.PolicyEventsMapSpec(1 << 16)),
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

	// A map of the wrong shape is refused.
	m.IPCache = m.Policy
	if _, err := Load(m); err == nil {
		t.Error("Load accepted the policy map as the ipcache")
	}
	m.IPCache = nil
	if _, err := Load(m); err == nil {
		t.Error("Load accepted no ipcache")
	}
	m.IPCache = open(bpf.IPCacheMapSpec(1024))
	m.Events = nil
	if _, err := Load(m); err == nil || !strings.Contains(err.Error(), "Events") {
		t.Errorf("Load without events: %v, want an error naming Maps.Events", err)
	}
}
