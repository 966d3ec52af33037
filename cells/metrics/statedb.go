package metrics

import (
	"fmt"
	"strings"
	"time"

	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
)

// StateDBMetrics implements statedb.Metrics with Prometheus collectors named
// apiary_statedb_*. Per-table series carry a "table" label; write transaction
// series carry the DB "handle" (see statedb.DB.NewHandle) and the locked
// "tables" joined with "+" in sorted order.
type StateDBMetrics struct {
	tableAcquisition   *prometheus.HistogramVec
	totalAcquisition   *prometheus.HistogramVec
	writeTxnDuration   *prometheus.HistogramVec
	graveyardWatermark *prometheus.GaugeVec
	graveyardCleaning  *prometheus.HistogramVec
	graveyardObjects   *prometheus.GaugeVec
	objects            *prometheus.GaugeVec
	deleteTrackers     *prometheus.GaugeVec
	revision           *prometheus.GaugeVec
}

var _ statedb.Metrics = (*StateDBMetrics)(nil)

const stateDBSubsystem = "statedb"

// NewStateDBMetrics creates the statedb collectors and registers them in reg.
func NewStateDBMetrics(reg prometheus.Registerer) (*StateDBMetrics, error) {
	histogram := func(name, help string, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Subsystem: stateDBSubsystem, Name: name, Help: help,
			Buckets: durationBuckets,
		}, labels)
	}
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: Namespace, Subsystem: stateDBSubsystem, Name: name, Help: help,
		}, []string{"table"})
	}
	m := &StateDBMetrics{
		tableAcquisition: histogram("write_txn_table_acquisition_seconds",
			"Time a write transaction waited for the lock of one table (lock contention)", "handle", "table"),
		totalAcquisition: histogram("write_txn_acquisition_seconds",
			"Time a write transaction waited for the locks of all its tables", "handle", "tables"),
		writeTxnDuration: histogram("write_txn_duration_seconds",
			"Time from acquiring the locks of a write transaction to its commit or abort", "handle", "tables"),
		graveyardWatermark: gauge("table_graveyard_low_watermark",
			"Lowest revision not yet seen by every change iterator; deleted objects up to it can be dropped"),
		graveyardCleaning: histogram("table_graveyard_cleaning_duration_seconds",
			"Time spent garbage-collecting the deleted objects of a table", "table"),
		graveyardObjects: gauge("table_graveyard_objects",
			"Deleted objects kept for change iterators that have not observed them yet"),
		objects: gauge("table_objects",
			"Objects in a table"),
		deleteTrackers: gauge("table_delete_trackers",
			"Change iterators that track deletions in a table"),
		revision: gauge("table_revision",
			"Current revision of a table"),
	}
	err := register(reg,
		m.tableAcquisition, m.totalAcquisition, m.writeTxnDuration,
		m.graveyardWatermark, m.graveyardCleaning, m.graveyardObjects,
		m.objects, m.deleteTrackers, m.revision,
	)
	if err != nil {
		return nil, fmt.Errorf("register statedb metrics: %w", err)
	}
	return m, nil
}

// tablesLabel joins the table names of a transaction. statedb passes them
// sorted, so one set of tables always yields one series.
func tablesLabel(tables []string) string {
	return strings.Join(tables, "+")
}

// WriteTxnTableAcquisition implements statedb.Metrics.
func (m *StateDBMetrics) WriteTxnTableAcquisition(handle string, table string, acquire time.Duration) {
	m.tableAcquisition.WithLabelValues(handle, table).Observe(acquire.Seconds())
}

// WriteTxnTotalAcquisition implements statedb.Metrics.
func (m *StateDBMetrics) WriteTxnTotalAcquisition(handle string, tables []string, acquire time.Duration) {
	m.totalAcquisition.WithLabelValues(handle, tablesLabel(tables)).Observe(acquire.Seconds())
}

// WriteTxnDuration implements statedb.Metrics.
func (m *StateDBMetrics) WriteTxnDuration(handle string, tables []string, d time.Duration) {
	m.writeTxnDuration.WithLabelValues(handle, tablesLabel(tables)).Observe(d.Seconds())
}

// GraveyardLowWatermark implements statedb.Metrics.
func (m *StateDBMetrics) GraveyardLowWatermark(table string, lowWatermark statedb.Revision) {
	m.graveyardWatermark.WithLabelValues(table).Set(float64(lowWatermark))
}

// GraveyardCleaningDuration implements statedb.Metrics.
func (m *StateDBMetrics) GraveyardCleaningDuration(table string, d time.Duration) {
	m.graveyardCleaning.WithLabelValues(table).Observe(d.Seconds())
}

// GraveyardObjectCount implements statedb.Metrics.
func (m *StateDBMetrics) GraveyardObjectCount(table string, n int) {
	m.graveyardObjects.WithLabelValues(table).Set(float64(n))
}

// ObjectCount implements statedb.Metrics.
func (m *StateDBMetrics) ObjectCount(table string, n int) {
	m.objects.WithLabelValues(table).Set(float64(n))
}

// DeleteTrackerCount implements statedb.Metrics.
func (m *StateDBMetrics) DeleteTrackerCount(table string, n int) {
	m.deleteTrackers.WithLabelValues(table).Set(float64(n))
}

// Revision implements statedb.Metrics.
func (m *StateDBMetrics) Revision(table string, revision statedb.Revision) {
	m.revision.WithLabelValues(table).Set(float64(revision))
}
