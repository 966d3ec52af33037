// Package podnet finds the host side of a pod's network interface: a veth
// of the host whose peer is in a network namespace of the pod's processes.
// It works with any veth-based CNI plugin (ptp, bridge, ...) without
// reading its configuration, and trusts only what the pod cannot change:
// the host's own interfaces, the namespace the host says each veth's peer
// is in, and the host's route to the pod's address. Nothing the pod's
// namespace reports (its interfaces, their peer indexes) decides which
// host interface is the pod's.
package podnet

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
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
	// ErrNoVeth: no veth of the host has its peer in a network namespace
	// of the pod's processes (a namespace the pod made itself, with
	// unshare -n, never has one).
	ErrNoVeth = errors.New("no veth of the host has its peer in the pod's network namespaces")
)

// HostVeth is the host side of a pod's veth.
type HostVeth struct {
	// Name and Ifindex are the host-side interface's.
	Name    string
	Ifindex int
	// Netns is the inode of the pod's network namespace its peer is in.
	Netns uint64
	// PeerIfindex is the peer's index in that namespace, as the host
	// says (the host side's IFLA_LINK): the device the pod's packets
	// leave by when they go through this veth.
	PeerIfindex int
	// CarriesAddr: the host routes one of the pod's addresses through
	// this interface (or through the bridge it is a port of).
	CarriesAddr bool
	// eth0: the peer is named eth0 in the pod's namespace; only a
	// tie-break among the pod's own veths, as the pod can rename it.
	eth0 bool
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

// podNetns is a distinct network namespace of a pod's processes.
type podNetns struct {
	ino uint64
	f   *os.File
}

// Find returns the host sides of the veths of the pod whose cgroup (v2) is
// cgroupDir, best first: the veths of the host whose peer the host says is
// in a network namespace of one of the pod's processes (any of them, up to
// maxProcesses, not only the first: a container of the pod may have made
// a namespace of its own); those through which the host routes one of
// addrs (the pod's addresses) first, then the one whose peer is eth0, then
// by index.
func (f *Finder) Find(cgroupDir string, addrs []netip.Addr) ([]HostVeth, error) {
	pids, err := processes(cgroupDir, maxProcesses)
	if err != nil {
		return nil, err
	}
	nss := f.namespaces(pids)
	defer func() {
		for _, ns := range nss {
			ns.f.Close()
		}
	}()
	if len(nss) == 0 {
		return nil, ErrHostNetwork
	}
	// Listed before the namespaces' IDs are asked for: listing a veth
	// gives its peer's namespace an ID in the host's if it had none.
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list the host's interfaces: %w", err)
	}
	var found []HostVeth
	for _, ns := range nss {
		vs, err := vethsInto(links, ns)
		if err != nil {
			return nil, err
		}
		found = append(found, vs...)
	}
	if len(found) == 0 {
		return nil, fmt.Errorf("%w (%d looked at)", ErrNoVeth, len(nss))
	}
	markCarriers(found, links, addrs)
	slices.SortFunc(found, func(a, b HostVeth) int {
		if a.CarriesAddr != b.CarriesAddr {
			return boolFirst(a.CarriesAddr)
		}
		if a.eth0 != b.eth0 {
			return boolFirst(a.eth0)
		}
		return cmp.Compare(a.Ifindex, b.Ifindex)
	})
	return found, nil
}

func boolFirst(a bool) int {
	if a {
		return -1
	}
	return 1
}

// namespaces opens the distinct network namespaces of pids other than the
// host's, at most maxNamespaces.
func (f *Finder) namespaces(pids []int) []podNetns {
	var nss []podNetns
	seen := map[uint64]bool{f.hostNetns: true}
	for _, pid := range pids {
		path := "/proc/" + strconv.Itoa(pid) + "/ns/net"
		ino, err := nsInode(path)
		if err != nil || seen[ino] {
			continue // exited, or a namespace already open
		}
		file, err := os.Open(path)
		if err != nil {
			continue
		}
		// The pid may have been reused between the stat and the open:
		// the namespace opened is the one looked at.
		var st syscall.Stat_t
		if err := syscall.Fstat(int(file.Fd()), &st); err != nil || st.Ino != ino {
			file.Close()
			continue
		}
		seen[ino] = true
		nss = append(nss, podNetns{ino: ino, f: file})
		if len(nss) == maxNamespaces {
			break
		}
	}
	return nss
}

// vethsInto returns the veths among the host's links whose peer is in ns,
// as the host says (the link's IFLA_LINK_NETNSID against the ID the host
// gives ns), never as ns says.
func vethsInto(links []netlink.Link, ns podNetns) ([]HostVeth, error) {
	nsid, err := netlink.GetNetNsIdByFd(int(ns.f.Fd()))
	if err != nil {
		return nil, fmt.Errorf("the host's ID of network namespace %d: %w", ns.ino, err)
	}
	if nsid < 0 {
		return nil, nil // no interface of the host has its peer there
	}
	var out []HostVeth
	for _, l := range links {
		a := l.Attrs()
		if l.Type() != "veth" || a.NetNsID != nsid {
			continue
		}
		out = append(out, HostVeth{Name: a.Name, Ifindex: a.Index, Netns: ns.ino, PeerIfindex: a.ParentIndex})
	}
	if len(out) > 1 {
		markEth0(out, links, ns)
	}
	return out, nil
}

// markEth0 marks the veth whose peer is eth0 in ns: the tie-break among
// several veths into one namespace when none carries the pod's address.
func markEth0(vs []HostVeth, links []netlink.Link, ns podNetns) {
	h, err := netlink.NewHandleAt(netns.NsHandle(int(ns.f.Fd())))
	if err != nil {
		return
	}
	defer h.Close()
	peers := map[int]int{} // host ifindex -> peer ifindex
	for _, l := range links {
		peers[l.Attrs().Index] = l.Attrs().ParentIndex
	}
	for i := range vs {
		if p, err := h.LinkByIndex(peers[vs[i].Ifindex]); err == nil && p.Attrs().Name == "eth0" {
			vs[i].eth0 = true
		}
	}
}

// markCarriers marks the veths through which the host routes one of
// addrs: the route's interface, or a port of the bridge it is.
func markCarriers(vs []HostVeth, links []netlink.Link, addrs []netip.Addr) {
	master := map[int]int{}
	bridge := map[int]bool{}
	for _, l := range links {
		master[l.Attrs().Index] = l.Attrs().MasterIndex
		bridge[l.Attrs().Index] = l.Type() == "bridge"
	}
	for _, addr := range addrs {
		routes, err := netlink.RouteGet(addr.AsSlice())
		if err != nil || len(routes) == 0 {
			continue
		}
		via := routes[0].LinkIndex
		for i := range vs {
			if vs[i].Ifindex == via || (bridge[via] && master[vs[i].Ifindex] == via) {
				vs[i].CarriesAddr = true
			}
		}
	}
}

// maxProcesses is how many of a pod's processes Find looks at, and
// maxNamespaces how many distinct network namespaces among them: bounds
// on the work one pod can cause, far above what a pod's containers make
// (the sandbox's namespace, shared by every container).
const (
	maxProcesses  = 4096
	maxNamespaces = 64
)

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
