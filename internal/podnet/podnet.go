// Package podnet finds the host side of a pod's network interface: the
// veth whose peer is in the network namespace of the pod's processes. It
// works with any veth-based CNI plugin (ptp, bridge, ...) without reading
// its configuration: the kernel knows each veth's peer.
package podnet

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Errors of Find that say the pod has no interface of its own (yet).
var (
	// ErrNoProcess: no process runs in the pod's cgroup yet, so its
	// network namespace cannot be reached.
	ErrNoProcess = errors.New("no process in the pod's cgroup yet")
	// ErrHostNetwork: the pod's processes are in the host's network
	// namespace.
	ErrHostNetwork = errors.New("the pod is in the host's network namespace")
	// ErrNoVeth: the pod's network namespace has no veth whose peer is in
	// the host's.
	ErrNoVeth = errors.New("no veth to the host in the pod's network namespace")
)

// HostVeth is the host side of a pod's veth.
type HostVeth struct {
	// Name and Ifindex are the host-side interface's.
	Name    string
	Ifindex int
	// Netns is the inode of the pod's network namespace.
	Netns uint64
}

// Finder finds pods' interfaces from the host's network namespace, the
// one it was made in.
type Finder struct {
	hostNetns uint64
}

// NewFinder returns a Finder for the network namespace of the calling
// process (which must be the host's).
func NewFinder() (*Finder, error) {
	ino, err := nsInode("/proc/self/ns/net")
	if err != nil {
		return nil, err
	}
	return &Finder{hostNetns: ino}, nil
}

// Find returns the host side of the veth of the pod whose cgroup (v2) is
// cgroupDir: it enters the network namespace of a process in the cgroup or
// below, and takes the veth there whose peer is in the host's namespace,
// eth0 first.
func (f *Finder) Find(cgroupDir string) (HostVeth, error) {
	pids, err := processes(cgroupDir, maxProcesses)
	if err != nil {
		return HostVeth{}, err
	}
	// A process that entered the pod's cgroup from the host is still in
	// the host's namespace: the pod's is any other.
	var nsPath string
	var ino uint64
	for _, pid := range pids {
		path := "/proc/" + strconv.Itoa(pid) + "/ns/net"
		i, err := nsInode(path)
		if err != nil {
			continue // exited
		}
		if i != f.hostNetns {
			nsPath, ino = path, i
			break
		}
	}
	if nsPath == "" {
		return HostVeth{}, ErrHostNetwork
	}
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return HostVeth{}, fmt.Errorf("open %s: %w", nsPath, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return HostVeth{}, fmt.Errorf("netlink in %s: %w", nsPath, err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return HostVeth{}, fmt.Errorf("list the interfaces of %s: %w", nsPath, err)
	}
	var found *HostVeth
	for _, l := range links {
		if l.Type() != "veth" {
			continue
		}
		attrs := l.Attrs()
		peer, err := netlink.LinkByIndex(attrs.ParentIndex)
		if err != nil || peer.Type() != "veth" || peer.Attrs().ParentIndex != attrs.Index {
			// The peer is in another namespace than the host's, or
			// the index names another interface here.
			continue
		}
		v := HostVeth{Name: peer.Attrs().Name, Ifindex: peer.Attrs().Index, Netns: ino}
		if attrs.Name == "eth0" {
			return v, nil
		}
		if found == nil {
			found = &v
		}
	}
	if found == nil {
		return HostVeth{}, ErrNoVeth
	}
	return *found, nil
}

// maxProcesses is how many of a pod's processes Find looks at.
const maxProcesses = 64

// processes returns up to limit processes of the cgroup dir and of the
// cgroups below it: a pod's processes are in its containers' cgroups.
func processes(dir string, limit int) ([]int, error) {
	var pids []int
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if path == dir {
				return err
			}
			return nil // a container's cgroup that just went
		}
		if !d.IsDir() {
			return nil
		}
		pids = append(pids, readPids(filepath.Join(path, "cgroup.procs"), limit-len(pids))...)
		if len(pids) >= limit {
			return fs.SkipAll
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the processes of %s: %w", dir, err)
	}
	if len(pids) == 0 {
		return nil, ErrNoProcess
	}
	return pids, nil
}

func readPids(path string, limit int) []int {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var pids []int
	sc := bufio.NewScanner(f)
	for sc.Scan() && len(pids) < limit {
		if p, err := strconv.Atoi(sc.Text()); err == nil && p > 0 {
			pids = append(pids, p)
		}
	}
	return pids
}

func nsInode(path string) (uint64, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("stat %s: %w", path, err)
	}
	return st.Ino, nil
}
