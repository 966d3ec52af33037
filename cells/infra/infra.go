// Package infra is the infrastructure every apiary feature cell stands on.
package infra

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/cells/api"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/node"
)

// Cell is what every feature cell stands on, in the agent and in
// the script-test harness alike. Logging is not a cell: it is the logger
// handed to the hive. The Kubernetes client is not included, as the agent
// uses the real one and tests a fake.
var Cell = cell.Group(
	statedb.Cell,    // the in-memory database holding every table
	health.Cell,     // per-module health, the "health" table
	job.Cell,        // background jobs, one group per module
	metrics.Cell,    // Prometheus registry, statedb and reconciler metrics
	api.Cell,        // HTTP API on --api-addr: /statedb/, /healthz, /metrics
	node.Cell,       // --node-name, --state-dir
	bpffs.Cell,      // --bpf-pin-dir on a mounted bpffs
	cgroups.Cell,    // --cgroup-root, for socket LB and policy; mounted only by what attaches to it
	k8s.SourcesCell, // Kubernetes objects from the API server and/or --config-dir
)
