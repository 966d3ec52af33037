package bpf_test

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

func TestIsBPFFS(t *testing.T) {
	for _, path := range []string{"/tmp", t.TempDir()} {
		ok, err := bpf.IsBPFFS(path)
		if err != nil {
			t.Fatalf("IsBPFFS(%s): %v", path, err)
		}
		if ok {
			t.Errorf("IsBPFFS(%s) = true, want false", path)
		}
	}

	_, err := bpf.IsBPFFS(filepath.Join(t.TempDir(), "missing"))
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("IsBPFFS(missing path): got error %v, want one matching fs.ErrNotExist", err)
	}
}

func TestIsBPFFSOnBPFFS(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	for _, path := range []string{bpf.DefaultFSRoot, dir} {
		ok, err := bpf.IsBPFFS(path)
		if err != nil {
			t.Fatalf("IsBPFFS(%s): %v", path, err)
		}
		if !ok {
			t.Errorf("IsBPFFS(%s) = false, want true", path)
		}
	}
}

func TestEnsureFSAlreadyMounted(t *testing.T) {
	dir := testenv.BPFPinDir(t) // mounts DefaultFSRoot if it was not yet

	before := bpfMounts(t)
	// Both the mount point and a directory below it are on bpffs already.
	for _, root := range []string{bpf.DefaultFSRoot, dir} {
		if err := bpf.EnsureFS(root); err != nil {
			t.Fatalf("EnsureFS(%s): %v", root, err)
		}
	}
	if after := bpfMounts(t); after != before {
		t.Errorf("EnsureFS on mounted bpffs changed the bpf mounts from %d to %d", before, after)
	}
}

func TestEnsureFSMounts(t *testing.T) {
	testenv.RequireRoot(t)

	// A missing directory, several levels deep, on a filesystem that is not bpffs.
	root := filepath.Join(t.TempDir(), "a", "bpf")
	if err := bpf.EnsureFS(root); err != nil {
		t.Fatalf("EnsureFS(%s): %v", root, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(root, 0); err != nil {
			t.Errorf("unmount %s: %v", root, err)
		}
	})

	ok, err := bpf.IsBPFFS(root)
	if err != nil || !ok {
		t.Fatalf("IsBPFFS(%s) after EnsureFS = %v, %v; want true, nil", root, ok, err)
	}

	// A second call must not stack another mount on top.
	before := bpfMounts(t)
	if err := bpf.EnsureFS(root); err != nil {
		t.Fatalf("second EnsureFS(%s): %v", root, err)
	}
	if after := bpfMounts(t); after != before {
		t.Errorf("second EnsureFS changed the bpf mounts from %d to %d", before, after)
	}
}

func TestEnsureFSError(t *testing.T) {
	// A regular file can be neither a mount point for bpffs nor a directory.
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	err := bpf.EnsureFS(file)
	if err == nil {
		t.Fatalf("EnsureFS(%s) on a regular file succeeded", file)
	}
	if want := "mount bpffs at " + file; !strings.Contains(err.Error(), want) {
		t.Errorf("EnsureFS error %q does not contain %q", err, want)
	}
}

// bpfMounts counts the bpffs mounts visible to this process.
func bpfMounts(t *testing.T) int {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for line := range strings.Lines(string(data)) {
		// The filesystem type follows the " - " separator.
		_, after, ok := strings.Cut(line, " - ")
		if ok && strings.HasPrefix(after, "bpf ") {
			n++
		}
	}
	return n
}
