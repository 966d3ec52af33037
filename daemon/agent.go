package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/dig"

	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/k8s"
)

func newAgentCmd() *cobra.Command {
	return newHiveCmd("agent", "Run the node agent",
		"Run the node agent: it reads Kubernetes objects (from the API server and/or --config-dir),\n"+
			"keeps its tables in statedb, converges them into BPF maps pinned under --bpf-pin-dir,\n"+
			"and serves its state on --api-addr. Every flag can also be set as APIARY_<FLAG>,\n"+
			"e.g. APIARY_API_ADDR=0.0.0.0:9234.",
		agentCells(k8s.ClientCell))
}

// newHiveCmd returns a command that runs a hive of cells until SIGINT or
// SIGTERM, with the hive's flags plus --log-format and --log-level, each
// also read from APIARY_<FLAG>.
func newHiveCmd(use, short, long string, cells []cell.Cell) *cobra.Command {
	h := hive.NewWithOptions(core.HiveOptions(), cells...)
	logOpts := logOptions{Format: "text", Level: "info"}

	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Long:  long,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			applyEnv(cmd.Flags(), "log-format", "log-level")
			log, err := newLogger(cmd.ErrOrStderr(), logOpts)
			if err != nil {
				return err
			}
			log = withoutInvokeFailures(log)
			slog.SetDefault(log)
			return runHive(h, log)
		},
	}
	cmd.Flags().StringVar(&logOpts.Format, "log-format", logOpts.Format, "Log format: text (coloured on a terminal) or json")
	cmd.Flags().StringVar(&logOpts.Level, "log-level", logOpts.Level, "Log level: debug, info, warn or error")
	h.RegisterFlags(cmd.Flags())
	cmd.AddCommand(h.Command())
	return cmd
}

// runHive builds the hive first, so that a bad flag is one clear line and
// nothing has started, then runs it until SIGINT/SIGTERM.
func runHive(h *hive.Hive, log *slog.Logger) error {
	// Hive listens for signals only once every start hook has run; until
	// then SIGTERM would kill the process without its stop hooks (and
	// constructors open maps and files). Catch the signals from here on and
	// turn one into a shutdown, which Run honours as soon as the start is
	// over.
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(signals)
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case sig := <-signals:
			log.Info("Signal received, stopping once started", "signal", sig)
			h.Shutdown()
		case <-done:
		}
	}()
	if err := h.Populate(log); err != nil {
		return populateError(err)
	}
	return h.Run(log)
}

// populateError reduces dig's chain of "could not build arguments for ..."
// to the error a constructor returned, which names the flag at fault.
func populateError(err error) error {
	root := dig.RootCause(err)
	if root == nil || root == err {
		var pe hive.ErrPopulate
		if errors.As(err, &pe) {
			return fmt.Errorf("invalid configuration: %s", firstLine(pe.Error()))
		}
		return err
	}
	return fmt.Errorf("invalid configuration: %w", root)
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// applyEnv lets APIARY_<FLAG> set the named non-hive flags, as hive does for
// its own flags; a flag given on the command line wins.
func applyEnv(fs *pflag.FlagSet, names ...string) {
	for _, name := range names {
		f := fs.Lookup(name)
		if f == nil || f.Changed {
			continue
		}
		env := core.EnvPrefix + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
		if v, ok := os.LookupEnv(env); ok {
			f.Value.Set(v)
		}
	}
}
