// Package cnichain chains the apiary-cni plugin into the node's CNI
// configuration (--cni-chaining-mode=chain), so that a pod made while the
// agent is down gets the agent's interface programs on its veth as the
// runtime makes it (docs/policy.md, "The CNI plugin"); or takes it out
// (unchain). It copies the plugin's binary into --cni-bin-dir and chains
// only once the agent's interface programs are pinned, since apiary-cni
// fails a pod's ADD without them. The configuration is checked again every
// few seconds, so that a primary plugin that writes its configuration
// later, or again, is chained too. What was done, per file, is the
// cni-chain table; a failure is the module's health (/healthz).
package cnichain

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/podiface"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/ipam"
	"github.com/apiary-net/apiary/cells/policy"
	"github.com/apiary-net/apiary/internal/cnichain"
	"github.com/apiary-net/apiary/tables"
)

// Cell chains (or unchains) apiary-cni per --cni-chaining-mode and
// provides the read-only cni-chain table.
var Cell = cell.Module(
	"cni-chain",
	"Chains apiary-cni into the node CNI configuration",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(tables.NewCNIChainTable),
	cell.Provide(statedb.RWTable[*tables.CNIChain].ToTable),
	cell.Invoke(register),
)

// Flag names.
const (
	ModeFlag     = "cni-chaining-mode"
	ConfDirFlag  = "cni-conf-dir"
	ConfNameFlag = "cni-conf-name"
	PluginFlag   = "cni-plugin-source"
	// DefaultConfDir is the usual CNI configuration directory.
	DefaultConfDir = "/etc/cni/net.d"
)

// Values of --cni-chaining-mode.
const (
	// ModeNone leaves the CNI configuration alone.
	ModeNone = "none"
	// ModeChain chains apiary-cni at the end of the primary configuration.
	ModeChain = "chain"
	// ModeUnchain takes it out (the binary stays: pods made with it may
	// still be deleted through it).
	ModeUnchain = "unchain"
)

// Config is the cell's configuration.
type Config struct {
	// CNIChainingMode is ModeNone, ModeChain or ModeUnchain.
	CNIChainingMode string
	// CNIConfDir is the runtime's CNI configuration directory.
	CNIConfDir string
	// CNIConfName is the configuration to chain into; "" is the primary
	// one (the lowest name, the one the runtime uses).
	CNIConfName string
	// CNIPluginSource is the apiary-cni binary to copy; "" is the one
	// beside the agent's own executable (as the image ships it).
	CNIPluginSource string
}

var defaultConfig = Config{CNIChainingMode: ModeNone, CNIConfDir: DefaultConfDir}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.String(ModeFlag, def.CNIChainingMode, "What the agent does to the node's CNI configuration: none; chain (add apiary-cni at the end of the primary configuration's plugins once the interface programs are pinned, and copy the plugin into --"+ipam.CNIBinDirFlag+"); unchain (take it out, putting the original back)")
	fs.String(ConfDirFlag, def.CNIConfDir, "The container runtime's CNI configuration directory")
	fs.String(ConfNameFlag, def.CNIConfName, "The configuration file to chain apiary-cni into; empty: the primary one (the lowest name among *.conf, *.conflist, *.json, the one the runtime uses)")
	fs.String(PluginFlag, def.CNIPluginSource, "The apiary-cni binary copied into --"+ipam.CNIBinDirFlag+"; empty: apiary-cni beside the agent's executable")
}

// interval is how often the configuration is checked again.
const interval = 5 * time.Second

type params struct {
	cell.In

	Config       Config
	PolicyConfig policy.Config
	// IPAMConfig has --cni-bin-dir, where the plugins are.
	IPAMConfig ipam.Config
	PinDir     bpffs.PinDir
	Jobs       job.Group
	DB         *statedb.DB
	Table      statedb.RWTable[*tables.CNIChain]
	Log        *slog.Logger
}

func register(p params) error {
	c := &chainer{db: p.DB, table: p.Table, log: p.Log, cfg: p.Config, pinDir: string(p.PinDir),
		attach: p.PolicyConfig.PolicyInterfaceAttach, binDir: p.IPAMConfig.CNIBinDir}
	switch p.Config.CNIChainingMode {
	case ModeNone:
		return nil
	case ModeUnchain:
		p.Jobs.Add(job.OneShot("unchain", c.unchain))
		return nil
	case ModeChain:
	default:
		return fmt.Errorf("--%s=%q: want %s, %s or %s", ModeFlag, p.Config.CNIChainingMode, ModeNone, ModeChain, ModeUnchain)
	}
	if p.PolicyConfig.EnablePolicy == policy.ModeNever || !p.PolicyConfig.PolicyPodInterfaces {
		// apiary-cni would fail every pod's ADD: nothing pins the programs.
		return fmt.Errorf("--%s=%s needs the interface programs: --%s=true and --%s not %s", ModeFlag, ModeChain,
			policy.PodInterfacesFlag, policy.EnableFlag, policy.ModeNever)
	}
	src, err := PluginSource(p.Config.CNIPluginSource)
	if err != nil {
		return err
	}
	c.src = src
	p.Jobs.Add(job.OneShot("chain", c.run))
	return nil
}

// PluginSource is the apiary-cni binary to copy: flag (--cni-plugin-source)
// or, when it is empty, apiary-cni beside the running executable. It must
// exist.
func PluginSource(flag string) (string, error) {
	src := flag
	if src == "" {
		exe, err := os.Executable()
		if err != nil {
			return "", fmt.Errorf("--%s: the agent's executable: %w", PluginFlag, err)
		}
		src = filepath.Join(filepath.Dir(exe), cnichain.PluginType)
	}
	if _, err := os.Stat(src); err != nil {
		return "", fmt.Errorf("--%s: %w", PluginFlag, err)
	}
	return src, nil
}

type chainer struct {
	db     *statedb.DB
	table  statedb.RWTable[*tables.CNIChain]
	log    *slog.Logger
	cfg    Config
	pinDir string
	attach string
	src    string
	binDir string
}

// run chains every interval until the agent stops.
func (c *chainer) run(ctx context.Context, h cell.Health) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	var last []*tables.CNIChain
	for {
		rows, err := c.pass()
		if err != nil {
			h.Degraded("CNI chaining failed", err)
		} else {
			h.OK(rows[len(rows)-1].File + ": " + rows[len(rows)-1].State)
		}
		if !sameRows(rows, last) {
			for _, r := range rows {
				c.log.Info("CNI chaining", "file", r.File, "state", r.State, "error", r.Error)
			}
			c.write(rows)
			last = rows
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// pass installs the binary and chains the configuration, once the
// interface programs are pinned.
func (c *chainer) pass() ([]*tables.CNIChain, error) {
	if err := Pinned(c.pinDir); err != nil {
		c.log.Debug("Not chaining apiary-cni yet", "reason", err)
		return []*tables.CNIChain{{File: c.cfg.CNIConfDir, State: "waiting for the interface programs"}}, nil
	}
	bin := &tables.CNIChain{File: filepath.Join(c.binDir, cnichain.PluginType), State: "up to date"}
	wrote, err := cnichain.InstallBinary(c.src, c.binDir)
	if err != nil {
		bin.State, bin.Error = "error", err.Error()
		// Chaining without the binary would fail every pod's ADD.
		return []*tables.CNIChain{bin}, err
	}
	if wrote {
		bin.State = "installed"
	}
	res, err := cnichain.Install(c.cfg.CNIConfDir, c.cfg.CNIConfName, cnichain.Entry(c.pinDir, c.attach))
	conf := resultRow(c.cfg.CNIConfDir, res, err)
	return []*tables.CNIChain{bin, conf}, err
}

func resultRow(dir string, res cnichain.Result, err error) *tables.CNIChain {
	row := &tables.CNIChain{File: res.File, State: string(res.State)}
	if row.File == "" {
		row.File = dir
	}
	if err != nil {
		row.State, row.Error = "error", err.Error()
	}
	return row
}

// Pinned says whether what apiary-cni opens is pinned under pinDir (an
// error naming what is missing).
func Pinned(pinDir string) error {
	var missing []error
	for _, p := range []string{
		podiface.ProgramPin(pinDir, podiface.FromPod), podiface.ProgramPin(pinDir, podiface.ToPod),
		filepath.Join(pinDir, bpf.PolicyIfacesMap), filepath.Join(pinDir, bpf.PolicyIfaceFlowsMap),
		filepath.Join(pinDir, bpf.PolicyIfaceFragsMap),
	} {
		if _, err := os.Stat(p); err != nil {
			missing = append(missing, err)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("the interface programs are not pinned yet: %w", errors.Join(missing...))
	}
	return nil
}

// unchain takes apiary-cni out once.
func (c *chainer) unchain(ctx context.Context, h cell.Health) error {
	res, err := cnichain.Uninstall(c.cfg.CNIConfDir, c.cfg.CNIConfName)
	row := resultRow(c.cfg.CNIConfDir, res, err)
	c.log.Info("CNI unchaining", "file", row.File, "state", row.State, "error", row.Error)
	c.write([]*tables.CNIChain{row})
	if err != nil {
		h.Degraded("CNI unchaining failed", err)
	} else {
		h.OK(row.File + ": " + row.State)
	}
	// A finished one-shot job's health scope is closed: held open so
	// that /healthz keeps saying how it went.
	<-ctx.Done()
	return nil
}

// write replaces the table's rows with rows.
func (c *chainer) write(rows []*tables.CNIChain) {
	txn := c.db.WriteTxn(c.table)
	c.table.DeleteAll(txn)
	for _, r := range rows {
		c.table.Insert(txn, r)
	}
	txn.Commit()
}

func sameRows(a, b []*tables.CNIChain) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if *a[i] != *b[i] {
			return false
		}
	}
	return true
}
