// Package cgroups owns --cgroup-root: the cgroup v2 directory that the
// agent's cgroup programs act on (socket load balancing, policy
// enforcement), and under which it finds the pods' kubelet cgroups.
//
// Several features need the directory, and a flag can be registered only
// once, so it lives here rather than in any of them. The directory is
// prepared (mounted) lazily, by the features that attach programs to it:
// an agent that uses none of them never mounts anything, and a root that
// cannot be used fails only the features that need it.
package cgroups

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
	"golang.org/x/sys/unix"
)

// Cell provides Root.
var Cell = cell.Module(
	"cgroups",
	"cgroup v2 root of socket LB and policy",

	cell.Config(Config{CgroupRoot: DefaultRoot}),
	cell.Provide(newRoot),
)

// RootFlag names the flag holding the cgroup root.
const RootFlag = "cgroup-root"

// DefaultRoot is where the agent mounts cgroup v2 when --cgroup-root is not
// given and nothing is mounted there yet.
const DefaultRoot = "/run/apiary/cgroupv2"

// Config is the cgroups cell's configuration.
type Config struct {
	// CgroupRoot is the cgroup v2 directory the agent's programs attach
	// to; they act on every process in it and below it.
	CgroupRoot string
}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.String(RootFlag, def.CgroupRoot,
		"cgroup v2 directory the socket load balancer and policy enforcement attach to (processes in it and below it are acted on) and under which pods' kubelet cgroups are found; "+
			DefaultRoot+" is mounted when missing")
}

// Root is --cgroup-root, made absolute. Copies share one mount lock, so
// that features preparing it at once mount it once.
type Root struct {
	path string
	// mountAt is the one path Prepare may mount cgroup2 at: the default.
	// Any other directory is the operator's to provide.
	mountAt string
	mu      *sync.Mutex
	// onAttach are the functions Attached runs, shared by the copies.
	onAttach *attachHooks
	// anyDir takes any directory for a cgroup v2 one (AnyDir).
	anyDir bool
}

// attachHooks are the functions that run when a feature has attached
// programs to the root.
type attachHooks struct {
	mu  sync.Mutex
	fns []func()
}

// AnyDir, provided by a test's hive, lets --cgroup-root be any existing
// directory: a test without root stands for the kubelet's pod cgroups
// with plain directories, whose inode numbers are their IDs as a
// cgroup's are. Nothing can attach to such a root (a hive on maps in
// memory attaches nothing). The agent never provides it.
type AnyDir struct{}

type rootParams struct {
	cell.In

	Config Config
	AnyDir *AnyDir `optional:"true"`
}

func newRoot(p rootParams) (Root, error) {
	r, err := NewRoot(p.Config.CgroupRoot)
	r.anyDir = p.AnyDir != nil
	return r, err
}

// NewRoot checks dir (the value of --cgroup-root) and returns it as a Root.
// Nothing is mounted yet (see Prepare and Check). A dir that is a hybrid
// host's cgroup mount point (a tmpfs of v1 hierarchies, such as the host's
// /sys/fs/cgroup mounted at the default root by the agent's DaemonSet)
// stands for the cgroup v2 hierarchy mounted in it, at HybridSubdir.
func NewRoot(dir string) (Root, error) {
	if strings.TrimSpace(dir) == "" {
		return Root{}, fmt.Errorf("--%s is empty", RootFlag)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return Root{}, fmt.Errorf("--%s %s: %w", RootFlag, dir, err)
	}
	if ok, _ := isCgroup2(abs); !ok {
		if ok, _ := isCgroup2(filepath.Join(abs, HybridSubdir)); ok {
			abs = filepath.Join(abs, HybridSubdir)
		}
	}
	return Root{path: abs, mountAt: DefaultRoot, mu: &sync.Mutex{}, onAttach: &attachHooks{}}, nil
}

// HybridSubdir is where systemd and most distributions mount cgroup v2 in
// the cgroup mount point of a host in hybrid mode (v1 controllers).
const HybridSubdir = "unified"

// OnAttach registers fn to run each time a feature reports, with Attached,
// that it attached programs to the root: the features whose programs must
// run in a given order relative to others' (policy after the socket load
// balancer) put themselves back in place at once, not at their next check.
func (r Root) OnAttach(fn func()) {
	if r.onAttach == nil {
		return
	}
	r.onAttach.mu.Lock()
	defer r.onAttach.mu.Unlock()
	r.onAttach.fns = append(r.onAttach.fns, fn)
}

// Attached reports that the caller has attached programs to the root; the
// functions registered with OnAttach have run when it returns.
func (r Root) Attached() {
	if r.onAttach == nil {
		return
	}
	r.onAttach.mu.Lock()
	fns := append([]func(){}, r.onAttach.fns...)
	r.onAttach.mu.Unlock()
	for _, fn := range fns {
		fn()
	}
}

// Path returns the absolute path of the root, whether or not it is usable
// yet.
func (r Root) Path() string { return r.path }

// Check reports, without changing anything, why the root is not a cgroup
// v2 directory now (nil when it is).
func (r Root) Check() error {
	if r.path == "" {
		return errUnset
	}
	ok, err := r.isCgroup2(r.path)
	switch {
	case ok:
		return nil
	case r.path == r.mountAt && (err == nil || errors.Is(err, fs.ErrNotExist)):
		return fmt.Errorf("--%s %s is not mounted yet (the features that attach to it mount it)", RootFlag, r.path)
	case err != nil:
		return fmt.Errorf("--%s %s: %w", RootFlag, r.path, err)
	default:
		return fmt.Errorf("--%s %s is not a cgroup v2 directory", RootFlag, r.path)
	}
}

// Prepare makes the root usable and returns its path: the default
// directory is mounted (cgroup2) when it is not a cgroup v2 directory yet;
// any other directory must already be one. It is safe to call from several
// features at once, and cheap (one statfs) once the root is ready. A
// failure is worth retrying: a missing privilege or mount may be fixed.
func (r Root) Prepare() (string, error) {
	if r.mu == nil {
		return "", errUnset
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	ok, err := r.isCgroup2(r.path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("--%s %s: %w", RootFlag, r.path, err)
	}
	if ok {
		return r.path, nil
	}
	if r.path != r.mountAt {
		return "", fmt.Errorf("--%s %s is not a cgroup v2 directory", RootFlag, r.path)
	}
	if err := os.MkdirAll(r.path, 0o755); err != nil {
		return "", fmt.Errorf("--%s %s: %w", RootFlag, r.path, err)
	}
	if err := unix.Mount("none", r.path, "cgroup2", 0, ""); err != nil {
		return "", fmt.Errorf("--%s: mount cgroup2 at %s: %w (the agent must run as root)", RootFlag, r.path, err)
	}
	return r.path, nil
}

// errUnset is what a zero Root, not made by NewRoot, says.
var errUnset = fmt.Errorf("--%s: no cgroup root configured", RootFlag)

// isCgroup2 tells whether dir is a cgroup v2 directory (with anyDir,
// any directory).
func (r Root) isCgroup2(dir string) (bool, error) {
	if r.anyDir {
		fi, err := os.Stat(dir)
		if err != nil {
			return false, err
		}
		return fi.IsDir(), nil
	}
	return isCgroup2(dir)
}

func isCgroup2(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, &fs.PathError{Op: "statfs", Path: dir, Err: err}
	}
	return st.Type == unix.CGROUP2_SUPER_MAGIC, nil
}

// ID returns the ID of the cgroup v2 directory dir: its inode number, which
// is what the kernel reports as the cgroup ID (of a cgroup link, or to a
// program through bpf_get_current_cgroup_id). A missing directory gives an
// error that matches fs.ErrNotExist.
func ID(dir string) (uint64, error) {
	fi, err := os.Stat(dir)
	if err != nil {
		return 0, fmt.Errorf("cgroup id: %w", err)
	}
	if !fi.IsDir() {
		return 0, fmt.Errorf("cgroup id: %s is not a directory", dir)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, fmt.Errorf("cgroup id: stat %s: no inode", dir)
	}
	return st.Ino, nil
}
