// Package tcxlink attaches programs to network interfaces with tcx links
// that it pins, so that they stay attached while the agent is away and a
// new agent puts its programs in place without a moment unattached.
package tcxlink

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Outcome says what Attach did.
type Outcome string

const (
	// Attached: a new link (nothing of ours was there).
	Attached Outcome = "attached"
	// Updated: the pinned link of the same interface and hook got the
	// program in place.
	Updated Outcome = "updated"
)

// Attach returns a link of prog on hook attach (ebpf.AttachTCXIngress or
// ebpf.AttachTCXEgress) of interface ifindex, pinned as pin. A pinned link
// of the same interface and hook gets prog in place; a pin of anything
// else (another interface, or one that has gone with its interface) is
// replaced.
func Attach(pin string, ifindex int, attach ebpf.AttachType, prog *ebpf.Program) (link.Link, Outcome, error) {
	if prog == nil {
		return nil, "", fmt.Errorf("no program for %s", pin)
	}
	old, err := link.LoadPinnedLink(pin, nil)
	switch {
	case err == nil:
		if same(old, ifindex, attach) {
			if err := old.Update(prog); err != nil {
				old.Close()
				return nil, "", fmt.Errorf("update pinned link %s: %w", pin, err)
			}
			return old, Updated, nil
		}
		if err := errors.Join(old.Unpin(), old.Close()); err != nil {
			return nil, "", fmt.Errorf("remove pinned link %s: %w", pin, err)
		}
	case errors.Is(err, fs.ErrNotExist):
	default:
		if err := os.Remove(pin); err != nil {
			return nil, "", fmt.Errorf("remove unusable pin %s: %w", pin, err)
		}
	}
	l, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: attach, Anchor: link.Head()})
	if err != nil {
		return nil, "", fmt.Errorf("attach to interface %d: %w", ifindex, err)
	}
	if err := l.Pin(pin); err != nil {
		l.Close()
		return nil, "", fmt.Errorf("pin link %s: %w", pin, err)
	}
	return l, Attached, nil
}

// same tells whether l is a live tcx link of hook attach on ifindex (the
// link of a deleted interface reports interface 0).
func same(l link.Link, ifindex int, attach ebpf.AttachType) bool {
	info, err := l.Info()
	if err != nil {
		return false
	}
	tcx := info.TCX()
	return tcx != nil && int(tcx.Ifindex) == ifindex && ebpf.AttachType(tcx.AttachType) == attach
}

// Live tells whether the link pinned at pin is still attached to an
// interface: false once its interface is gone, or when there is none.
func Live(pin string) bool {
	l, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		return false
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return false
	}
	tcx := info.TCX()
	return tcx != nil && tcx.Ifindex != 0
}
