// Package core holds the plumbing every apiary hive shares, whatever its role
// (agent, operator, test harness): the hive options and the node's own
// configuration (name and state directory).
package core

import (
	"log/slog"
	"runtime/pprof"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"

	"github.com/apiary-net/apiary/cells/health"
)

// EnvPrefix is the prefix of the environment variables that set flags:
// APIARY_API_ADDR sets --api-addr.
const EnvPrefix = "APIARY_"

// HiveOptions returns the options every apiary hive is built with: flags
// readable from APIARY_* variables, a health scope and a job group per module,
// and hive's own logging of slow invokes and hooks only.
func HiveOptions() hive.Options {
	opts := hive.DefaultOptions()
	opts.EnvPrefix = EnvPrefix
	opts.LogThreshold = 100 * time.Millisecond
	opts.ModuleDecorators = cell.ModuleDecorators{health.ModuleDecorator}
	opts.ModulePrivateProviders = cell.ModulePrivateProviders{newJobGroup}
	return opts
}

// newJobGroup gives each module its own job group, so that its jobs log with
// the module's logger, report into the module's health scope and carry the
// module id as a pprof label.
func newJobGroup(r job.Registry, h cell.Health, log *slog.Logger, id cell.ModuleID) job.Group {
	return r.NewGroup(h,
		job.WithLogger(log),
		job.WithPprofLabels(pprof.Labels("module", string(id))))
}
