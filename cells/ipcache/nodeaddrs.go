package ipcache

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"

	"github.com/cilium/hive/cell"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/tables"
)

// nodeAddrs follows the addresses of the node's interfaces (--node-ips
// empty) and keeps those node.IsHostAddress takes labelled reserved:host:
// an address that appears after the agent started (a bridge's gateway, a
// new interface) is the host, not the world, and one that goes is no
// longer the host. An address held by several interfaces stays until the
// last one loses it.
type nodeAddrs struct {
	log      *slog.Logger
	prefixes *prefixes
	ipv6     bool
	// held are the interfaces (ifindex) that hold each address.
	held map[netip.Addr]map[int]struct{}
	// labelled are the addresses labelled reserved:host now.
	labelled map[netip.Addr]struct{}
	// started is closed once the start hook has labelled the addresses
	// found at start, so that the job's changes come after it.
	started chan struct{}
}

func newNodeAddrs(log *slog.Logger, p *prefixes, nc node.Config) *nodeAddrs {
	a := &nodeAddrs{log: log, prefixes: p, ipv6: nc.EnableIPv6,
		held: map[netip.Addr]map[int]struct{}{}, labelled: map[netip.Addr]struct{}{}, started: make(chan struct{})}
	for _, ip := range nc.NodeIPs {
		a.labelled[ip] = struct{}{}
	}
	return a
}

// wanted reports whether ip, held by an interface, is a node address.
func (a *nodeAddrs) wanted(ip netip.Addr) bool {
	return node.IsHostAddress(ip) && (ip.Is4() || a.ipv6)
}

// run subscribes to the kernel's address changes, then lists the
// addresses (so that nothing between the start and the subscription is
// missed), then applies each change. It returns when ctx ends or the
// subscription fails (the job runs it again).
func (a *nodeAddrs) run(ctx context.Context, health cell.Health) error {
	select {
	case <-a.started:
	case <-ctx.Done():
		return nil
	}
	updates := make(chan netlink.AddrUpdate, 256)
	failed := make(chan error, 1)
	// This attempt's subscription ends with it (a retry subscribes anew).
	done := make(chan struct{})
	defer close(done)
	err := netlink.AddrSubscribeWithOptions(updates, done, netlink.AddrSubscribeOptions{
		ErrorCallback:     func(err error) { trySend(failed, err) },
		ReceiveBufferSize: 1 << 20,
	})
	if err != nil {
		health.Degraded("Cannot follow the node's addresses", err)
		return fmt.Errorf("subscribe to address changes: %w", err)
	}
	if err := a.resync(); err != nil {
		health.Degraded("Cannot list the node's addresses", err)
		return err
	}
	health.OK(a.status())
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-failed:
			// A lost message (a full socket buffer) leaves the set
			// unknown: list again rather than guess.
			a.log.Warn("Address subscription failed; listing the node's addresses again", "error", err)
			if err := a.resync(); err != nil {
				health.Degraded("Cannot list the node's addresses", err)
				return err
			}
		case u, ok := <-updates:
			if !ok {
				return fmt.Errorf("the address subscription ended")
			}
			ip, ok := netip.AddrFromSlice(u.LinkAddress.IP)
			if !ok {
				continue
			}
			if err := a.apply(ip.Unmap(), u.LinkIndex, u.NewAddr); err != nil {
				health.Degraded("Cannot label a node address", err)
				return err
			}
		}
		health.OK(a.status())
	}
}

func trySend(ch chan error, err error) {
	select {
	case ch <- err:
	default:
	}
}

func (a *nodeAddrs) status() string {
	return fmt.Sprintf("Following the node's addresses: %d labelled reserved:host", len(a.labelled))
}

// resync lists every address of every interface and makes the labelled
// set match.
func (a *nodeAddrs) resync() error {
	addrs, err := netlink.AddrList(nil, unix.AF_UNSPEC)
	if err != nil {
		return fmt.Errorf("list the node's addresses: %w", err)
	}
	clear(a.held)
	for _, ad := range addrs {
		if ip, ok := netip.AddrFromSlice(ad.IP); ok {
			a.hold(ip.Unmap(), ad.LinkIndex, true)
		}
	}
	var changes []Change
	for ip := range a.held {
		if _, ok := a.labelled[ip]; !ok && a.wanted(ip) {
			changes = append(changes, a.label(ip))
		}
	}
	for ip := range a.labelled {
		if _, ok := a.held[ip]; !ok {
			changes = append(changes, a.unlabel(ip))
		}
	}
	return a.update(changes)
}

// apply is one address change: ip added to or removed from interface
// ifindex.
func (a *nodeAddrs) apply(ip netip.Addr, ifindex int, added bool) error {
	a.hold(ip, ifindex, added)
	_, isHeld := a.held[ip]
	_, isLabelled := a.labelled[ip]
	switch {
	case isHeld && !isLabelled && a.wanted(ip):
		return a.update([]Change{a.label(ip)})
	case !isHeld && isLabelled:
		return a.update([]Change{a.unlabel(ip)})
	}
	return nil
}

func (a *nodeAddrs) hold(ip netip.Addr, ifindex int, added bool) {
	links := a.held[ip]
	if added {
		if links == nil {
			links = map[int]struct{}{}
			a.held[ip] = links
		}
		links[ifindex] = struct{}{}
		return
	}
	delete(links, ifindex)
	if len(links) == 0 {
		delete(a.held, ip)
	}
}

func (a *nodeAddrs) label(ip netip.Addr) Change {
	a.log.Info("Node address labelled reserved:host", "address", ip)
	a.labelled[ip] = struct{}{}
	return Upsert(tables.HostPrefix(ip), OwnerNode, tables.LabelHost)
}

func (a *nodeAddrs) unlabel(ip netip.Addr) Change {
	a.log.Info("Node address gone: no longer reserved:host", "address", ip)
	delete(a.labelled, ip)
	return Delete(tables.HostPrefix(ip), OwnerNode)
}

func (a *nodeAddrs) update(changes []Change) error {
	if len(changes) == 0 {
		return nil
	}
	if _, err := a.prefixes.Update(changes...); err != nil {
		return fmt.Errorf("label the node's addresses: %w", err)
	}
	return nil
}
