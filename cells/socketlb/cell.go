// Package socketlb attaches the socket load-balancing programs (bpf/socklb)
// to a cgroup, so that processes in it reach services' backends when they
// connect to or send to a service frontend. The programs read the maps the
// load balancer (cells/lb) keeps pinned.
//
// The programs are attached with BPF links pinned under --bpf-pin-dir, so
// traffic keeps flowing while the agent is down or restarting; a new agent
// swaps its programs into the pinned links atomically, and with
// --enable-socket-lb=false removes them.
//
// See docs/datapath.md.
package socketlb

import (
	"log/slog"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/lb"
)

// Cell attaches (or, disabled, detaches) the socket load-balancing
// programs, and removes the session affinity entries that services which
// went (or lost their affinity, or a backend) leave behind. It needs
// lb.Maps, the frontends table and cgroups.Root, so lb.Cell and
// cgroups.Cell (part of infra.Cell) must be part of the hive.
var Cell = cell.Module(
	"socketlb",
	"Socket load balancing in cgroup hooks",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(newAttacher, newAffinityGC),
	cell.Provide(scriptCommands, newTranslations),
	cell.Invoke(registerJobs),
)

// EnableFlag names the flag that switches socket load balancing on. The
// cgroup it acts on is --cgroup-root, which cells/cgroups owns.
const EnableFlag = "enable-socket-lb"

// Config is the socket load balancer's configuration.
type Config struct {
	// EnableSocketLB attaches the programs; false detaches any the agent
	// left attached.
	EnableSocketLB bool
}

var defaultConfig = Config{}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.Bool(EnableFlag, def.EnableSocketLB,
		"Load-balance connections to service frontends, IPv4 and IPv6, in cgroup socket hooks (connect, sendmsg, recvmsg, getpeername) of --"+cgroups.RootFlag+"; false detaches them")
}

// attachRetry is how a failed attach or detach is retried: after 1 s,
// doubling up to a minute, so that a fixed privilege or mount is picked up
// soon and a lasting failure does not fill the log.
func attachRetry() job.RetryBackoff {
	return &job.ExponentialBackoff{Min: time.Second, Max: time.Minute}
}

func registerJobs(jobs job.Group, a *attacher, gc *affinityGC, lc cell.Lifecycle) {
	jobs.Add(job.OneShot("attach", a.run, job.WithRetry(-1, attachRetry())))
	if a.cfg.EnableSocketLB {
		jobs.Add(job.OneShot("affinity-gc", gc.run))
	}
	// The links stay pinned (and attached); only this process's handles
	// go.
	lc.Append(cell.Hook{OnStop: func(cell.HookContext) error { a.close(); return nil }})
}

func newAttacher(log *slog.Logger, cfg Config, root cgroups.Root, pinDir bpffs.PinDir, maps lb.Maps, tr *Translations) *attacher {
	return &attacher{log: log, cfg: cfg, root: root, pinDir: string(pinDir), lbMaps: maps,
		attached: make(chan struct{}), translations: tr}
}
