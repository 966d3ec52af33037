// Package nodeport attaches the north-south load-balancing programs
// (bpf/nodeport) to the node's external devices, so that clients outside
// the node reach Services at <node address>:<nodePort>, at their
// LoadBalancer ingress IPs and at their external IPs. The programs read
// the frontends and backends the load balancer (cells/lb) keeps pinned,
// the same the socket hooks read, and keep their own NAT map.
//
// The programs' links are pinned under --bpf-pin-dir (tcx; tc filters
// where the kernel has no tcx), and so are the NAT map and the devices
// map: translated flows keep flowing while the agent is down or
// restarting. With --enable-nodeport=false the agent detaches them.
//
// See docs/datapath.md.
package nodeport

import (
	"fmt"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/bpf/iflink"
	"github.com/apiary-net/apiary/internal/maglev"
	"github.com/apiary-net/apiary/tables"
)

// Cell attaches (or, disabled, detaches) the nodeport programs and
// expires idle NAT entries. It needs lb.Maps, so lb.Cell must be part of
// the hive. It provides the nodeport-devices table.
var Cell = cell.Module(
	"nodeport",
	"North-south load balancing at the external devices",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(tables.NewNodePortDevicesTable, newAttacher, newSourceRanges, tables.NewMaglevTable, newMaglevOps),
	cell.Provide(func(t statedb.RWTable[*tables.NodePortDevice]) statedb.Table[*tables.NodePortDevice] { return t }),
	cell.Provide(func(t statedb.RWTable[*tables.Maglev]) statedb.Table[*tables.Maglev] { return t }),
	cell.Invoke(registerJobs, registerMetrics, registerMaglev),
)

// Flag names.
const (
	EnableFlag     = "enable-nodeport"
	DevicesFlag    = "devices"
	NATMaxFlag     = "bpf-nat-max"
	TCPTimeoutFlag = "nat-tcp-timeout"
	UDPTimeoutFlag = "nat-udp-timeout"
	AttachFlag     = "nodeport-attach"
	AlgorithmFlag  = "lb-algorithm"
	MaglevSizeFlag = "lb-maglev-table-size"
)

// Config is the north-south load balancer's configuration.
type Config struct {
	// EnableNodePort attaches the programs; false detaches any the agent
	// left attached.
	EnableNodePort bool
	// Devices are the external devices; empty: those of the default
	// routes.
	Devices []string
	// BPFNATMax sizes the NAT map (two entries per flow).
	BPFNATMax uint32
	// NATTCPTimeout and NATUDPTimeout: how long a flow may be idle before
	// its entries are removed.
	NATTCPTimeout time.Duration
	NATUDPTimeout time.Duration
	// NodePortAttach is how the programs go on the devices: auto, tcx
	// or tc (iflink.Mode).
	NodePortAttach string
	// LBAlgorithm is how a new flow from outside picks its backend:
	// random, or maglev (the same backend on every node for the same
	// flow).
	LBAlgorithm string
	// LBMaglevTableSize is the size of each frontend's Maglev table, a
	// prime.
	LBMaglevTableSize uint32
}

// maglev says whether Maglev tables are computed and used.
func (c Config) maglev() bool { return c.EnableNodePort && c.LBAlgorithm == AlgorithmMaglev }

// maglevSize is the programs' table size: 0 for random selection.
func (c Config) maglevSize() uint32 {
	if c.maglev() {
		return c.LBMaglevTableSize
	}
	return 0
}

var defaultConfig = Config{
	BPFNATMax:         131072,
	NATTCPTimeout:     6 * time.Hour,
	NATUDPTimeout:     time.Minute,
	NodePortAttach:    string(iflink.ModeAuto),
	LBAlgorithm:       AlgorithmRandom,
	LBMaglevTableSize: maglev.DefaultTableSize,
}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.Bool(EnableFlag, def.EnableNodePort,
		"Translate traffic from outside the node to NodePort, LoadBalancer and external-IP frontends (IPv4 and IPv6) in tc programs on --"+DevicesFlag+"; false detaches them")
	fs.StringSlice(DevicesFlag, def.Devices,
		"External devices for --"+EnableFlag+" (comma-separated); empty: the devices of the default routes")
	fs.Uint32(NATMaxFlag, def.BPFNATMax,
		"Size of each nodeport NAT map (nodeport_nat4, nodeport_nat6): two entries per translated flow; a full map drops new flows, counted")
	fs.Duration(TCPTimeoutFlag, def.NATTCPTimeout, "Idle time after which a translated TCP flow's NAT entries are removed")
	fs.Duration(UDPTimeoutFlag, def.NATUDPTimeout, "Idle time after which a translated UDP flow's NAT entries are removed")
	fs.String(AttachFlag, def.NodePortAttach, "How the nodeport programs go on the devices: auto (tcx links, tc filters where the kernel has no tcx), tcx or tc")
	fs.String(AlgorithmFlag, def.LBAlgorithm,
		"How a new flow from outside the node picks its backend: random, or maglev (a per-frontend Maglev table, so that every node sends the same flow to the same backend)")
	fs.Uint32(MaglevSizeFlag, def.LBMaglevTableSize,
		"Slots of each frontend's Maglev table (--"+AlgorithmFlag+"=maglev): a prime, at least 100 times the most backends a service has for even spread; 4 bytes a slot per frontend")
}

func (c Config) validate() error {
	switch {
	case c.BPFNATMax < 16 || c.BPFNATMax > 1<<24:
		return fmt.Errorf("--%s=%d is out of range 16-%d", NATMaxFlag, c.BPFNATMax, 1<<24)
	case c.NATTCPTimeout < time.Second:
		return fmt.Errorf("--%s=%s is below 1s", TCPTimeoutFlag, c.NATTCPTimeout)
	case c.NATUDPTimeout < time.Second:
		return fmt.Errorf("--%s=%s is below 1s", UDPTimeoutFlag, c.NATUDPTimeout)
	}
	switch c.LBAlgorithm {
	case AlgorithmRandom, AlgorithmMaglev:
	default:
		return fmt.Errorf("--%s=%q: want %s or %s", AlgorithmFlag, c.LBAlgorithm, AlgorithmRandom, AlgorithmMaglev)
	}
	if err := maglev.ValidateTableSize(c.LBMaglevTableSize); err != nil {
		return fmt.Errorf("--%s: %w", MaglevSizeFlag, err)
	}
	if _, err := iflink.ParseMode(c.NodePortAttach); err != nil {
		return fmt.Errorf("--%s: %w", AttachFlag, err)
	}
	return nil
}

func attachRetry() job.RetryBackoff {
	return &job.ExponentialBackoff{Min: time.Second, Max: time.Minute}
}

func registerJobs(jobs job.Group, a *attacher, sr *sourceRanges, lc cell.Lifecycle) {
	jobs.Add(job.OneShot("attach", a.run, job.WithRetry(-1, attachRetry())))
	if a.cfg.EnableNodePort {
		jobs.Add(job.Timer("nat-gc", a.gc, gcInterval(a.cfg)))
		jobs.Add(job.OneShot("source-ranges", sr.run, job.WithRetry(-1, attachRetry())))
	}
	lc.Append(cell.Hook{OnStop: func(cell.HookContext) error { a.close(); return nil }})
}

// gcInterval: often enough that an entry outlives its timeout by at most
// a tenth of the shorter one, at most once a second.
func gcInterval(c Config) time.Duration {
	return max(min(c.NATTCPTimeout, c.NATUDPTimeout)/10, time.Second)
}
