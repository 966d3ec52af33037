package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
)

// InnerMaker is a Map of maps that makes its inner maps itself: the maps
// in memory of bpf/memmap, which have no file descriptors to store.
type InnerMaker interface {
	// PutInner stores a new, empty map made from spec under key.
	PutInner(key any, spec *ebpf.MapSpec) error
	// LookupInner returns the map stored under key; a missing key is
	// ebpf.ErrKeyNotExist.
	LookupInner(key any) (Map, error)
}

// LookupInner returns the map stored under key in the map of maps outer,
// to be closed by the caller; a missing key is ebpf.ErrKeyNotExist.
func LookupInner(outer Map, key any) (Map, error) {
	if km, ok := outer.(*ebpf.Map); ok {
		var inner *ebpf.Map
		if err := km.Lookup(key, &inner); err != nil {
			return nil, err
		}
		return inner, nil
	}
	if im, ok := outer.(InnerMaker); ok {
		return im.LookupInner(key)
	}
	return nil, fmt.Errorf("%s cannot store maps", outer)
}

// PutInner stores a new, empty map made from spec under key in the map of
// maps outer (a hash or array of maps), replacing the one there: the
// kernel's maps get a new map, others make it themselves (InnerMaker).
func PutInner(outer Map, key any, spec *ebpf.MapSpec) error {
	if km, ok := outer.(*ebpf.Map); ok {
		inner, err := ebpf.NewMap(spec)
		if err != nil {
			return fmt.Errorf("create: %w", err)
		}
		defer inner.Close()
		if err := km.Put(key, inner); err != nil {
			return fmt.Errorf("write %s[%v]: %w", outer, key, err)
		}
		return nil
	}
	if im, ok := outer.(InnerMaker); ok {
		if err := im.PutInner(key, spec); err != nil {
			return fmt.Errorf("write %s[%v]: %w", outer, key, err)
		}
		return nil
	}
	return fmt.Errorf("%s cannot store maps", outer)
}

// HasInner reports whether the map of maps outer holds a map under key.
// A lookup that fails otherwise than with a missing key is an error.
func HasInner(outer Map, key any) (bool, error) {
	// The kernel answers a lookup in a map of maps with the inner map's
	// ID.
	var id uint32
	err := outer.Lookup(key, &id)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, ebpf.ErrKeyNotExist):
		return false, nil
	}
	return false, err
}

// SumPerCPU fills out with the counters of the per-CPU array m (called
// name in errors), entry i into out[i], each summed over the CPUs.
func SumPerCPU(m Map, name string, out []uint64) error {
	for i := range out {
		var perCPU []uint64
		if err := m.Lookup(uint32(i), &perCPU); err != nil {
			return fmt.Errorf("read %s: %w", name, err)
		}
		out[i] = 0
		for _, v := range perCPU {
			out[i] += v
		}
	}
	return nil
}
