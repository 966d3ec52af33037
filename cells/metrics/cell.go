// Package metrics owns the agent's Prometheus registry and reports the
// internals of statedb (tables, write transactions, graveyard) and of every
// reconciler into it.
//
// The registry is created per hive rather than taken from
// prometheus.DefaultRegisterer, so that several hives can run in one process
// (tests do) without colliding on metric names.
package metrics

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"
)

// Namespace prefixes every metric apiary defines itself.
const Namespace = "apiary"

// Cell provides the Prometheus registry (as *prometheus.Registry for serving
// and as prometheus.Registerer for cells adding their own collectors), the
// statedb.Metrics picked up by statedb.Cell and the reconciler.Metrics picked
// up by every reconciler through reconciler.Params.DefaultMetrics.
var Cell = cell.Module(
	"metrics",
	"Prometheus registry and statedb and reconciler metrics",

	cell.Provide(
		NewRegistry,
		func(r *prometheus.Registry) prometheus.Registerer { return r },
		func(r prometheus.Registerer) (statedb.Metrics, error) { return NewStateDBMetrics(r) },
		func(r prometheus.Registerer) (reconciler.Metrics, error) { return NewReconcilerMetrics(r) },
	),
)
