package memmap

import (
	"fmt"
	"log/slog"
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
// replaced: by a new map holding the old one's entries (as many as fit)
// when only the max entries differ, else by an empty one. migrate, written
// for kernel maps, is not called.
func (p *Pins) OpenMap(_ *slog.Logger, spec *ebpf.MapSpec, pinDir string, _ bpf.MigrateFunc) (*bpf.OpenedMap, error) {
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
		old.mu.Lock()
		for k, v := range old.entries {
			if uint32(len(m.entries)) < m.maxEntries {
				m.entries[k] = v
			}
		}
		old.mu.Unlock()
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
