// Package apiarytest runs txtar script tests against apiary hives.
//
// Each testdata file gets a fresh hive built from infra.Cell, a fake
// Kubernetes clientset and the cells under test, with its own temporary pin
// directory on bpffs, state directory and config directory. Besides the
// commands the cells provide (statedb's db/*, health, k8s/add|update|delete,
// the cells' own), a script can use:
//
//	config/add FILE...   copy files from the work dir into --config-dir
//	config/rm FILE...    remove them from --config-dir
//	http/get [--body F] PATH  GET PATH from the API; prints the status
//	                     code on one line, then the body
//	restart              stop the hive and start a new one on the same
//	                     directories, as a restarted agent would
//
// and the condition [kernel], true when the hive's maps are the kernel's
// (not MemoryMaps), for the lines that need what only the kernel does
// (programs loaded and attached).
//
// A first line `#! --flag=value ...` passes flags to the hive; they win over
// the harness's defaults.
package apiarytest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/bpf/memmap"
	"github.com/apiary-net/apiary/cells/api"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/internal/testenv"
)

// ScriptTimeout bounds one script file, including every `*` retry in it.
const ScriptTimeout = 2 * time.Minute

// RunCells runs the scripts matching pattern against hives made of the
// infrastructure, a fake Kubernetes clientset and the given feature cells.
func RunCells(t *testing.T, pattern string, cells ...cell.Cell) {
	t.Helper()
	Run(t, pattern, func(fakeClient cell.Cell) []cell.Cell {
		return append([]cell.Cell{infra.Cell, fakeClient}, cells...)
	})
}

// RunCellsInMemory is RunCells on maps in memory (see MemoryMaps): for
// cells that need no kernel, whose scripts then run without root.
func RunCellsInMemory(t *testing.T, pattern string, cells ...cell.Cell) {
	t.Helper()
	Run(t, pattern, func(fakeClient cell.Cell) []cell.Cell {
		return append([]cell.Cell{infra.Cell, fakeClient}, cells...)
	}, MemoryMaps())
}

// Run runs the scripts matching pattern, each against hives made from the
// cells newCells returns, given the fake Kubernetes client cell to include.
// newCells is called for every hive, restarts included; the fake clientset
// (and so what k8s/add put in it) lives as long as the script.
func Run(t *testing.T, pattern string, newCells func(fakeClient cell.Cell) []cell.Cell, opts ...Option) {
	t.Helper()
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	ctx, cancel := context.WithTimeout(context.Background(), ScriptTimeout)
	t.Cleanup(cancel)
	newEngine := func(tb testing.TB, args []string) *script.Engine {
		a := newAgent(tb, newCells, args, o)
		e := a.engine()
		for name, newCmd := range o.cmds {
			e.Cmds[name] = newCmd(a.apiURL)
		}
		return e
	}
	if o.sequential {
		scripttest.Test(t, ctx, newEngine, nil, pattern, scripttest.NoParallel)
		return
	}
	scripttest.Test(t, ctx, newEngine, nil, pattern)
}

// Option adjusts Run.
type Option func(*options)

type options struct {
	cmds       map[string]func(apiURL func() (string, error)) script.Cmd
	sequential bool
	memoryMaps bool
	anyCgroup  bool
}

// MemoryMaps runs the hives on maps in memory (bpffs.MemoryMaps) and a pin
// directory that is any temporary directory, so that the scripts need no
// root: for cells whose maps all open through bpffs.Maps. The maps keep
// their contents across a restart, as pinned maps do.
func MemoryMaps() Option {
	return func(o *options) { o.memoryMaps = true }
}

// AnyCgroupRoot lets --cgroup-root be any directory (cgroups.AnyDir), so
// that scripts without root stand for pods' cgroups with plain
// directories. With maps in memory, for cells that attach nothing there.
func AnyCgroupRoot() Option {
	return func(o *options) { o.anyCgroup = true }
}

// Sequential runs the script files one after another instead of in
// parallel, for scripts that share something outside their hives (such as
// one fake upstream server whose records they set). ScriptTimeout then
// bounds them all together.
func Sequential() Option {
	return func(o *options) { o.sequential = true }
}

// WithCommand adds a script command built with access to the base URL of the
// current hive's HTTP API (e.g. to run a CLI against it).
func WithCommand(name string, newCmd func(apiURL func() (string, error)) script.Cmd) Option {
	return func(o *options) {
		if o.cmds == nil {
			o.cmds = map[string]func(func() (string, error)) script.Cmd{}
		}
		o.cmds[name] = newCmd
	}
}

// agent is the hive of one script file, replaced on restart.
type agent struct {
	tb         testing.TB
	log        *slog.Logger
	newCells   func(fakeClient cell.Cell) []cell.Cell
	fakeClient cell.Cell
	args       []string
	configDir  string
	// memory, if set, holds the hive's maps.
	memory *bpffs.MemoryMaps
	// anyCgroup provides cgroups.AnyDir.
	anyCgroup bool

	mu     sync.Mutex
	hive   *hive.Hive
	cmds   map[string]script.Cmd
	server *api.Server
}

func newAgent(tb testing.TB, newCells func(cell.Cell) []cell.Cell, args []string, o options) *agent {
	var memory *bpffs.MemoryMaps
	var pinDir string
	if o.memoryMaps {
		memory = &bpffs.MemoryMaps{Pins: memmap.NewPins(nil)}
		pinDir = filepath.Join(tb.TempDir(), "pins")
	} else {
		pinDir = testenv.BPFPinDir(tb)
	}
	stateDir := tb.TempDir()
	configDir := filepath.Join(tb.TempDir(), "config")
	if err := os.Mkdir(configDir, 0o755); err != nil {
		tb.Fatal(err)
	}
	defaults := []string{
		"--api-addr=127.0.0.1:0",
		"--bpf-pin-dir=" + pinDir,
		"--state-dir=" + stateDir,
		"--config-dir=" + configDir,
		"--node-name=test-node",
	}
	a := &agent{
		tb:         tb,
		log:        hivetest.Logger(tb, hivetest.LogLevel(slog.LevelInfo)),
		newCells:   newCells,
		fakeClient: k8sfake.NewCell(k8sfake.New()),
		args:       append(defaults, args...),
		configDir:  configDir,
		memory:     memory,
		anyCgroup:  o.anyCgroup,
	}
	if err := a.build(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		a.mu.Lock()
		h := a.hive
		a.mu.Unlock()
		if err := h.Stop(a.log, context.Background()); err != nil {
			tb.Errorf("stop hive: %s", err)
		}
	})
	return a
}

// build makes a new hive from the flags and populates it.
func (a *agent) build() error {
	var server *api.Server
	cells := append(a.newCells(a.fakeClient), cell.Invoke(func(s *api.Server) { server = s }))
	if a.memory != nil {
		cells = append(cells, cell.Provide(func() *bpffs.MemoryMaps { return a.memory }))
	}
	if a.anyCgroup {
		cells = append(cells, cell.Provide(func() *cgroups.AnyDir { return &cgroups.AnyDir{} }))
	}
	h := hive.NewWithOptions(core.HiveOptions(), cells...)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	if err := fs.Parse(a.args); err != nil {
		return fmt.Errorf("hive flags %v: %w", a.args, err)
	}
	cmds, err := h.ScriptCommands(a.log)
	if err != nil {
		return fmt.Errorf("populate hive: %w", err)
	}
	a.mu.Lock()
	a.hive, a.cmds, a.server = h, cmds, server
	a.mu.Unlock()
	return nil
}

// engine returns a script engine whose hive commands follow restarts.
func (a *agent) engine() *script.Engine {
	cmds := scripttest.DefaultCmds()
	for name := range a.cmds {
		cmds[name] = a.forward(name)
	}
	maps.Copy(cmds, map[string]script.Cmd{
		"config/add": a.configAddCmd(),
		"config/rm":  a.configRmCmd(),
		"http/get":   a.httpGetCmd(),
		"restart":    a.restartCmd(),
	})
	conds := scripttest.DefaultConds()
	conds["kernel"] = script.BoolCondition("the hive's maps are the kernel's, not in memory", a.memory == nil)
	return &script.Engine{
		Cmds:             cmds,
		Conds:            conds,
		RetryInterval:    20 * time.Millisecond,
		MaxRetryInterval: 200 * time.Millisecond,
	}
}

// forward runs the named command of the current hive.
func (a *agent) forward(name string) script.Cmd {
	a.mu.Lock()
	usage := a.cmds[name].Usage()
	a.mu.Unlock()
	return script.Command(*usage, func(s *script.State, args ...string) (script.WaitFunc, error) {
		a.mu.Lock()
		cmd := a.cmds[name]
		a.mu.Unlock()
		return cmd.Run(s, args...)
	})
}

func (a *agent) restartCmd() script.Cmd {
	return script.Command(
		script.CmdUsage{Summary: "Stop the hive and start a new one on the same pin, state and config directories"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			a.mu.Lock()
			old := a.hive
			a.mu.Unlock()
			if err := old.Stop(a.log, s.Context()); err != nil {
				return nil, fmt.Errorf("stop hive: %w", err)
			}
			if err := a.build(); err != nil {
				return nil, err
			}
			a.mu.Lock()
			h := a.hive
			a.mu.Unlock()
			if err := h.Start(a.log, s.Context()); err != nil {
				return nil, fmt.Errorf("start hive: %w", err)
			}
			return nil, nil
		})
}

func (a *agent) configAddCmd() script.Cmd {
	return script.Command(
		script.CmdUsage{Summary: "Copy files from the work directory into --config-dir", Args: "file..."},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) == 0 {
				return nil, script.ErrUsage
			}
			for _, name := range args {
				data, err := os.ReadFile(s.Path(name))
				if err != nil {
					return nil, err
				}
				// Write then rename, as a careful user (or kubectl cp) would,
				// so the watcher never sees half a file.
				dst := filepath.Join(a.configDir, filepath.Base(name))
				tmp := filepath.Join(a.configDir, ".tmp-"+filepath.Base(name))
				if err := os.WriteFile(tmp, data, 0o644); err != nil {
					return nil, err
				}
				if err := os.Rename(tmp, dst); err != nil {
					return nil, err
				}
			}
			return nil, nil
		})
}

func (a *agent) configRmCmd() script.Cmd {
	return script.Command(
		script.CmdUsage{Summary: "Remove files from --config-dir", Args: "file..."},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) == 0 {
				return nil, script.ErrUsage
			}
			for _, name := range args {
				if err := os.Remove(filepath.Join(a.configDir, filepath.Base(name))); err != nil {
					return nil, err
				}
			}
			return nil, nil
		})
}

// apiURL returns the base URL of the current hive's API ("http://127.0.0.1:PORT").
func (a *agent) apiURL() (string, error) {
	a.mu.Lock()
	server := a.server
	a.mu.Unlock()
	if server == nil || server.Addr() == nil {
		return "", fmt.Errorf("the API server is not listening (hive not started?)")
	}
	return "http://" + server.Addr().String(), nil
}

func (a *agent) httpGetCmd() script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "GET a path from the agent's HTTP API",
			Args:    "path",
			Flags: func(fs *pflag.FlagSet) {
				fs.String("body", "", "file whose content is sent as the request body")
			},
			Detail: []string{"Prints the status code on the first line, then the body."},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 1 {
				return nil, script.ErrUsage
			}
			base, err := a.apiURL()
			if err != nil {
				return nil, err
			}
			var body io.Reader
			if name, _ := s.Flags.GetString("body"); name != "" {
				data, err := os.ReadFile(s.Path(name))
				if err != nil {
					return nil, err
				}
				body = bytes.NewReader(data)
			}
			ctx, cancel := context.WithTimeout(s.Context(), 10*time.Second)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+args[0], body)
			if err != nil {
				return nil, err
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return nil, err
			}
			defer resp.Body.Close()
			respBody, err := io.ReadAll(resp.Body)
			if err != nil {
				return nil, err
			}
			return func(*script.State) (string, string, error) {
				return fmt.Sprintf("%d\n%s", resp.StatusCode, respBody), "", nil
			}, nil
		})
}
