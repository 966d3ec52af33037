package bpffs

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"

	"github.com/apiary-net/apiary/internal/testenv"
)

func TestPrepare(t *testing.T) {
	base := testenv.BPFPinDir(t)
	for _, tc := range []struct {
		name    string
		dir     string
		wantErr string
	}{
		{"existing dir on bpffs", base, ""},
		{"nested dir created", filepath.Join(base, "a", "b"), ""},
		{"not on bpffs", t.TempDir(), "is not on a bpffs mount"},
		{"empty", "", "--bpf-pin-dir is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Prepare(tc.dir)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, want an error mentioning %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.dir {
				t.Errorf("got %q, want %q", got, tc.dir)
			}
		})
	}
}

// TestPinDirLock checks that a second agent on a pin directory is refused
// with one line naming the directory and the holder's PID, that the
// directory is free again once the first one stops, and that a hive that
// never starts (its populate failed) holds nothing.
func TestPinDirLock(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	log := hivetest.Logger(t)
	if _, err := newPinDir(Config{PinDir: dir}, log, &cell.DefaultLifecycle{}); err != nil {
		t.Fatal(err)
	}

	lc := &cell.DefaultLifecycle{}
	if _, err := newPinDir(Config{PinDir: dir}, log, lc); err != nil {
		t.Fatal(err)
	}
	if err := lc.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	_, err := newPinDir(Config{PinDir: dir}, log, &cell.DefaultLifecycle{})
	want := "another apiary agent (pid " + strconv.Itoa(os.Getpid()) + ") holds " + dir +
		": stop it or give this agent another --bpf-pin-dir"
	if err == nil || err.Error() != want {
		t.Fatalf("second agent: got %v, want %q", err, want)
	}

	if err := lc.Stop(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	lc = &cell.DefaultLifecycle{}
	if _, err := newPinDir(Config{PinDir: dir}, log, lc); err != nil {
		t.Fatalf("after the first agent stopped: %v", err)
	}
	if err := lc.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := lc.Stop(log, t.Context()); err != nil {
		t.Fatal(err)
	}
}
