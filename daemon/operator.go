package main

import (
	"log/slog"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/cobra"

	"github.com/apiary-net/apiary/cells/api"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/operator"
)

// operatorCells is the identity operator: the agent's infrastructure less
// what only a node needs (bpffs, the node's config), the Kubernetes client
// (tests swap in a fake one) and the identity controller.
func operatorCells(k8sClient cell.Cell) []cell.Cell {
	return []cell.Cell{
		statedb.Cell, health.Cell, job.Cell, metrics.Cell, api.Cell, k8s.SourcesCell,
		k8sClient,
		operator.Cell, // one Identity per label set, GC, leader election
	}
}

func newOperatorCmd() *cobra.Command {
	h := hive.NewWithOptions(core.HiveOptions(), operatorCells(k8s.ClientCell)...)
	logOpts := logOptions{Format: "text", Level: "info"}
	cmd := &cobra.Command{
		Use:   "operator",
		Short: "Run the identity operator (one per cluster, replicas elect a leader)",
		Long: "Run the identity operator: it watches Pods, Namespaces and apiary.io Identities and\n" +
			"gives every label set pods use exactly one Identity, collecting unused ones. Agents\n" +
			"running with --identity-management-mode=operator use its Identities. Every flag can\n" +
			"also be set as APIARY_<FLAG>.",
		Args: cobra.NoArgs,
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
