package bpf

import (
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// bpfFTokenFD is BPF_F_TOKEN_FD, which golang.org/x/sys/unix does not define.
const bpfFTokenFD = 1 << 16

// transientFlags are map_flags that only affect the creating call or the file
// descriptor it returns. The kernel does not store them with the map, so a
// pinned map never reports them even when its spec asks for them.
const transientFlags = unix.BPF_F_RDONLY | unix.BPF_F_WRONLY | bpfFTokenFD

// mapAttrs are the attributes of a map that fix its layout and behaviour:
// when any of them differs, the map cannot be reused and must be replaced.
type mapAttrs struct {
	typ        ebpf.MapType
	keySize    uint32
	valueSize  uint32
	maxEntries uint32
	flags      uint32
}

// pinnedAttrs returns the attributes of m as the kernel reports them.
func pinnedAttrs(m *ebpf.Map) mapAttrs {
	return mapAttrs{
		typ:        m.Type(),
		keySize:    m.KeySize(),
		valueSize:  m.ValueSize(),
		maxEntries: m.MaxEntries(),
		flags:      m.Flags(),
	}
}

// wantAttrs returns the attributes a map created from spec would report once
// pinned. They differ from the spec's fields where the library fills in
// fields left zero and where the kernel drops or adds flags; comparing raw
// fields would replace such maps on every start.
//
// ebpf.MapSpec.Compatible (v0.22.0) makes the same fill-ins but is not used:
// it answers with one error for any difference, where the agent must tell a
// new size (the entries are copied into a new map) from a new layout (they
// cannot be), and it compares the transient flags (BPF_F_RDONLY, ...) the
// kernel never stores, so such a map would never be compatible.
func wantAttrs(spec *ebpf.MapSpec, pinned mapAttrs) (mapAttrs, error) {
	want := mapAttrs{
		typ:        spec.Type,
		keySize:    spec.KeySize,
		valueSize:  spec.ValueSize,
		maxEntries: spec.MaxEntries,
		flags:      spec.Flags &^ transientFlags,
	}

	switch spec.Type {
	case ebpf.ArrayOfMaps, ebpf.HashOfMaps:
		if want.valueSize == 0 {
			want.valueSize = 4
		}
	case ebpf.PerfEventArray, ebpf.CPUMap:
		if spec.Type == ebpf.PerfEventArray {
			if want.keySize == 0 {
				want.keySize = 4
			}
			if want.valueSize == 0 {
				want.valueSize = 4
			}
		}
		// The library sizes these per possible CPU and clamps larger values.
		n, err := ebpf.PossibleCPU()
		if err != nil {
			return mapAttrs{}, fmt.Errorf("size %s: %w", spec.Type, err)
		}
		if want.maxEntries == 0 || want.maxEntries > uint32(n) {
			want.maxEntries = uint32(n)
		}
	case ebpf.DevMap, ebpf.DevMapHash:
		// The kernel sets BPF_F_RDONLY_PROG on device maps whatever the caller
		// asked for (since commit 0cdbb4b09a06, "devmap: Allow map lookups
		// from eBPF").
		want.flags |= pinned.flags & unix.BPF_F_RDONLY_PROG
	}
	return want, nil
}

// describeMismatch returns which attributes of the pinned map m differ from
// those spec asks for, as "old → new" pairs for logs, or "" when m can be
// reused as it is.
func describeMismatch(spec *ebpf.MapSpec, m *ebpf.Map) (string, error) {
	got := pinnedAttrs(m)
	want, err := wantAttrs(spec, got)
	if err != nil {
		return "", err
	}

	var diffs []string
	if got.typ != want.typ {
		diffs = append(diffs, fmt.Sprintf("type %s → %s", got.typ, want.typ))
	}
	if got.keySize != want.keySize {
		diffs = append(diffs, fmt.Sprintf("key size %d → %d", got.keySize, want.keySize))
	}
	if got.valueSize != want.valueSize {
		diffs = append(diffs, fmt.Sprintf("value size %d → %d", got.valueSize, want.valueSize))
	}
	if got.maxEntries != want.maxEntries {
		diffs = append(diffs, fmt.Sprintf("max entries %d → %d", got.maxEntries, want.maxEntries))
	}
	if got.flags != want.flags {
		diffs = append(diffs, fmt.Sprintf("flags %#x → %#x", got.flags, want.flags))
	}
	return strings.Join(diffs, ", "), nil
}

// layoutDiffs returns how the layout of got (type, key size, value size)
// differs from want, as "key size 8, want 12", or nil when it is the same.
// A map of another layout holds entries that mean something else: they can
// only be converted by code written for both layouts.
func layoutDiffs(got, want mapAttrs) []string {
	var diffs []string
	if got.typ != want.typ {
		diffs = append(diffs, fmt.Sprintf("type %s, want %s", got.typ, want.typ))
	}
	if got.keySize != want.keySize {
		diffs = append(diffs, fmt.Sprintf("key size %d, want %d", got.keySize, want.keySize))
	}
	if got.valueSize != want.valueSize {
		diffs = append(diffs, fmt.Sprintf("value size %d, want %d", got.valueSize, want.valueSize))
	}
	return diffs
}

// LayoutError says that a pinned map has another layout (type, key size or
// value size) than the spec asks for, so that its entries cannot be read,
// let alone copied, with the spec's key and value types. It comes from an
// older or newer agent, or from another program using the pin directory.
type LayoutError struct {
	// Name is the map's name, Path its pin.
	Name, Path string
	// Diffs are the differences, such as "key size 8, want 12".
	Diffs []string
}

func (e *LayoutError) Error() string {
	return fmt.Sprintf("pinned map %s has %s: its entries cannot be converted; remove it (rm %s) to have an empty one created, "+
		"or use another pin directory", e.Name, strings.Join(e.Diffs, "; "), e.Path)
}

// CheckLayoutOf returns a *LayoutError if m, pinned at path, does not have
// the type, key size and value size of spec, and nil if it does. Readers of
// pinned maps call it before they decode entries with the spec's types.
func CheckLayoutOf(m *ebpf.Map, spec *ebpf.MapSpec, path string) error {
	got := pinnedAttrs(m)
	want, err := wantAttrs(spec, got)
	if err != nil {
		return err
	}
	if diffs := layoutDiffs(got, want); len(diffs) > 0 {
		return &LayoutError{Name: spec.Name, Path: path, Diffs: diffs}
	}
	return nil
}
