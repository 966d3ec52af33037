package reconcilers

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apiary-net/apiary/bpf"
)

// Kinds of drift a resync repairs.
const (
	// DriftMissing: an entry the agent wrote is not in the map.
	DriftMissing = "missing"
	// DriftChanged: an entry holds another value than the agent wrote.
	DriftChanged = "changed"
	// DriftStray: the map holds an entry the agent did not write.
	DriftStray = "stray"
)

// driftDegradedRounds is how many resyncs in a row must find a map
// drifted before the resync reports an error (the reconciler's health
// Degraded): something keeps writing it.
const driftDegradedRounds = 3

// Drift counts what resyncs of the agent's maps repaired, by map and
// kind, and remembers which maps drifted in the last rounds. It is safe
// for concurrent use; a nil *Drift counts nothing.
type Drift struct {
	log     *slog.Logger
	counter *prometheus.CounterVec

	mu      sync.Mutex
	streaks map[string]int // map → resyncs in a row that repaired it
}

// NewDrift returns a Drift that exports
// apiary_bpf_map_drift_repaired_total{map,kind} through reg.
func NewDrift(log *slog.Logger, reg prometheus.Registerer) (*Drift, error) {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "apiary", Subsystem: "bpf", Name: "map_drift_repaired_total",
		Help: "Entries of the agent's BPF maps that a resync (--bpf-map-resync-interval) found differing from what the agent wrote, and repaired: missing (written again), changed (rewritten), stray (deleted)",
	}, []string{"map", "kind"})
	if err := reg.Register(c); err != nil {
		return nil, fmt.Errorf("register drift counter: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Drift{log: log, counter: c, streaks: map[string]int{}}, nil
}

// DriftCounts are the repairs of one map in one resync.
type DriftCounts struct {
	Missing, Changed, Stray int
}

func (c DriftCounts) total() int { return c.Missing + c.Changed + c.Stray }

// Report records one resync of mapName: the repairs are counted and
// logged, and an error is returned when the map has drifted in
// driftDegradedRounds resyncs in a row.
func (d *Drift) Report(mapName string, c DriftCounts) error {
	if d == nil {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if c.total() == 0 {
		delete(d.streaks, mapName)
		return nil
	}
	for kind, n := range map[string]int{DriftMissing: c.Missing, DriftChanged: c.Changed, DriftStray: c.Stray} {
		d.counter.WithLabelValues(mapName, kind).Add(float64(n))
	}
	d.streaks[mapName]++
	d.log.Warn("Repaired BPF map drift: the map held other entries than the agent wrote",
		"map", mapName, "missing", c.Missing, "changed", c.Changed, "stray", c.Stray, "rounds-in-a-row", d.streaks[mapName])
	if n := d.streaks[mapName]; n >= driftDegradedRounds {
		return fmt.Errorf("map %s drifted in %d resyncs in a row (this one: %d missing, %d changed, %d stray, repaired): something else writes it",
			mapName, n, c.Missing, c.Changed, c.Stray)
	}
	return nil
}

// resyncMap compares m with want, what the agent wrote into it, and
// repairs m: missing and changed entries are written again, strays
// deleted. Correct entries are never touched, so the datapath never misses
// one. Without drift it reads the map once and writes nothing.
func resyncMap[K, V comparable](m bpf.Map, want map[K]V) (DriftCounts, error) {
	return resyncMapLeaving(m, want, nil)
}

// resyncMapLeaving is resyncMap, except that it leaves alone the entries
// whose key leave (if not nil) accepts: entries the agent is not sure of,
// which want leaves out.
func resyncMapLeaving[K, V comparable](m bpf.Map, want map[K]V, leave func(K) bool) (DriftCounts, error) {
	var c DriftCounts
	var rewrite, strays []K
	matched := 0
	err := bpf.Walk(m, 4096, func(keys []K, values []V) error {
		for i, k := range keys {
			w, ok := want[k]
			switch {
			case !ok && leave != nil && leave(k):
			case !ok:
				strays = append(strays, k)
			case w != values[i]:
				c.Changed++
				rewrite = append(rewrite, k)
				matched++
			default:
				matched++
			}
		}
		return nil
	})
	if err != nil {
		return c, fmt.Errorf("read %s: %w", m, err)
	}
	if matched < len(want) {
		// Rare: find which are missing.
		seen := make(map[K]struct{}, matched)
		err := bpf.Walk(m, 4096, func(keys []K, _ []V) error {
			for _, k := range keys {
				seen[k] = struct{}{}
			}
			return nil
		})
		if err != nil {
			return c, fmt.Errorf("read %s: %w", m, err)
		}
		for k := range want {
			if _, ok := seen[k]; !ok {
				c.Missing++
				rewrite = append(rewrite, k)
			}
		}
	}
	c.Stray = len(strays)
	var errs []error
	for _, k := range rewrite {
		if err := m.Put(k, want[k]); err != nil {
			errs = append(errs, fmt.Errorf("repair %v: %w", k, err))
		}
	}
	for _, k := range strays {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("delete stray %v: %w", k, err))
		}
	}
	return c, errors.Join(errs...)
}

// Counter returns the counter vector (map, kind), for tests.
func (d *Drift) Counter() *prometheus.CounterVec { return d.counter }
