// Package identity owns the identities table: security identities, one per
// distinct label set, and the allocator that hands them out.
//
// Reserved identities (1–10) are fixed; workload label sets get cluster
// identities (256–65535) through ClusterNumbers, which is where the identity
// management mode plugs in; CIDR and FQDN label sets get node-local ones
// (0x01000001–0x0100FFFF). Allocated numbers are checkpointed to
// --state-dir and restored on start, so that a label set keeps its number
// across a restart; restored numbers nobody claims are released after
// --identity-restore-grace-period. See docs/identities.md.
package identity

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/internal/tablefile"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the *Allocator and the read-only identities table.
var Cell = cell.Module(
	"identity",
	"Security identities and their allocator",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(
		tables.NewIdentitiesTable,
		// The identity management mode's seam: agent mode unless a
		// *ModeNumbers is provided (cells/identitymode).
		newClusterNumbers,
	),
	cell.Provide(
		newAllocator,
		statedb.RWTable[*tables.Identity].ToTable,
	),
	cell.Invoke(registerJobs),
)

// Config is the identity cell's configuration.
type Config struct {
	// IdentityRestoreGracePeriod is how long restored numbers are kept for
	// their label sets after every source of prefixes has synced.
	IdentityRestoreGracePeriod time.Duration
}

var defaultConfig = Config{IdentityRestoreGracePeriod: 30 * time.Second}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.Duration("identity-restore-grace-period", def.IdentityRestoreGracePeriod,
		"How long identity numbers restored from the checkpoint or the old ipcache map stay reserved for their label sets after the sources have synced")
}

// checkpointInterval throttles checkpoint writes: at most one per interval,
// plus one when the agent stops.
const checkpointInterval = time.Second

type allocatorParams struct {
	cell.In

	Log     *slog.Logger
	DB      *statedb.DB
	Table   statedb.RWTable[*tables.Identity]
	Cluster ClusterNumbers
	Node    node.Config
	Config  Config
}

func newAllocator(p allocatorParams) (*Allocator, error) {
	if p.Config.IdentityRestoreGracePeriod < 0 {
		return nil, fmt.Errorf("--identity-restore-grace-period=%s is negative", p.Config.IdentityRestoreGracePeriod)
	}
	a, err := NewAllocator(p.Log, p.DB, p.Table, p.Cluster)
	if err != nil {
		return nil, err
	}
	a.grace = p.Config.IdentityRestoreGracePeriod
	a.graceStart = make(chan struct{})
	a.checkpointPath = filepath.Join(p.Node.StateDir, CheckpointFile)

	// Restored before anything can allocate: the allocator is built
	// during populate, before any job runs.
	restored, err := ReadCheckpoint(a.checkpointPath)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		p.Log.Info("No identity checkpoint, starting afresh", "path", a.checkpointPath)
	case err != nil:
		p.Log.Warn("Identity checkpoint unusable, starting afresh; numbers are kept only where the ipcache map still has them",
			"error", err)
	default:
		if err := a.Restore(restored); err != nil {
			return nil, err
		}
		p.Log.Info("Restored identities from the checkpoint", "count", len(restored), "path", a.checkpointPath)
	}
	return a, nil
}

// StartGracePeriod starts the restore grace period; the ipcache cell calls
// it once every source of prefixes has synced and the prefixes have been
// resolved. Later calls do nothing.
func (a *Allocator) StartGracePeriod() {
	a.graceOnce.Do(func() {
		if a.graceStart != nil {
			close(a.graceStart)
		}
	})
}

func registerJobs(jobs job.Group, a *Allocator, log *slog.Logger) {
	jobs.Add(
		job.OneShot("checkpoint", func(ctx context.Context, h cell.Health) error {
			return a.checkpointLoop(ctx, h, log)
		}),
		job.OneShot("restore-grace", func(ctx context.Context, h cell.Health) error {
			select {
			case <-a.graceStart:
			case <-ctx.Done():
				return nil
			}
			h.OK(fmt.Sprintf("Keeping restored identities for %s", a.grace))
			select {
			case <-time.After(a.grace):
			case <-ctx.Done():
				return nil
			}
			n, err := a.ReleaseRestored()
			if err != nil {
				return fmt.Errorf("release restored identities: %w", err)
			}
			log.Info("Restore grace period over", "released", n)
			return nil
		}),
	)
}

// checkpointLoop writes the checkpoint whenever the set of allocated
// identities changed, at most once per checkpointInterval, and once more
// when the agent stops.
func (a *Allocator) checkpointLoop(ctx context.Context, h cell.Health, log *slog.Logger) error {
	return tablefile.Writer{
		What:     "identity",
		Path:     a.checkpointPath,
		Interval: checkpointInterval,
		Watch: func() <-chan struct{} {
			_, watch := a.table.AllWatch(a.db.ReadTxn())
			return watch
		},
		// Only numbers and labels are written: refcount changes rewrite
		// nothing.
		Encode: func() ([]byte, error) {
			var ids []*tables.Identity
			for obj := range a.table.All(a.db.ReadTxn()) {
				ids = append(ids, obj)
			}
			return encodeCheckpoint(ids)
		},
	}.Run(ctx, h, log)
}
