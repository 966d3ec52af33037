package reconcilers_test

import (
	"context"
	"errors"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// Environment of TestCTResizeHelper.
const (
	ctHelperDirEnv = "APIARY_TEST_CT_RESIZE_DIR"
	ctHelperMaxEnv = "APIARY_TEST_CT_RESIZE_MAX"
)

// TestCTResizeHelper is the agent TestCTMapsKillMidMigration kills: run
// with ctHelperDirEnv set (and nothing else), it resizes ct4_global in that
// pin directory to ctHelperMaxEnv entries, as a starting agent would. Without
// the variable it does nothing.
func TestCTResizeHelper(t *testing.T) {
	dir := os.Getenv(ctHelperDirEnv)
	if dir == "" {
		return
	}
	n, err := strconv.ParseUint(os.Getenv(ctHelperMaxEnv), 10, 32)
	if err != nil {
		t.Fatalf("%s: %v", ctHelperMaxEnv, err)
	}
	ops := reconcilers.NewCTMaps(nil, nil, dir)
	defer ops.Close()
	row := &tables.CTMap{Name: bpf.CT4GlobalMap, MaxEntries: uint32(n)}
	if err := ops.Update(context.Background(), nil, 0, row); err != nil {
		t.Fatal(err)
	}
}

// TestCTMapsKillMidMigration kills an agent at random points of a resize and
// checks that the pin always holds a whole map, old or new, and that the
// next start completes the resize without losing an entry.
func TestCTMapsKillMidMigration(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	// Big enough for the copy to take tens of milliseconds, so that kills
	// land inside it, small enough to keep the test quick.
	const (
		oldMax = 1 << 17
		newMax = 1 << 18
		live   = 60_000
		kills  = 6
	)
	path := filepath.Join(dir, bpf.CT4GlobalMap)
	tmpPath := path + "_new"

	now := ctNow(t)
	keys := make([]bpf.CTKey4, live)
	values := make([]bpf.CTEntry, live)
	for i := range keys {
		keys[i] = ctKey4(i)
		values[i] = bpf.CTEntry{Lifetime: now + 3600 + uint32(i%1000), TxBytes: uint64(i)}
	}

	// pinOld pins a fresh old-size map holding every entry.
	pinOld := func() ebpf.MapID {
		t.Helper()
		if err := bpf.RemovePinnedMap(dir, bpf.CT4GlobalMap); err != nil {
			t.Fatal(err)
		}
		spec, err := bpf.CTMapSpec(bpf.CT4GlobalMap, oldMax)
		if err != nil {
			t.Fatal(err)
		}
		pm, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer pm.Close()
		if n, err := pm.BatchUpdate(keys, values, nil); err != nil || n != live {
			t.Fatalf("fill old map: %d, %v", n, err)
		}
		return ctMapID(t, pm.Map)
	}

	// checkWhole checks that m holds every entry.
	checkWhole := func(what string, m bpf.Map) {
		t.Helper()
		n := 0
		if err := bpf.WalkCT(m, 8192, func(k []bpf.CTKey4, _ []bpf.CTEntry) error {
			n += len(k)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if n != live {
			t.Fatalf("%s holds %d entries, want %d", what, n, live)
		}
		for range 50 {
			i := rand.IntN(live)
			var v bpf.CTEntry
			if err := m.Lookup(keys[i], &v); err != nil || v != values[i] {
				t.Fatalf("%s: entry %d = %+v, %v; want %+v", what, i, v, err, values[i])
			}
		}
	}

	// resize runs the helper; with kill set, it kills it after that long
	// from the moment the temporary pin appears, i.e. when the copy starts.
	// It returns how long the helper ran from that moment.
	resize := func(kill bool, after time.Duration) time.Duration {
		t.Helper()
		cmd := exec.Command(os.Args[0], "-test.run=^TestCTResizeHelper$")
		cmd.Env = append(os.Environ(), ctHelperDirEnv+"="+dir, ctHelperMaxEnv+"="+strconv.Itoa(newMax),
			// The race detector otherwise sleeps a second before exiting,
			// which would count as part of the resize.
			"GORACE=atexit_sleep_ms=0")
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()

		var exitErr error
		done := false
		for !done {
			if _, err := os.Stat(tmpPath); err == nil {
				break
			}
			select {
			case exitErr = <-exited:
				done = true
			case <-time.After(20 * time.Microsecond):
			}
		}
		start := time.Now()
		if !done {
			if kill {
				time.Sleep(after)
				cmd.Process.Kill() // SIGKILL: no deferred cleanup runs
			}
			exitErr = <-exited
		}
		if !kill && exitErr != nil {
			t.Fatalf("resize helper: %v", exitErr)
		}
		return time.Since(start)
	}

	// Calibrate: a resize that is not interrupted.
	pinOld()
	copyTime := resize(false, 0)
	t.Logf("uninterrupted resize of %d entries: %s from the temporary pin to exit", live, copyTime)
	m := ctPinnedMap(t, dir, bpf.CT4GlobalMap)
	if m.MaxEntries() != newMax {
		t.Fatalf("after resize the pin has max entries %d, want %d", m.MaxEntries(), newMax)
	}
	checkWhole("resized map", m)

	outcomes := map[string]int{}
	for i := range kills {
		oldID := pinOld()
		// The first kills come as the copy starts; the others anywhere
		// between then and well after the helper would have finished.
		after := time.Duration(0)
		if i > 1 {
			after = time.Duration(rand.Int64N(int64(2 * copyTime)))
		}
		resize(true, after)

		_, errTmp := os.Stat(tmpPath)
		pinned, err := ebpf.LoadPinnedMap(path, nil)
		if err != nil {
			t.Fatalf("kill %d after %s: nothing usable pinned: %v", i, after, err)
		}
		var outcome string
		switch {
		case ctMapID(t, pinned) == oldID:
			outcome = "old"
			if errTmp == nil {
				outcome = "old with temporary pin"
			}
			checkWhole("old map after kill", pinned)
		case pinned.MaxEntries() == newMax:
			outcome = "new"
			checkWhole("new map after kill", pinned)
		default:
			t.Fatalf("kill %d after %s: pin holds map %d with max entries %d, neither old nor new",
				i, after, ctMapID(t, pinned), pinned.MaxEntries())
		}
		pinned.Close()
		outcomes[outcome]++

		// The next start completes the resize.
		ops := ctNewOps(t, dir)
		row := ctUpdate(t, ops, &tables.CTMap{Name: bpf.CT4GlobalMap, MaxEntries: newMax})
		if row.ActualMaxEntries != newMax || (outcome == "new") != (row.Pin == "reused") {
			t.Fatalf("restart after kill (%s): %+v", outcome, row)
		}
		ctUseMap(t, ops, bpf.CT4GlobalMap, func(m bpf.Map) { checkWhole("map after restart", m) })
		ops.Close()
		if _, err := os.Stat(tmpPath); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("temporary pin left after restart (stat: %v)", err)
		}
	}
	t.Logf("outcomes of %d kills: %v", kills, outcomes)
	// The first kills come right as the copy starts, which takes far
	// longer than a kill: they must have caught the migration mid-way.
	if outcomes["old with temporary pin"] == 0 {
		t.Errorf("no kill interrupted a copy: %v", outcomes)
	}
}
