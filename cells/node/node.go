// Package node provides the configuration of the node the agent runs on: its
// name, its state directory, its own addresses and whether it runs IPv6.
package node

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/internal/dirlock"
)

// Cell provides the node's own configuration (Config) and checks it
// before anything starts: the state directory must be writable, and no other
// agent may be using it (see LockFile).
var Cell = cell.Module(
	"node",
	"The node the agent runs on",

	cell.Config(defaultFlags()),
	cell.Provide(newConfig),
	// Checked even when no feature uses the state directory yet, so that a
	// bad flag (or a directory another agent holds) is an error at start
	// rather than at the first checkpoint.
	cell.Invoke(func(Config) {}),
)

// Flags are the node's command-line flags.
type Flags struct {
	// NodeName is the name of this node, as Kubernetes knows it.
	NodeName string
	// StateDir holds what must survive a restart (checkpoints, IPAM records).
	StateDir string
	// NodeIPs are the node's own addresses; empty: the global unicast
	// addresses of its interfaces.
	NodeIPs []string
	// EnableIPv6 turns on IPv6 (dual stack) in every feature that cares:
	// IPv6 conntrack maps, world-ipv4/world-ipv6 labels.
	EnableIPv6 bool
}

// DefaultStateDir is where state lives unless --state-dir says otherwise.
const DefaultStateDir = "/var/run/apiary"

// LockFile is the file in the state directory that an agent holds an
// exclusive flock on for as long as it runs, with its PID in it: a second
// agent on the same directory refuses to start rather than overwrite the
// first one's checkpoints. The kernel drops the lock when the agent dies,
// however it dies; the file stays.
const LockFile = "apiary.lock"

func defaultFlags() Flags {
	name, _ := os.Hostname()
	return Flags{NodeName: name, StateDir: DefaultStateDir}
}

// Flags implements cell.Flagger.
func (def Flags) Flags(fs *pflag.FlagSet) {
	fs.String("node-name", def.NodeName, "Name of this node as Kubernetes knows it (selects the node's pods)")
	fs.String("state-dir", def.StateDir, "Directory for state that survives a restart (identity and DNS checkpoints, IPAM records)")
	fs.StringSlice("node-ips", def.NodeIPs,
		"The node's own addresses, labelled reserved:host (comma-separated), and only those; empty: the global unicast addresses of its interfaces, followed as they come and go")
	fs.Bool("enable-ipv6", def.EnableIPv6,
		"Dual stack: IPv6 conntrack maps (ct6_global, ct_any6_global) and world-ipv4/world-ipv6 instead of reserved:world")
}

// Config is the validated node configuration.
type Config struct {
	NodeName string
	// StateDir is an absolute path to an existing, writable directory.
	StateDir string
	// NodeIPs are the node's own addresses, sorted; with IPv6 off, only
	// the IPv4 ones.
	NodeIPs []netip.Addr
	// EnableIPv6 is true on a dual-stack node.
	EnableIPv6 bool
	// FollowAddresses is true when --node-ips is empty: the node's
	// addresses are its interfaces' global unicast ones, followed as
	// they come and go (NodeIPs are those found at start).
	FollowAddresses bool
}

func newConfig(f Flags, lc cell.Lifecycle) (Config, error) {
	if f.NodeName == "" {
		return Config{}, errors.New("--node-name is empty and the hostname is unknown: set --node-name")
	}
	ips, err := nodeIPs(f.NodeIPs, f.EnableIPv6)
	if err != nil {
		return Config{}, err
	}
	dir, err := PrepareStateDir(f.StateDir)
	if err != nil {
		return Config{}, err
	}
	if err := holdStateDir(dir, lc); err != nil {
		return Config{}, err
	}
	return Config{NodeName: f.NodeName, StateDir: dir, NodeIPs: ips, EnableIPv6: f.EnableIPv6, FollowAddresses: len(f.NodeIPs) == 0}, nil
}

// holdStateDir makes sure that no other agent uses dir. The lock is tried
// while the hive is built, before any other cell reads state, so that a
// second agent fails populate with one line; it is let go at once and taken
// for good in a start hook, the first of those of every cell that uses the
// state directory, and kept until the hive stops (or the process dies). A
// hive whose populate fails, or that is never started (`apiary agent
// hive`), holds nothing. Should another agent slip in between, this one
// fails to start instead.
func holdStateDir(dir string, lc cell.Lifecycle) error {
	check, err := LockStateDir(dir)
	if err != nil {
		return err
	}
	check.Release()
	var lock *dirlock.Lock
	lc.Append(cell.Hook{
		OnStart: func(cell.HookContext) (err error) {
			lock, err = LockStateDir(dir)
			return err
		},
		OnStop: func(cell.HookContext) error { return lock.Release() },
	})
	return nil
}

// LockStateDir takes the exclusive lock on dir's LockFile, or says which
// agent holds it.
func LockStateDir(dir string) (*dirlock.Lock, error) {
	lock, err := dirlock.File(filepath.Join(dir, LockFile))
	var held *dirlock.HeldError
	if errors.As(err, &held) {
		return nil, fmt.Errorf("%w: stop it or give this agent another --state-dir", held)
	}
	if err != nil {
		return nil, fmt.Errorf("--state-dir %s: %w", dir, err)
	}
	return lock, nil
}

// nodeIPs parses --node-ips, or finds the addresses of the node's
// interfaces when it is empty. The IPv6 ones are dropped unless ipv6 is set.
func nodeIPs(flag []string, ipv6 bool) ([]netip.Addr, error) {
	var ips []netip.Addr
	for _, s := range flag {
		ip, err := netip.ParseAddr(strings.TrimSpace(s))
		if err != nil {
			return nil, fmt.Errorf("--node-ips: %w", err)
		}
		ips = append(ips, ip.Unmap())
	}
	if len(flag) == 0 {
		addrs, err := net.InterfaceAddrs()
		if err != nil {
			return nil, fmt.Errorf("find the node's addresses (set --node-ips): %w", err)
		}
		for _, a := range addrs {
			if p, err := netip.ParsePrefix(a.String()); err == nil && IsHostAddress(p.Addr()) {
				ips = append(ips, p.Addr().Unmap())
			}
		}
	}
	ips = slices.DeleteFunc(ips, func(ip netip.Addr) bool { return ip.Is6() && !ipv6 })
	slices.SortFunc(ips, netip.Addr.Compare)
	return slices.Compact(ips), nil
}

// IsHostAddress reports whether an address of the node's interfaces is
// one of the node's own addresses (reserved:host) when --node-ips is
// empty: a global unicast one (loopback and link-local addresses are not
// addresses a peer reaches the node by).
func IsHostAddress(ip netip.Addr) bool {
	return ip.Unmap().IsGlobalUnicast()
}

// PrepareStateDir makes dir absolute, creates it and checks that files can be
// written in it.
func PrepareStateDir(dir string) (string, error) {
	if dir == "" {
		return "", errors.New("--state-dir is empty")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", fmt.Errorf("--state-dir %s: %w", dir, err)
	}
	if err := os.MkdirAll(abs, 0o750); err != nil {
		return "", fmt.Errorf("--state-dir %s: %w", abs, err)
	}
	probe, err := os.CreateTemp(abs, ".write-probe-*")
	if err != nil {
		return "", fmt.Errorf("--state-dir %s is not writable: %w", abs, err)
	}
	probe.Close()
	os.Remove(probe.Name())
	return abs, nil
}
