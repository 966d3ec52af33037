package bpf

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

// DefaultFSRoot is where bpffs is conventionally mounted, and therefore where
// other tools (bpftool, Cilium) expect to find pinned objects.
const DefaultFSRoot = "/sys/fs/bpf"

// IsBPFFS reports whether path lies on a bpf filesystem, i.e. whether BPF
// objects can be pinned below it.
//
// A path that does not exist yields an error matching [fs.ErrNotExist].
func IsBPFFS(path string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false, fmt.Errorf("statfs %s: %w", path, err)
	}
	// Type is signed on some architectures, so compare as uint32, the width of
	// the magic number.
	return uint32(st.Type) == uint32(unix.BPF_FS_MAGIC), nil
}

// EnsureFS makes sure that root is on a bpf filesystem, so that maps can be
// pinned below it and survive a restart of the agent.
//
// If root already lies on bpffs (it is a mount point or a directory within
// one), EnsureFS does nothing. Otherwise it creates root if missing and mounts
// a bpffs instance there. It needs CAP_SYS_ADMIN only in the latter case.
func EnsureFS(root string) error {
	ok, err := IsBPFFS(root)
	switch {
	case err == nil && ok:
		return nil
	case errors.Is(err, fs.ErrNotExist):
		if err := os.MkdirAll(root, 0o755); err != nil {
			return fmt.Errorf("mount bpffs at %s: %w", root, err)
		}
	case err != nil:
		return fmt.Errorf("mount bpffs at %s: %w", root, err)
	}

	if err := unix.Mount("bpf", root, "bpf", 0, ""); err != nil {
		return fmt.Errorf("mount bpffs at %s: %w", root, err)
	}

	// Check rather than trust the mount: if root still is not on bpffs, say
	// so here instead of leaving it to a puzzling pin failure later.
	ok, err = IsBPFFS(root)
	if err != nil {
		return fmt.Errorf("mount bpffs at %s: %w", root, err)
	}
	if !ok {
		return fmt.Errorf("mount bpffs at %s: still not on bpffs after mounting", root)
	}
	return nil
}
