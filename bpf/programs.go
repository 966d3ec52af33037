package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
)

// LoadPrograms loads the programs of spec with maps in place of the
// object's map definitions of the same names, so that the programs read
// the maps the agent keeps pinned. The object's map sizes are only
// defaults: each definition takes the size and flags of the map that
// replaces it, which must otherwise agree (type, key and value sizes) or
// loading fails. what names the programs in errors ("socket LB programs").
//
// The caller owns the returned programs, keyed by program name; the maps
// stay the caller's.
func LoadPrograms(spec *ebpf.CollectionSpec, maps map[string]*ebpf.Map, what string) (map[string]*ebpf.Program, error) {
	for name, m := range maps {
		if m == nil {
			return nil, fmt.Errorf("load %s: no map for %s", what, name)
		}
		ms := spec.Maps[name]
		if ms == nil {
			return nil, fmt.Errorf("load %s: object has no map %s", what, name)
		}
		ms.MaxEntries = m.MaxEntries()
		ms.Flags = m.Flags()
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: maps})
	if err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return nil, fmt.Errorf("load %s: %+v", what, verr)
		}
		return nil, fmt.Errorf("load %s: %w", what, err)
	}
	progs := coll.Programs
	coll.Programs = nil
	coll.Close()
	return progs, nil
}
