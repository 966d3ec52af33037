// Package iflink attaches programs to a network interface's ingress or
// egress: with tcx links that it pins (kernel 6.6 and later), so that they
// stay attached while the agent is away and a new agent puts its programs
// in place without a moment unattached; or, where tcx is missing (or asked
// for), with a tc filter on the interface's clsact qdisc, which the kernel
// keeps without a pin and a new agent replaces in place.
package iflink

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Mode is how programs are attached.
type Mode string

const (
	// ModeAuto uses tcx, and tc where the kernel has no tcx.
	ModeAuto Mode = "auto"
	// ModeTCX uses tcx only.
	ModeTCX Mode = "tcx"
	// ModeTC uses tc filters only.
	ModeTC Mode = "tc"
)

// ParseMode checks a mode's name.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModeAuto, ModeTCX, ModeTC:
		return m, nil
	}
	return "", fmt.Errorf("%q: want auto, tcx or tc", s)
}

// Outcome says what Attach did.
type Outcome string

const (
	// Attached: the program is on the interface now and was not before
	// (a new interface, or one whose earlier attachment had gone).
	Attached Outcome = "attached"
	// Updated: an attachment of ours on the same interface and hook got
	// the program in place.
	Updated Outcome = "updated"
)

// Hook is an interface's ingress or egress.
type Hook struct {
	// Ifindex is the interface's index.
	Ifindex int
	// Egress is the egress hook; else ingress.
	Egress bool
}

func (h Hook) tcxAttach() ebpf.AttachType {
	if h.Egress {
		return ebpf.AttachTCXEgress
	}
	return ebpf.AttachTCXIngress
}

func (h Hook) tcParent() uint32 {
	if h.Egress {
		return netlink.HANDLE_MIN_EGRESS
	}
	return netlink.HANDLE_MIN_INGRESS
}

// tcPriority and tcHandle name the tc filter of ours on a hook: one per
// hook, run before filters of a lower priority (a higher number).
const (
	tcPriority = 1
	tcHandle   = 0xa91a
	tcName     = "apiary"
)

// Attach puts prog on hook h. With tcx, the link is pinned as pin: a
// pinned link of the same interface and hook gets prog in place, a pin of
// anything else (another interface, or one gone with its interface) is
// replaced. With tc, the filter of ours on the hook is replaced.
func Attach(pin string, h Hook, prog *ebpf.Program, mode Mode) (Outcome, error) {
	if prog == nil {
		return "", fmt.Errorf("no program for %s", pin)
	}
	if mode != ModeTC {
		out, err := attachTCX(pin, h, prog)
		if err == nil {
			// A filter of an earlier run without tcx would judge
			// every packet twice.
			_ = detachTC(h)
			return out, nil
		}
		if mode == ModeTCX || !errors.Is(err, ebpf.ErrNotSupported) {
			return "", err
		}
	}
	return attachTC(h, prog)
}

func attachTCX(pin string, h Hook, prog *ebpf.Program) (Outcome, error) {
	old, err := link.LoadPinnedLink(pin, nil)
	switch {
	case err == nil:
		defer old.Close()
		if live(old, h) {
			if err := old.Update(prog); err != nil {
				return "", fmt.Errorf("update pinned link %s: %w", pin, err)
			}
			return Updated, nil
		}
		if err := old.Unpin(); err != nil {
			return "", fmt.Errorf("remove pinned link %s: %w", pin, err)
		}
	case errors.Is(err, fs.ErrNotExist):
	default:
		if err := os.Remove(pin); err != nil {
			return "", fmt.Errorf("remove unusable pin %s: %w", pin, err)
		}
	}
	l, err := link.AttachTCX(link.TCXOptions{Interface: h.Ifindex, Program: prog, Attach: h.tcxAttach(), Anchor: link.Head()})
	if err != nil {
		return "", fmt.Errorf("attach to interface %d: %w", h.Ifindex, err)
	}
	defer l.Close()
	if err := l.Pin(pin); err != nil {
		return "", fmt.Errorf("pin link %s: %w", pin, err)
	}
	return Attached, nil
}

// live tells whether l is a tcx link on h (the link of a deleted
// interface reports interface 0).
func live(l link.Link, h Hook) bool {
	info, err := l.Info()
	if err != nil {
		return false
	}
	tcx := info.TCX()
	return tcx != nil && int(tcx.Ifindex) == h.Ifindex && ebpf.AttachType(tcx.AttachType) == h.tcxAttach()
}

func tcFilter(h Hook) *netlink.BpfFilter {
	return &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: h.Ifindex,
			Parent:    h.tcParent(),
			Handle:    tcHandle,
			Priority:  tcPriority,
			Protocol:  unix.ETH_P_ALL,
		},
		Name:         tcName,
		DirectAction: true,
	}
}

func attachTC(h Hook, prog *ebpf.Program) (Outcome, error) {
	qdisc := &netlink.GenericQdisc{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: h.Ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
		QdiscType:  "clsact",
	}
	if err := netlink.QdiscAdd(qdisc); err != nil && !errors.Is(err, unix.EEXIST) {
		return "", fmt.Errorf("add clsact to interface %d: %w", h.Ifindex, err)
	}
	out := Attached
	if hasTC(h) {
		out = Updated
	}
	f := tcFilter(h)
	f.Fd = prog.FD()
	if err := netlink.FilterReplace(f); err != nil {
		return "", fmt.Errorf("tc filter on interface %d: %w", h.Ifindex, err)
	}
	return out, nil
}

func hasTC(h Hook) bool {
	filters, err := netlink.FilterList(&netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Index: h.Ifindex}}, h.tcParent())
	if err != nil {
		return false
	}
	for _, f := range filters {
		if a := f.Attrs(); a.Handle == tcHandle && a.Priority == tcPriority {
			return true
		}
	}
	return false
}

func detachTC(h Hook) error {
	if !hasTC(h) {
		return nil
	}
	if err := netlink.FilterDel(tcFilter(h)); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("delete the tc filter of interface %d: %w", h.Ifindex, err)
	}
	return nil
}

// Detach removes the program of hook h: the link pinned at pin, and a tc
// filter of ours. Nothing there is not an error.
func Detach(pin string, h Hook) error {
	var errs []error
	l, err := link.LoadPinnedLink(pin, nil)
	switch {
	case err == nil:
		// Unpinned and closed, the link has no reference left and the
		// kernel detaches it.
		errs = append(errs, l.Unpin(), l.Close())
	case errors.Is(err, fs.ErrNotExist):
	default:
		errs = append(errs, os.Remove(pin))
	}
	errs = append(errs, detachTC(h))
	return errors.Join(errs...)
}

// Live tells whether a program of ours is on hook h: a live link pinned at
// pin, or a tc filter.
func Live(pin string, h Hook) bool {
	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		defer l.Close()
		if live(l, h) {
			return true
		}
	}
	return hasTC(h)
}

// DetachAllTC removes the tc filters of ours whose program ours accepts
// from both hooks of every interface of the current network namespace:
// what tc mode attached, which no pin holds (uninstall, `apiary
// cleanup`). Other agents' filters, whose programs use other maps, are
// told apart by ours. It returns the hooks it cleared.
func DetachAllTC(ours func(*ebpf.Program) bool) ([]Hook, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list interfaces: %w", err)
	}
	var gone []Hook
	var errs []error
	for _, l := range links {
		for _, egress := range []bool{false, true} {
			h := Hook{Ifindex: l.Attrs().Index, Egress: egress}
			filters, err := netlink.FilterList(l, h.tcParent())
			if err != nil {
				continue
			}
			for _, f := range filters {
				bf, ok := f.(*netlink.BpfFilter)
				if !ok || bf.Handle != tcHandle || bf.Priority != tcPriority {
					continue
				}
				prog, err := ebpf.NewProgramFromID(ebpf.ProgramID(bf.Id))
				if err != nil {
					continue
				}
				mine := ours(prog)
				prog.Close()
				if !mine {
					continue
				}
				if err := detachTC(h); err != nil {
					errs = append(errs, err)
					continue
				}
				gone = append(gone, h)
			}
		}
	}
	return gone, errors.Join(errs...)
}
