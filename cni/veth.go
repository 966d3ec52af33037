package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// errNotVerified: a host interface of prevResult that is not the host side
// of a veth whose peer is the pod's interface.
var errNotVerified = errors.New("not the host side of a veth to the pod's interface")

// podNetns is the pod's network namespace, opened.
type podNetns struct {
	ns     netns.NsHandle
	handle *netlink.Handle
	// id is the namespace's id as the host's namespace knows it (-1 if
	// it has none).
	id int
}

func openNetns(path string) (*podNetns, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("open the pod's network namespace %s: %w", path, err)
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		ns.Close()
		return nil, fmt.Errorf("netlink in %s: %w", path, err)
	}
	return &podNetns{ns: ns, handle: h, id: -1}, nil
}

func (p *podNetns) close() {
	p.handle.Close()
	p.ns.Close()
}

// hostVeth returns the one interface among names (prevResult's interfaces
// outside any sandbox) that the kernel says is the host side of a veth
// whose peer is ifName in the pod's namespace: a bridge, or a name that
// is something else now, is passed over. None, or more than one, is an
// error.
func hostVeth(names []string, pod *podNetns, ifName string) (netlink.Link, error) {
	var found []netlink.Link
	var why []string
	for _, name := range names {
		l, err := netlink.LinkByName(name)
		if err != nil {
			why = append(why, fmt.Sprintf("%s: %v", name, err))
			continue
		}
		if err := pod.isPeer(l, ifName); err != nil {
			why = append(why, fmt.Sprintf("%s: %v", name, err))
			continue
		}
		found = append(found, l)
	}
	switch len(found) {
	case 1:
		return found[0], nil
	case 0:
		return nil, fmt.Errorf("no interface of prevResult %v is the host side of a veth to %s in the pod's namespace (%s)",
			names, ifName, strings.Join(why, "; "))
	}
	return nil, fmt.Errorf("several interfaces of prevResult %v are veths to the pod's %s", names, ifName)
}

// isPeer checks that host is a veth of the host's namespace whose peer is
// the pod's interface ifName: its peer's namespace is the pod's (by the
// namespace id the host gives it) and the interface at the peer index
// there is ifName, a veth whose peer index is host's.
func (p *podNetns) isPeer(host netlink.Link, ifName string) error {
	a := host.Attrs()
	if host.Type() != "veth" {
		return fmt.Errorf("%w: a %s", errNotVerified, host.Type())
	}
	if p.id < 0 {
		// Listing the veth gave the peer's namespace an id, if the
		// pod's namespace is the peer's.
		id, err := netlink.GetNetNsIdByFd(int(p.ns))
		if err != nil {
			return fmt.Errorf("the pod's namespace id: %w", err)
		}
		p.id = id
	}
	if p.id < 0 || a.NetNsID != p.id {
		return fmt.Errorf("%w: its peer is in namespace id %d, the pod's is %d", errNotVerified, a.NetNsID, p.id)
	}
	peer, err := p.handle.LinkByIndex(a.ParentIndex)
	if err != nil {
		return fmt.Errorf("%w: no interface %d in the pod's namespace: %v", errNotVerified, a.ParentIndex, err)
	}
	pa := peer.Attrs()
	if peer.Type() != "veth" || pa.Name != ifName || pa.ParentIndex != a.Index {
		return fmt.Errorf("%w: the pod's interface %d is %s (%s), peer %d", errNotVerified, a.ParentIndex, pa.Name, peer.Type(), pa.ParentIndex)
	}
	return nil
}
