package memmap

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
)

// Pins is a pin directory of maps in memory: a bpf.Opener whose maps keep
// their contents from one open to the next, as pinned maps do across agent
// restarts. The zero value is ready to use.
type Pins struct {
	mu   sync.Mutex
	maps map[string]*Map
	// wrap, if set, wraps every map it opens.
	wrap func(path string, m *Map) bpf.Map
}

var _ bpf.Opener = (*Pins)(nil)

// NewPins returns an empty pin directory whose maps wrap passes out
// wrapped (nil: as they are), e.g. in a Faulty.
func NewPins(wrap func(path string, m *Map) bpf.Map) *Pins {
	return &Pins{wrap: wrap}
}

// OpenMap implements bpf.Opener. A map pinned with other attributes is
// replaced: when only the max entries differ, by a new map into which
// migrate (if not nil) moves what it keeps, as the kernel's pins are;
// when the layout differs, by an empty one (opts are not needed for
// that). A migration that fails leaves the old map pinned.
func (p *Pins) OpenMap(_ *slog.Logger, spec *ebpf.MapSpec, pinDir string, migrate bpf.MigrateFunc, _ ...bpf.PinOption) (*bpf.OpenedMap, error) {
	if spec == nil || spec.Name == "" {
		return nil, fmt.Errorf("open map in memory: no spec or no name")
	}
	path := filepath.Join(pinDir, spec.Name)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.maps == nil {
		p.maps = map[string]*Map{}
	}
	old := p.maps[path]
	m, outcome, mismatch := old, bpf.PinReused, ""
	switch {
	case old == nil:
		m, outcome = New(spec), bpf.PinCreated
	case old.typ != spec.Type || old.keySize != spec.KeySize || old.valueSize != spec.ValueSize:
		m, outcome = New(spec), bpf.PinReplaced
		mismatch = fmt.Sprintf("layout %s %d/%d → %s %d/%d", old.typ, old.keySize, old.valueSize, spec.Type, spec.KeySize, spec.ValueSize)
	case old.maxEntries != spec.MaxEntries:
		m, outcome = New(spec), bpf.PinReplaced
		mismatch = fmt.Sprintf("max entries %d → %d", old.maxEntries, spec.MaxEntries)
		if migrate != nil {
			if err := migrate(old, m); err != nil {
				return nil, fmt.Errorf("migrate map in memory %s (%s): %w", path, mismatch, err)
			}
		}
	}
	p.maps[path] = m
	var bm bpf.Map = m
	if p.wrap != nil {
		bm = p.wrap(path, m)
	}
	return &bpf.OpenedMap{Map: bm, Path: path, Outcome: outcome, Mismatch: mismatch}, nil
}

// Get returns the map pinned at path (pinDir/name), or nil.
func (p *Pins) Get(path string) *Map {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.maps[path]
}

// RemoveMap implements bpf.Opener: the map pinned as pinDir/name is gone.
func (p *Pins) RemoveMap(pinDir, name string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.maps, filepath.Join(pinDir, name))
	return nil
}

// LoadMap implements bpf.Opener.
func (p *Pins) LoadMap(pinDir, name string) (bpf.Map, error) {
	path := filepath.Join(pinDir, name)
	p.mu.Lock()
	defer p.mu.Unlock()
	m := p.maps[path]
	if m == nil {
		return nil, fmt.Errorf("load map in memory %s: %w", path, os.ErrNotExist)
	}
	if p.wrap != nil {
		return p.wrap(path, m), nil
	}
	return m, nil
}
