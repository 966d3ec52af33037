package bpf

import (
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// Map is what the reconcilers do with a BPF map: write, delete and read it,
// one entry or a batch at a time, with the semantics and errors of
// *ebpf.Map, which implements it. Keys and values are the Go types of the
// map's layout (or pointers to them); batches are slices of them.
//
// Other implementations (package bpf/memmap: a map in memory, and a wrapper
// that injects faults) let the reconcilers and the cells that use them run
// without the kernel.
type Map interface {
	// Put creates or replaces the entry of key.
	Put(key, value any) error
	// Update writes the entry of key as flags allow.
	Update(key, value any, flags ebpf.MapUpdateFlags) error
	// Lookup reads the value of key into valueOut (a pointer); a missing
	// key is ebpf.ErrKeyNotExist.
	Lookup(key, valueOut any) error
	// Delete removes the entry of key; a missing key is
	// ebpf.ErrKeyNotExist.
	Delete(key any) error
	// BatchUpdate writes the entries in order and returns how many were
	// written before the first failure.
	BatchUpdate(keys, values any, opts *ebpf.BatchOptions) (int, error)
	// BatchDelete removes the keys in order and returns how many were
	// removed before the first failure (a missing key fails with
	// ebpf.ErrKeyNotExist).
	BatchDelete(keys any, opts *ebpf.BatchOptions) (int, error)
	// BatchLookup reads the next entries after cursor into the slices
	// keysOut and valuesOut; ebpf.ErrKeyNotExist says that no entry
	// follows the ones returned.
	BatchLookup(cursor *ebpf.MapBatchCursor, keysOut, valuesOut any, opts *ebpf.BatchOptions) (int, error)
	// Type, KeySize, ValueSize and MaxEntries are the map's attributes.
	Type() ebpf.MapType
	KeySize() uint32
	ValueSize() uint32
	MaxEntries() uint32
	// Close releases the handle; a pinned map's contents stay.
	Close() error
	// String names the map in errors.
	String() string
}

var _ Map = (*ebpf.Map)(nil)

// OpenedMap is a map an Opener opened, together with how it was obtained
// (see PinnedMap).
type OpenedMap struct {
	Map
	// Path is where the map is pinned.
	Path string
	// Outcome says whether the map was created, reused or replaced.
	Outcome PinOutcome
	// Mismatch says, when Outcome is PinReplaced, which attributes of the
	// old pin differed from the spec.
	Mismatch string
}

// Opener opens (creating or replacing) the map of spec pinned in pinDir,
// as OpenPinnedMap does. The agent's is KernelMaps; tests may use maps in
// memory (memmap.Pins).
type Opener interface {
	OpenMap(log *slog.Logger, spec *ebpf.MapSpec, pinDir string, migrate MigrateFunc, opts ...PinOption) (*OpenedMap, error)
	// LoadMap opens the map pinned as pinDir/name as it is, whatever its
	// attributes.
	LoadMap(pinDir, name string) (Map, error)
	// RemoveMap removes the pin pinDir/name, as RemovePinnedMap does.
	RemoveMap(pinDir, name string) error
}

// KernelMaps opens maps pinned on bpffs with OpenPinnedMap.
var KernelMaps Opener = kernelMaps{}

type kernelMaps struct{}

func (kernelMaps) OpenMap(log *slog.Logger, spec *ebpf.MapSpec, pinDir string, migrate MigrateFunc, opts ...PinOption) (*OpenedMap, error) {
	pm, err := OpenPinnedMap(log, spec, pinDir, migrate, opts...)
	if err != nil {
		return nil, err
	}
	return &OpenedMap{Map: pm.Map, Path: pm.Path, Outcome: pm.Outcome, Mismatch: pm.Mismatch}, nil
}

// KernelMap returns the *ebpf.Map behind m, for what only the kernel's maps
// can do (a program's map references): an error names m when it is not
// one.
func KernelMap(m Map) (*ebpf.Map, error) {
	km, ok := m.(*ebpf.Map)
	if !ok {
		return nil, fmt.Errorf("%s is not a kernel map", m)
	}
	return km, nil
}

// OpenMaps opens (or creates) through opener the maps of specs pinned in
// pinDir, in order and with no migration (for maps whose content is
// rebuilt): when one cannot be opened, those opened before it are closed.
func OpenMaps(opener Opener, log *slog.Logger, pinDir string, specs ...*ebpf.MapSpec) ([]Map, error) {
	opened := make([]Map, 0, len(specs))
	for _, spec := range specs {
		om, err := opener.OpenMap(log, spec, pinDir, nil)
		if err != nil {
			for _, m := range opened {
				m.Close()
			}
			return nil, err
		}
		opened = append(opened, om.Map)
	}
	return opened, nil
}

// MapInto is a map and where ToKernelMaps puts the kernel's map behind it.
type MapInto struct {
	m    Map
	into **ebpf.Map
}

// Into pairs m with the variable ToKernelMaps sets to the kernel's map behind
// it.
func Into(into **ebpf.Map, m Map) MapInto { return MapInto{m: m, into: into} }

// ToKernelMaps sets each pair's variable to the kernel's map behind its map,
// for a program loader's map references; a map in memory is an error.
func ToKernelMaps(maps ...MapInto) error {
	for _, p := range maps {
		km, err := KernelMap(p.m)
		if err != nil {
			return err
		}
		*p.into = km
	}
	return nil
}

func (kernelMaps) LoadMap(pinDir, name string) (Map, error) {
	if err := checkPinName(name); err != nil {
		return nil, err
	}
	return ebpf.LoadPinnedMap(filepath.Join(pinDir, name), nil)
}

func (kernelMaps) RemoveMap(pinDir, name string) error { return RemovePinnedMap(pinDir, name) }
