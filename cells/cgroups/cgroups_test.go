package cgroups

import (
	"encoding/binary"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/internal/testenv"
)

func TestNewRoot(t *testing.T) {
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		dir, want, wantErr string
	}{
		{dir: DefaultRoot, want: DefaultRoot},
		{dir: "/sys/fs/cgroup/unified/", want: "/sys/fs/cgroup/unified"},
		{dir: "rel/cg", want: filepath.Join(wd, "rel/cg")},
		{dir: "", wantErr: "--cgroup-root is empty"},
		{dir: "  ", wantErr: "--cgroup-root is empty"},
	} {
		t.Run(tc.dir, func(t *testing.T) {
			r, err := NewRoot(tc.dir)
			if tc.wantErr != "" {
				if err == nil || err.Error() != tc.wantErr {
					t.Fatalf("NewRoot(%q) = %v, want error %q", tc.dir, err, tc.wantErr)
				}
				return
			}
			if err != nil || r.Path() != tc.want {
				t.Fatalf("NewRoot(%q) = %q, %v; want %q", tc.dir, r.Path(), err, tc.want)
			}
		})
	}
}

// TestZeroRoot: a Root not made by NewRoot says so instead of panicking.
func TestZeroRoot(t *testing.T) {
	var r Root
	if err := r.Check(); err == nil {
		t.Error("Check of a zero Root succeeded")
	}
	if _, err := r.Prepare(); err == nil {
		t.Error("Prepare of a zero Root succeeded")
	}
}

// TestCheckAndPrepare: a cgroup v2 directory is ready as it is; any other
// directory is refused (named by the flag), unless it is the default one,
// which Prepare mounts.
func TestCheckAndPrepare(t *testing.T) {
	testenv.RequireRoot(t)
	cg := testenv.Cgroup(t)
	plain := t.TempDir()
	for _, tc := range []struct {
		name       string
		dir        string
		checkErr   string // "" for ready
		prepareErr string
	}{
		{name: "cgroup", dir: cg},
		{name: "plain directory", dir: plain, checkErr: "is not a cgroup v2 directory", prepareErr: "is not a cgroup v2 directory"},
		{name: "missing", dir: filepath.Join(plain, "missing"), checkErr: "no such file", prepareErr: "is not a cgroup v2 directory"},
		{name: "below a file", dir: "/etc/hostname/cg", checkErr: "not a directory", prepareErr: "not a directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := NewRoot(tc.dir)
			if err != nil {
				t.Fatal(err)
			}
			wantErr := func(what string, err error, want string) {
				t.Helper()
				if want == "" {
					if err != nil {
						t.Errorf("%s: %v", what, err)
					}
					return
				}
				if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "--cgroup-root") {
					t.Errorf("%s: %v, want an error naming --cgroup-root and %q", what, err, want)
				}
			}
			wantErr("Check", r.Check(), tc.checkErr)
			path, err := r.Prepare()
			wantErr("Prepare", err, tc.prepareErr)
			if err == nil && path != tc.dir {
				t.Errorf("Prepare = %q, want %q", path, tc.dir)
			}
		})
	}
}

// TestPrepareMounts: the default directory is created and mounted once,
// however many features prepare it at the same time.
func TestPrepareMounts(t *testing.T) {
	testenv.RequireRoot(t)
	dir := filepath.Join(t.TempDir(), "cgroupv2")
	r, err := NewRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	r.mountAt = dir // stands for DefaultRoot, which is the host's
	t.Cleanup(func() {
		for mounts(t, dir) > 0 {
			if err := unix.Unmount(dir, 0); err != nil {
				t.Errorf("unmount %s: %v", dir, err)
				return
			}
		}
	})
	if err := r.Check(); err == nil || !strings.Contains(err.Error(), "not mounted yet") {
		t.Fatalf("Check before Prepare: %v, want 'not mounted yet'", err)
	}

	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { _, errs[i] = r.Prepare() })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("Prepare: %v", err)
	}
	if n := mounts(t, dir); n != 1 {
		t.Fatalf("%s is mounted %d times, want once", dir, n)
	}
	if err := r.Check(); err != nil {
		t.Fatalf("Check after Prepare: %v", err)
	}
}

// mounts counts the mounts at dir.
func mounts(t *testing.T, dir string) int {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for line := range strings.SplitSeq(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == dir {
			n++
		}
	}
	return n
}

func TestID(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		dir      string
		want     uint64
		wantErr  string
		notExist bool
	}{
		{name: "directory", dir: dir, want: st.Ino},
		{name: "missing", dir: filepath.Join(dir, "missing"), wantErr: "no such file", notExist: true},
		{name: "file", dir: file, wantErr: "is not a directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, err := ID(tc.dir)
			if tc.wantErr == "" {
				if err != nil || id != tc.want {
					t.Fatalf("ID = %d, %v; want %d", id, err, tc.want)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("ID = %d, %v; want error %q", id, err, tc.wantErr)
			}
			if errors.Is(err, fs.ErrNotExist) != tc.notExist {
				t.Errorf("errors.Is(%v, fs.ErrNotExist) = %v", err, !tc.notExist)
			}
		})
	}
}

// TestIDOfCgroup: the ID of a real cgroup is the one the kernel gives it,
// which it also hands out as the cgroup's file handle.
func TestIDOfCgroup(t *testing.T) {
	cg := testenv.Cgroup(t)
	h, _, err := unix.NameToHandleAt(unix.AT_FDCWD, cg, 0)
	if err != nil {
		testenv.Skip(t, "no file handle for a cgroup: "+err.Error())
	}
	if len(h.Bytes()) != 8 {
		t.Fatalf("cgroup file handle of %d bytes, want 8", len(h.Bytes()))
	}
	want := binary.NativeEndian.Uint64(h.Bytes())
	if id, err := ID(cg); err != nil || id != want {
		t.Fatalf("ID(%s) = %d, %v; want %d", cg, id, err, want)
	}
}

// TestNewRootHybrid: the cgroup mount point of a hybrid host (a tmpfs with
// cgroup v2 at unified/) stands for its cgroup v2 hierarchy, which is what
// the DaemonSet's mount of the host's /sys/fs/cgroup shows on such hosts.
func TestNewRootHybrid(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	r, err := NewRoot(dir)
	if err != nil || r.Path() != dir {
		t.Fatalf("no cgroup v2 below: NewRoot = %q, %v; want %s", r.Path(), err, dir)
	}
	unified := filepath.Join(dir, HybridSubdir)
	if err := os.Mkdir(unified, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("none", unified, "cgroup2", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(unified, unix.MNT_DETACH) })
	r, err = NewRoot(dir)
	if err != nil || r.Path() != unified {
		t.Fatalf("NewRoot = %q, %v; want %s", r.Path(), err, unified)
	}
	if err := r.Check(); err != nil {
		t.Errorf("Check: %v", err)
	}
}
