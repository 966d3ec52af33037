package ct_test

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/ct"
	"github.com/apiary-net/apiary/cells/node"
)

func TestScript(t *testing.T) {
	apiarytest.RunCells(t, "testdata/*.txtar", ct.Cell, scriptTestCell)
}

// TestScriptInMemory runs the same scripts on maps in memory, without root.
func TestScriptInMemory(t *testing.T) {
	apiarytest.RunCellsInMemory(t, "testdata/*.txtar", ct.Cell, scriptTestCell)
}

// scriptTestCell adds what the scripts need and the agent must not have:
//
//	ct/write      writes entries into a map, as the datapath would
//	ct/set-flags  changes the ct cell's flags for the hives that `restart`
//	              builds, as an operator editing the agent's flags would
var scriptTestCell = cell.Group(
	cell.Provide(func(maps ct.Maps, nc node.Config) hive.ScriptCmdsOut {
		return hive.NewScriptCmds(map[string]script.Cmd{
			"ct/write":     writeCmd(maps),
			"ct/set-flags": setFlagsCmd(nc.StateDir),
		})
	}),
	cell.DecorateAll(overrideFlags),
	cell.DecorateAll(overrideNodeFlags),
)

// ipv6Flag is the node's flag that adds the IPv6 conntrack maps; ct/set-flags
// accepts it too, as it changes what the ct cell does.
const ipv6Flag = "enable-ipv6"

// flagsFile, in the script's state directory, holds the flags ct/set-flags
// set; it outlives restarts as the state directory does.
const flagsFile = "ct-test-flags"

func setFlagsCmd(stateDir string) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Set the ct cell's flags for the next restart",
			Args:    "--flag=value...",
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			// Parse now, so that a typo fails here and not in the restart.
			if _, _, err := parseFlags(ct.Config{}, false, args); err != nil {
				return nil, err
			}
			return nil, os.WriteFile(filepath.Join(stateDir, flagsFile), []byte(strings.Join(args, "\n")), 0o600)
		})
}

// savedFlags returns the flags ct/set-flags saved, or nil.
func savedFlags(stateDir string) ([]string, error) {
	data, err := os.ReadFile(filepath.Join(stateDir, flagsFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return strings.Split(string(data), "\n"), nil
}

// overrideFlags applies the flags ct/set-flags saved to the configuration
// the hive parsed.
func overrideFlags(cfg ct.Config, nc node.Config) (ct.Config, error) {
	args, err := savedFlags(nc.StateDir)
	if err != nil || args == nil {
		return cfg, err
	}
	cfg, _, err = parseFlags(cfg, nc.EnableIPv6, args)
	return cfg, err
}

// overrideNodeFlags applies a saved --enable-ipv6 to the node's
// configuration.
func overrideNodeFlags(nc node.Config) (node.Config, error) {
	args, err := savedFlags(nc.StateDir)
	if err != nil || args == nil {
		return nc, err
	}
	_, nc.EnableIPv6, err = parseFlags(ct.Config{}, nc.EnableIPv6, args)
	return nc, err
}

// parseFlags parses args as the ct cell's flags on top of cfg, and the
// node's --enable-ipv6 on top of ipv6.
func parseFlags(cfg ct.Config, ipv6 bool, args []string) (ct.Config, bool, error) {
	fs := pflag.NewFlagSet("ct", pflag.ContinueOnError)
	cfg.Flags(fs)
	fs.Bool(ipv6Flag, ipv6, "")
	if err := fs.Parse(args); err != nil {
		return cfg, ipv6, err
	}
	tcp, err1 := fs.GetInt(ct.TCPMaxFlag)
	other, err2 := fs.GetInt(ct.AnyMaxFlag)
	ratio, err3 := fs.GetFloat64(ct.SizeRatioFlag)
	interval, err4 := fs.GetDuration(ct.GCIntervalFlag)
	ipv6, err5 := fs.GetBool(ipv6Flag)
	return ct.Config{
		BPFCTGlobalTCPMax:      tcp,
		BPFCTGlobalAnyMax:      other,
		BPFMapDynamicSizeRatio: ratio,
		ConntrackGCInterval:    interval,
	}, ipv6, errors.Join(err1, err2, err3, err4, err5)
}

func writeCmd(maps ct.Maps) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Write conntrack entries as the datapath would",
			Args:    "map proto saddr:sport daddr:dport",
			Flags: func(fs *pflag.FlagSet) {
				fs.Int("count", 1, "number of entries; each one has the next source port")
				fs.Int("lifetime", 3600, "seconds from now until the entry expires; negative for an expired entry")
				fs.Bool("in", false, "an ingress tuple (IN) instead of an egress one (OUT)")
			},
			Detail: []string{"proto is TCP, UDP or ICMP; the map decides the address family."},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 4 {
				return nil, script.ErrUsage
			}
			count, _ := s.Flags.GetInt("count")
			lifetime, _ := s.Flags.GetInt("lifetime")
			in, _ := s.Flags.GetBool("in")
			proto, ok := map[string]uint8{"TCP": 6, "UDP": 17, "ICMP": 1}[args[1]]
			if !ok {
				return nil, fmt.Errorf("unknown protocol %q", args[1])
			}
			src, err := netip.ParseAddrPort(args[2])
			if err != nil {
				return nil, err
			}
			dst, err := netip.ParseAddrPort(args[3])
			if err != nil {
				return nil, err
			}
			flags := bpf.CTEgress
			if in {
				flags = bpf.CTIngress
			}
			now, err := bpf.CTClockNow()
			if err != nil {
				return nil, err
			}
			value := bpf.CTEntry{Lifetime: uint32(int(now) + lifetime), TxPackets: 1, TxBytes: 64}
			return nil, maps.Use(args[0], func(m bpf.Map) error {
				for i := range count {
					sport := src.Port() + uint16(i)
					var key any
					if m.KeySize() == bpf.CTKey6Size {
						key = bpf.CTKey6{SAddr: src.Addr().As16(), SPort: bpf.NewBe16(sport),
							DAddr: dst.Addr().As16(), DPort: bpf.NewBe16(dst.Port()), NextHdr: proto, Flags: flags}
					} else {
						if !src.Addr().Is4() || !dst.Addr().Is4() {
							return fmt.Errorf("%s holds IPv4 tuples", args[0])
						}
						key = bpf.CTKey4{SAddr: src.Addr().As4(), SPort: bpf.NewBe16(sport),
							DAddr: dst.Addr().As4(), DPort: bpf.NewBe16(dst.Port()), NextHdr: proto, Flags: flags}
					}
					if err := m.Put(key, value); err != nil {
						return err
					}
				}
				return nil
			})
		})
}
