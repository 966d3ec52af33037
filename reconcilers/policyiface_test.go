package reconcilers_test

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/memmap"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/reconcilers"
)

// onEveryOpener runs fn as a subtest on maps in memory and, under root,
// on the kernel's (skipped without root, failing under APIARY_STRICT=1).
func onEveryOpener(t *testing.T, fn func(t *testing.T, opener bpf.Opener, dir string, raw func(name string) bpf.Map)) {
	for _, tc := range []struct {
		name string
		open func(t *testing.T) (bpf.Opener, string)
	}{
		{"memmap", func(*testing.T) (bpf.Opener, string) { return memmap.NewPins(nil), "/test" }},
		{"kernel", func(t *testing.T) (bpf.Opener, string) { return bpf.KernelMaps, testenv.BPFPinDir(t) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opener, dir := tc.open(t)
			raw := func(name string) bpf.Map {
				t.Helper()
				m, err := opener.LoadMap(dir, name)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { m.Close() })
				return m
			}
			fn(t, opener, dir, raw)
		})
	}
}

// innerID returns the ID of the inner map key has in the map of maps m
// (0: none).
func innerID(t *testing.T, m bpf.Map, key uint32) uint32 {
	t.Helper()
	var id uint32
	if err := m.Lookup(key, &id); err != nil {
		return 0
	}
	return id
}

// TestPolicyIfaces: the pod-interfaces maps through a bpf.Opener, on
// maps in memory and the kernel's: an entry is written only when the
// map holds another (apiary-cni's pending one among them), an
// interface's flow and fragment maps are kept unless fresh, a removed
// interface leaves nothing, and a restart finds what was written.
func TestPolicyIfaces(t *testing.T) {
	onEveryOpener(t, func(t *testing.T, opener bpf.Opener, dir string, raw func(string) bpf.Map) {
		p := reconcilers.NewPolicyIfaces(nil, opener, dir, 16, 64)
		if err := p.Put(7, bpf.PolicyIfaceValue{}); err == nil {
			t.Fatal("Put before Open: no error")
		}
		if err := p.Open(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		v, err := bpf.NewPolicyIfaceValue(1234, 0, []netip.Addr{netip.MustParseAddr("10.0.0.7")})
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Put(7, v); err != nil {
			t.Fatal(err)
		}
		if p.Pending(7) {
			t.Error("the agent's entry is pending")
		}
		ifaces := raw(bpf.PolicyIfacesMap)
		pending, err := bpf.NewPolicyIfaceValue(0, bpf.PolicyIfaceUnclassifiedDeny|bpf.PolicyIfacePending, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := ifaces.Put(uint32(7), pending); err != nil {
			t.Fatal(err)
		}
		if !p.Pending(7) || !p.Pending(8) {
			t.Error("apiary-cni's entry, or none, is not pending")
		}
		if err := p.Put(7, v); err != nil {
			t.Fatal(err)
		}
		var got bpf.PolicyIfaceValue
		if err := ifaces.Lookup(uint32(7), &got); err != nil || got != v {
			t.Fatalf("policy_ifaces[7] = %+v, %v; want the agent's entry again", got, err)
		}

		flows, frags := raw(bpf.PolicyIfaceFlowsMap), raw(bpf.PolicyIfaceFragsMap)
		if err := p.EnsureState(7, false); err != nil {
			t.Fatal(err)
		}
		flowID, fragID := innerID(t, flows, 7), innerID(t, frags, 7)
		if flowID == 0 || fragID == 0 {
			t.Fatalf("no flow (%d) or fragment (%d) map", flowID, fragID)
		}
		if err := p.EnsureState(7, false); err != nil {
			t.Fatal(err)
		}
		if innerID(t, flows, 7) != flowID || innerID(t, frags, 7) != fragID {
			t.Error("the maps of an interface not fresh were replaced")
		}
		if err := p.EnsureState(7, true); err != nil {
			t.Fatal(err)
		}
		if innerID(t, flows, 7) == flowID || innerID(t, frags, 7) == fragID {
			t.Error("a fresh interface kept the old maps")
		}

		// A restart: the pins hold the entries.
		p.Close()
		p = reconcilers.NewPolicyIfaces(nil, opener, dir, 16, 64)
		if err := p.Open(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		for name, list := range map[string]func() ([]int, error){
			"Interfaces":             p.Interfaces,
			"PinnedPolicyInterfaces": func() ([]int, error) { return reconcilers.PinnedPolicyInterfaces(opener, dir) },
		} {
			if got, err := list(); err != nil || !slices.Equal(got, []int{7}) {
				t.Errorf("%s = %v, %v; want [7]", name, got, err)
			}
		}
		if err := p.Remove(7); err != nil {
			t.Fatal(err)
		}
		if err := p.Remove(7); err != nil {
			t.Errorf("remove again: %v", err)
		}
		if got, err := p.Interfaces(); err != nil || len(got) != 0 {
			t.Errorf("after Remove: %v, %v", got, err)
		}
		if innerID(t, flows, 7) != 0 || innerID(t, frags, 7) != 0 {
			t.Error("the interface's flow or fragment map stayed")
		}
		if stats, err := p.Stats(); err != nil || stats != ([bpf.PolicyIfaceStatsEntries]uint64{}) {
			t.Errorf("Stats = %v, %v; want zeros", stats, err)
		}
	})
}
