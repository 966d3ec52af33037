package node

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
)

func TestNewConfig(t *testing.T) {
	tmp := t.TempDir()
	file := filepath.Join(tmp, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		flags   Flags
		wantErr string
	}{
		{"existing dir", Flags{NodeName: "n1", StateDir: tmp}, ""},
		{"created with parents", Flags{NodeName: "n1", StateDir: filepath.Join(tmp, "a", "b")}, ""},
		{"relative made absolute", Flags{NodeName: "n1", StateDir: "rel-state"}, ""},
		{"below a file", Flags{NodeName: "n1", StateDir: filepath.Join(file, "sub")}, "--state-dir"},
		{"empty dir", Flags{NodeName: "n1", StateDir: ""}, "--state-dir is empty"},
		{"empty node name", Flags{NodeName: "", StateDir: tmp}, "--node-name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "relative made absolute" {
				t.Chdir(tmp)
			}
			cfg, err := newConfig(tc.flags, hivetest.Lifecycle(t))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, want an error mentioning %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !filepath.IsAbs(cfg.StateDir) {
				t.Errorf("state dir %q is not absolute", cfg.StateDir)
			}
			if st, err := os.Stat(cfg.StateDir); err != nil || !st.IsDir() {
				t.Errorf("state dir %q not created: %v", cfg.StateDir, err)
			}
			entries, _ := os.ReadDir(cfg.StateDir)
			for _, e := range entries {
				if strings.HasPrefix(e.Name(), ".write-probe") {
					t.Errorf("write probe %s left behind", e.Name())
				}
			}
		})
	}
}

// TestStateDirLock checks that a second agent on a state directory is
// refused with one line naming the lock file and the holder's PID, that the
// directory is free again once the first one stops, and that a hive that
// never starts (its populate failed) holds nothing.
func TestStateDirLock(t *testing.T) {
	dir := t.TempDir()
	log := hivetest.Logger(t)
	lockPath := filepath.Join(dir, LockFile)

	// Built, never started: no lock kept.
	if _, err := newConfig(Flags{NodeName: "n0", StateDir: dir}, &cell.DefaultLifecycle{}); err != nil {
		t.Fatal(err)
	}

	lc := &cell.DefaultLifecycle{}
	if _, err := newConfig(Flags{NodeName: "n1", StateDir: dir}, lc); err != nil {
		t.Fatal(err)
	}
	if err := lc.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	if data, err := os.ReadFile(lockPath); err != nil || strings.TrimSpace(string(data)) != strconv.Itoa(os.Getpid()) {
		t.Errorf("%s holds %q (%v), want the agent's pid", lockPath, data, err)
	}

	want := "another apiary agent (pid " + strconv.Itoa(os.Getpid()) + ") holds " + lockPath +
		": stop it or give this agent another --state-dir"
	_, err := newConfig(Flags{NodeName: "n2", StateDir: dir}, &cell.DefaultLifecycle{})
	if err == nil || err.Error() != want {
		t.Fatalf("second agent: got %v, want %q", err, want)
	}

	// The first agent stops: its stop hook releases the lock.
	if err := lc.Stop(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	lc = &cell.DefaultLifecycle{}
	if _, err := newConfig(Flags{NodeName: "n2", StateDir: dir}, lc); err != nil {
		t.Fatalf("after the first agent stopped: %v", err)
	}
	// Another agent slipped in between populate and start: start fails.
	other, err := LockStateDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := lc.Start(log, t.Context()); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("start with the directory taken since populate: %v, want %q", err, want)
	}
	other.Release()
}
