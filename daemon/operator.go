package main

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/cobra"

	"github.com/apiary-net/apiary/cells/api"
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
	return newHiveCmd("operator", "Run the identity operator (one per cluster, replicas elect a leader)",
		"Run the identity operator: it watches Pods, Namespaces and apiary.io Identities and\n"+
			"gives every label set pods use exactly one Identity, collecting unused ones. Agents\n"+
			"running with --identity-management-mode=operator use its Identities. Every flag can\n"+
			"also be set as APIARY_<FLAG>.",
		operatorCells(k8s.ClientCell))
}
