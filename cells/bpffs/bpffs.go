// Package bpffs provides the directory under which every cell pins its BPF
// maps, on a mounted bpffs.
package bpffs

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/memmap"
	"github.com/apiary-net/apiary/internal/dirlock"
	"github.com/apiary-net/apiary/reconcilers"
)

// Cell provides PinDir. It mounts bpffs at /sys/fs/bpf when the pin directory
// lies below it and nothing is mounted there yet, and locks the directory
// for as long as the hive runs, so that a second agent on the same pin
// directory refuses to start.
var Cell = cell.Module(
	"bpffs",
	"BPF filesystem and pin directory",

	cell.Config(Config{PinDir: DefaultPinDir, BPFMapResyncInterval: time.Minute}),
	cell.Provide(providePinDir, newResync, newMaps),
	// Checked even before any feature pins a map, so a bad --bpf-pin-dir or
	// a missing privilege is reported at start.
	cell.Invoke(func(PinDir) {}),
)

// DefaultPinDir is where maps are pinned unless --bpf-pin-dir says otherwise.
const DefaultPinDir = "/sys/fs/bpf/apiary"

// Config is the bpffs cell's configuration.
type Config struct {
	// PinDir is the directory for the agent's pinned maps and links.
	PinDir string `mapstructure:"bpf-pin-dir"`
	// BPFMapResyncInterval is how often the reconcilers compare their maps
	// with what they wrote and repair them; 0 turns it off.
	BPFMapResyncInterval time.Duration
}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.String("bpf-pin-dir", def.PinDir, "Directory on bpffs where the agent pins its BPF maps (kept across restarts)")
	fs.Duration(ResyncFlag, def.BPFMapResyncInterval,
		"How often the maps the agent owns are compared with what it wrote and repaired (missing entries written, changed ones rewritten, strays deleted); 0 turns it off")
}

// PinDir is an existing directory on bpffs, ready for pins, that this agent
// alone uses.
type PinDir string

// ResyncFlag is the flag that sets Resync.Interval.
const ResyncFlag = "bpf-map-resync-interval"

// Resync is how the reconcilers repair drift of their maps: every
// Interval (0: never), reporting to Drift.
type Resync struct {
	Interval time.Duration
	Drift    *reconcilers.Drift
}

// PruneInterval is the interval of a reconciler's prune, which resyncs:
// the interval, or (resync off) statedb's default of an hour, so that
// strays left by an earlier run still go.
func (r Resync) PruneInterval() time.Duration {
	if r.Interval <= 0 {
		return time.Hour
	}
	return r.Interval
}

// DriftReport is where a reconciler reports drift: nil when resync is
// off.
func (r Resync) DriftReport() *reconcilers.Drift {
	if r.Interval <= 0 {
		return nil
	}
	return r.Drift
}

func newResync(cfg Config, log *slog.Logger, reg prometheus.Registerer) (Resync, error) {
	if cfg.BPFMapResyncInterval < 0 {
		return Resync{}, fmt.Errorf("--%s=%s: want 0 (off) or a positive duration", ResyncFlag, cfg.BPFMapResyncInterval)
	}
	d, err := reconcilers.NewDrift(log, reg)
	if err != nil {
		return Resync{}, err
	}
	return Resync{Interval: cfg.BPFMapResyncInterval, Drift: d}, nil
}

// Maps opens the pinned maps of the cells that take it (the ipcache so
// far): the kernel's, on the pin directory, unless a test's hive provides
// MemoryMaps.
type Maps struct{ bpf.Opener }

// MemoryMaps, provided by a test's hive, puts the maps opened through Maps
// in memory: such a hive needs neither root nor bpffs, and its pin
// directory may be any directory. The agent never provides it.
type MemoryMaps struct{ *memmap.Pins }

type mapsParams struct {
	cell.In

	Memory *MemoryMaps `optional:"true"`
}

func newMaps(p mapsParams) Maps {
	if p.Memory != nil {
		return Maps{p.Memory.Pins}
	}
	return Maps{bpf.KernelMaps}
}

type pinDirParams struct {
	cell.In

	Config    Config
	Log       *slog.Logger
	Lifecycle cell.Lifecycle
	Memory    *MemoryMaps `optional:"true"`
}

func providePinDir(p pinDirParams) (PinDir, error) {
	if p.Memory != nil {
		return openPinDir(p.Config, p.Log, p.Lifecycle, prepareAnyDir)
	}
	return newPinDir(p.Config, p.Log, p.Lifecycle)
}

func newPinDir(cfg Config, log *slog.Logger, lc cell.Lifecycle) (PinDir, error) {
	return openPinDir(cfg, log, lc, Prepare)
}

func openPinDir(cfg Config, log *slog.Logger, lc cell.Lifecycle, prepare func(string) (string, error)) (PinDir, error) {
	dir, err := prepare(cfg.PinDir)
	if err != nil {
		return "", err
	}
	// Tried while the hive is built, so that a second agent fails populate
	// with one line, then taken for good in a start hook that precedes
	// those of every cell that pins maps, and held until the hive stops (or
	// the process dies). A hive that is never started holds nothing.
	check, err := Lock(dir)
	if err != nil {
		return "", err
	}
	check.Release()
	var lock *dirlock.Lock
	lc.Append(cell.Hook{
		OnStart: func(cell.HookContext) (err error) {
			lock, err = Lock(dir)
			return err
		},
		OnStop: func(cell.HookContext) error { return lock.Release() },
	})
	log.Debug("BPF pin directory ready", "dir", dir)
	return PinDir(dir), nil
}

// Lock takes an exclusive flock on the pin directory dir itself, or says
// which agent holds it. bpffs holds nothing but pins and directories, so
// there is no lock file: flock works on any inode, directories on bpffs
// included, and the holder's PID is read from /proc/locks. Readers such as
// `apiary bpf lb list` do not lock.
func Lock(dir string) (*dirlock.Lock, error) {
	lock, err := dirlock.Dir(dir)
	var held *dirlock.HeldError
	if errors.As(err, &held) {
		return nil, fmt.Errorf("%w: stop it or give this agent another --bpf-pin-dir", held)
	}
	if err != nil {
		return nil, fmt.Errorf("--bpf-pin-dir %s: %w", dir, err)
	}
	return lock, nil
}

// prepareAnyDir makes dir absolute and creates it, wherever it is: for
// maps in memory, which pin nothing there.
func prepareAnyDir(dir string) (string, error) {
	if dir == "" {
		return "", fmt.Errorf("--bpf-pin-dir is empty")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", fmt.Errorf("--bpf-pin-dir %s: %w", dir, err)
	}
	if err := os.MkdirAll(abs, 0o750); err != nil {
		return "", fmt.Errorf("--bpf-pin-dir %s: %w", abs, err)
	}
	return abs, nil
}

// Prepare makes dir absolute, mounts bpffs at /sys/fs/bpf if dir lies below
// it and it is not mounted, creates dir and checks that it is on bpffs.
func Prepare(dir string) (string, error) {
	if dir == "" {
		return "", fmt.Errorf("--bpf-pin-dir is empty")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", fmt.Errorf("--bpf-pin-dir %s: %w", dir, err)
	}
	if abs == bpf.DefaultFSRoot || strings.HasPrefix(abs, bpf.DefaultFSRoot+"/") {
		if err := bpf.EnsureFS(bpf.DefaultFSRoot); err != nil {
			return "", fmt.Errorf("--bpf-pin-dir %s: %w (the agent must run as root)", abs, err)
		}
	}
	if err := os.MkdirAll(abs, 0o750); err != nil {
		return "", fmt.Errorf("--bpf-pin-dir %s: %w", abs, err)
	}
	ok, err := bpf.IsBPFFS(abs)
	if err != nil {
		return "", fmt.Errorf("--bpf-pin-dir %s: %w", abs, err)
	}
	if !ok {
		return "", fmt.Errorf("--bpf-pin-dir %s is not on a bpffs mount", abs)
	}
	return abs, nil
}
