package bpf

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
)

// tempPinSuffix names the pin a replacement map lives under until it is
// renamed over the real one. Map names ending in it are refused, because
// opening map X removes a leftover X_new, which would destroy a map that is
// really called X_new.
const tempPinSuffix = "_new"

// MigrateFunc moves what should survive from the old map into the new one when
// a pin's attributes changed.
//
// It runs while the old map is still pinned under its name and the new one is
// pinned under a temporary name, so a crash or an error during migration leaves
// the old map in place. It must not close either map. The maps are the
// kernel's (*ebpf.Map) or, through memmap.Pins, maps in memory.
type MigrateFunc func(old, new Map) error

// PinOutcome says what OpenPinnedMap did to obtain the map, so that callers can
// decide whether state must be restored or rebuilt.
type PinOutcome int

const (
	// PinCreated means no pin existed; the map is new and empty (apart from
	// the spec's Contents).
	PinCreated PinOutcome = iota + 1
	// PinReused means the existing pin matched the spec and was kept as it was,
	// entries included.
	PinReused
	// PinReplaced means the existing pin did not match the spec; a new map
	// took its place, holding whatever the MigrateFunc copied.
	PinReplaced
)

// String returns the outcome as a word for logs.
func (o PinOutcome) String() string {
	switch o {
	case PinCreated:
		return "created"
	case PinReused:
		return "reused"
	case PinReplaced:
		return "replaced"
	}
	return fmt.Sprintf("PinOutcome(%d)", int(o))
}

// PinnedMap is a map that is pinned on bpffs, together with how it was
// obtained.
type PinnedMap struct {
	*ebpf.Map

	// Path is where the map is pinned.
	Path string
	// Outcome says whether the map was created, reused or replaced.
	Outcome PinOutcome
	// Mismatch says, when Outcome is PinReplaced, which attributes of the old
	// pin differed from the spec, e.g. "max entries 1024 → 2048". It is empty
	// otherwise.
	Mismatch string
}

// PinOption changes how OpenPinnedMap treats an existing pin.
type PinOption func(*pinOptions)

type pinOptions struct {
	otherLayout bool
}

// ReplaceOtherLayout lets OpenPinnedMap replace a pin of another layout
// (type, key size or value size) although a MigrateFunc is given: for maps
// whose migration deals with such a pin itself, converting its entries or
// deliberately dropping them (conntrack entries, which the datapath
// recreates).
func ReplaceOtherLayout(o *pinOptions) { o.otherLayout = true }

// OpenPinnedMap returns the map pinned as pinDir/spec.Name, creating it from
// spec when no pin exists, so that map contents survive agent restarts.
//
// An existing pin is reused untouched when its type, key size, value size,
// max entries and flags match the spec. Otherwise a new map is created from
// the spec, migrate copies what should survive into it (nil copies nothing),
// and the new map atomically takes the old one's place: at any point, a crash
// leaves either the old or the new map pinned under the name. If migrate fails,
// the old pin is left in place and the error is returned.
//
// A migration is written for the spec's key and value types, so a pin of
// another layout (type, key size or value size) is refused with a
// *LayoutError that says what differs and how to get rid of the pin, and is
// left untouched, unless migrate is nil (nothing is kept, so any pin can be
// replaced) or the ReplaceOtherLayout option is given.
//
// pinDir must lie on bpffs (see EnsureFS); it is created if missing. spec.Name
// is the pin's file name, so it must not contain a dot (bpffs refuses those) or
// a slash, nor end in "_new", which is reserved for the swap. spec.Pinning is
// ignored. A nil log discards log messages.
func OpenPinnedMap(log *slog.Logger, spec *ebpf.MapSpec, pinDir string, migrate MigrateFunc, opts ...PinOption) (*PinnedMap, error) {
	if spec == nil {
		return nil, errors.New("open pinned map: nil spec")
	}
	if err := checkPinName(spec.Name); err != nil {
		return nil, fmt.Errorf("open pinned map: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}

	path := filepath.Join(pinDir, spec.Name)
	if err := preparePinDir(pinDir); err != nil {
		return nil, fmt.Errorf("open pinned map %s: %w", path, err)
	}

	// The library would otherwise load or pin by name itself; this function
	// does both, with its own checks.
	spec = spec.Copy()
	spec.Pinning = ebpf.PinNone

	// A leftover temporary pin is a replacement that never got renamed into
	// place, so its migration may be incomplete: never use it.
	tmpPath := path + tempPinSuffix
	if removed, err := removePin(tmpPath); err != nil {
		return nil, fmt.Errorf("open pinned map %s: remove stale temporary pin: %w", path, err)
	} else if removed {
		log.Info("Removed stale temporary pin left by an interrupted map replacement",
			"path", tmpPath)
	}

	old, err := ebpf.LoadPinnedMap(path, nil)
	if errors.Is(err, fs.ErrNotExist) {
		return createPinned(log, spec, path)
	}
	if err != nil {
		return nil, fmt.Errorf("open pinned map %s: %w", path, err)
	}

	mismatch, err := describeMismatch(spec, old)
	if err != nil {
		old.Close()
		return nil, fmt.Errorf("open pinned map %s: %w", path, err)
	}
	if mismatch == "" {
		log.Debug("Reusing pinned map", "path", path)
		return &PinnedMap{Map: old, Path: path, Outcome: PinReused}, nil
	}

	var o pinOptions
	for _, opt := range opts {
		opt(&o)
	}
	if migrate != nil && !o.otherLayout {
		if err := CheckLayoutOf(old, spec, path); err != nil {
			old.Close()
			return nil, err
		}
	}

	return replacePinned(log, spec, path, old, mismatch, migrate)
}

// RemovePinnedMap removes the pin of the map name in pinDir, along with any
// temporary pin an interrupted replacement left behind. The map itself lives on
// as long as something else holds it. A missing pin is not an error.
func RemovePinnedMap(pinDir, name string) error {
	if err := checkPinName(name); err != nil {
		return fmt.Errorf("remove pinned map: %w", err)
	}
	path := filepath.Join(pinDir, name)
	_, errTmp := removePin(path + tempPinSuffix)
	_, err := removePin(path)
	if err := errors.Join(err, errTmp); err != nil {
		return fmt.Errorf("remove pinned map %s: %w", path, err)
	}
	return nil
}

// createPinned creates a map from spec and pins it at path.
func createPinned(log *slog.Logger, spec *ebpf.MapSpec, path string) (*PinnedMap, error) {
	m, err := ebpf.NewMap(spec)
	if err != nil {
		return nil, fmt.Errorf("create map %s: %w", path, err)
	}
	if err := m.Pin(path); err != nil {
		m.Close()
		return nil, fmt.Errorf("pin map %s: %w", path, err)
	}
	log.Debug("Created pinned map", "path", path)
	return &PinnedMap{Map: m, Path: path, Outcome: PinCreated}, nil
}

// replacePinned swaps the pin at path, which holds old, for a new map made
// from spec. It takes ownership of old.
func replacePinned(log *slog.Logger, spec *ebpf.MapSpec, path string, old *ebpf.Map, mismatch string, migrate MigrateFunc) (*PinnedMap, error) {
	defer old.Close()
	tmpPath := path + tempPinSuffix

	fresh, err := ebpf.NewMap(spec)
	if err != nil {
		return nil, fmt.Errorf("replace pinned map %s (%s): create map: %w", path, mismatch, err)
	}
	defer fresh.Close()

	// Pinning under a temporary name before migrating means the new map
	// already is on bpffs when the swap happens, and rename(2) is the one step
	// that can move it under the real name atomically.
	if err := fresh.Pin(tmpPath); err != nil {
		return nil, fmt.Errorf("replace pinned map %s (%s): pin new map: %w", path, mismatch, err)
	}
	unpinTmp := func() {
		if _, err := removePin(tmpPath); err != nil {
			log.Warn("Cannot remove temporary pin; it will be removed on the next open",
				"path", tmpPath, "error", err)
		}
	}

	if migrate != nil {
		if err := migrate(old, fresh); err != nil {
			unpinTmp()
			return nil, fmt.Errorf("replace pinned map %s (%s): migrate entries: %w", path, mismatch, err)
		}
	}

	if err := os.Rename(tmpPath, path); err != nil {
		unpinTmp()
		return nil, fmt.Errorf("replace pinned map %s (%s): %w", path, mismatch, err)
	}

	if migrate == nil {
		log.Info("Replaced pinned map with an empty one because its attributes changed",
			"path", path, "changed", mismatch)
	} else {
		log.Info("Replaced pinned map and migrated its entries because its attributes changed",
			"path", path, "changed", mismatch)
	}

	// The library keeps pinning state in the Map and can only rename without
	// replacing, so fresh still believes it is pinned under the temporary name
	// and would do the wrong thing on Unpin. Hand out a Map that knows its pin.
	m, err := reloadPinned(path, fresh)
	if err != nil {
		return nil, fmt.Errorf("replace pinned map %s (%s): %w", path, mismatch, err)
	}
	return &PinnedMap{Map: m, Path: path, Outcome: PinReplaced, Mismatch: mismatch}, nil
}

// reloadPinned opens the pin at path and makes sure it is the same map as want.
func reloadPinned(path string, want *ebpf.Map) (*ebpf.Map, error) {
	wantID, err := mapID(want)
	if err != nil {
		return nil, err
	}
	m, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		return nil, fmt.Errorf("reopen after swap: %w", err)
	}
	gotID, err := mapID(m)
	if err != nil {
		m.Close()
		return nil, err
	}
	if gotID != wantID {
		m.Close()
		return nil, fmt.Errorf("reopen after swap: pin holds map ID %d, expected %d: replaced concurrently", gotID, wantID)
	}
	return m, nil
}

func mapID(m *ebpf.Map) (ebpf.MapID, error) {
	info, err := m.Info()
	if err != nil {
		return 0, fmt.Errorf("map info: %w", err)
	}
	id, ok := info.ID()
	if !ok {
		return 0, errors.New("map info: kernel does not report map IDs")
	}
	return id, nil
}

// checkPinName rejects names that cannot be, or must not be, a pin's file name.
func checkPinName(name string) error {
	switch {
	case name == "":
		return errors.New("map spec has no name, which is needed as the pin's file name")
	case strings.Contains(name, "/"):
		return fmt.Errorf("map name %q contains a slash, but it is used as a file name", name)
	case strings.Contains(name, "."):
		// Pinning would fail with a bare EPERM, which does not point at the name.
		return fmt.Errorf("map name %q contains a dot, which bpffs refuses in file names", name)
	case strings.HasSuffix(name, tempPinSuffix):
		return fmt.Errorf("map name %q ends in %q, which is reserved for the temporary pin of a replacement", name, tempPinSuffix)
	}
	return nil
}

// preparePinDir creates dir if needed and checks that it is on bpffs, so that
// a forgotten mount is reported as such and not as a failure to pin.
func preparePinDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create pin directory: %w", err)
	}
	ok, err := IsBPFFS(dir)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("pin directory %s is not on bpffs (see EnsureFS)", dir)
	}
	return nil
}

// removePin removes the pin at path and reports whether there was one.
func removePin(path string) (bool, error) {
	err := os.Remove(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return true, nil
}
