// Package cgrouplink keeps BPF programs attached to a cgroup through BPF
// links pinned on bpffs: the programs stay attached while the agent is down
// or restarting, and a new agent swaps its programs into the pinned links
// atomically, with no moment without a program.
package cgrouplink

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Hook is a program of an object and the cgroup hook it attaches to.
type Hook struct {
	// Name is the hook's name, also the name of the link's pin.
	Name string
	// Program is the program's name in the object.
	Program string
	// Attach is the cgroup attach type.
	Attach ebpf.AttachType
}

// DetachAll removes the pinned links of hooks in dir (see Detach) and
// returns the names of those that were there.
func DetachAll(dir string, hooks []Hook) ([]string, error) {
	var gone []string
	var errs []error
	for _, h := range hooks {
		ok, err := Detach(filepath.Join(dir, h.Name))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if ok {
			gone = append(gone, h.Name)
		}
	}
	return gone, errors.Join(errs...)
}

// Attach returns a link of prog on hook attach of the cgroup at path (whose
// ID is cgID), pinned as pin: a pinned link of the same cgroup and hook gets
// prog in place ("updated"); otherwise a new link is attached and pinned
// ("attached"), replacing a pin of another cgroup or hook.
func Attach(log *slog.Logger, pin string, attach ebpf.AttachType, prog *ebpf.Program, cgroup string, cgID uint64) (link.Link, string, error) {
	if prog == nil {
		return nil, "", fmt.Errorf("no program for %s", pin)
	}
	old, err := link.LoadPinnedLink(pin, nil)
	switch {
	case err == nil:
		if same, why := sameAttachment(old, attach, cgID); same {
			if err := old.Update(prog); err != nil {
				old.Close()
				return nil, "", fmt.Errorf("update pinned link %s: %w", pin, err)
			}
			return old, "updated", nil
		} else {
			// Attached elsewhere (another cgroup root): that one goes.
			log.Info("Replacing a pinned link", "path", pin, "reason", why)
			if err := errors.Join(old.Unpin(), old.Close()); err != nil {
				return nil, "", fmt.Errorf("remove pinned link %s: %w", pin, err)
			}
		}
	case errors.Is(err, fs.ErrNotExist):
	default:
		// Not a link, or unreadable: it cannot be ours to keep.
		log.Warn("Removing an unusable pin", "path", pin, "error", err)
		if err := os.Remove(pin); err != nil {
			return nil, "", fmt.Errorf("remove pin %s: %w", pin, err)
		}
	}
	l, err := attachPinned(pin, attach, prog, cgroup)
	if err != nil {
		return nil, "", err
	}
	return l, "attached", nil
}

func attachPinned(pin string, attach ebpf.AttachType, prog *ebpf.Program, cgroup string) (link.Link, error) {
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: attach, Program: prog})
	if err != nil {
		return nil, err
	}
	// Until pinned, the link dies with this process, so a crash here
	// leaves nothing attached behind.
	if err := l.Pin(pin); err != nil {
		l.Close()
		return nil, fmt.Errorf("pin link %s (the kernel must support BPF links): %w", pin, err)
	}
	return l, nil
}

// sameAttachment tells whether l is a cgroup link of hook attach on
// cgroup cgID.
func sameAttachment(l link.Link, attach ebpf.AttachType, cgID uint64) (bool, string) {
	info, err := l.Info()
	if err != nil {
		return false, err.Error()
	}
	cg := info.Cgroup()
	if cg == nil {
		return false, fmt.Sprintf("not a cgroup link (type %d)", info.Type)
	}
	if cg.CgroupId != cgID {
		return false, fmt.Sprintf("attached to cgroup id %d, not %d", cg.CgroupId, cgID)
	}
	if ebpf.AttachType(cg.AttachType) != attach {
		return false, fmt.Sprintf("attach type %d, not %d", cg.AttachType, attach)
	}
	return true, ""
}

// Detach removes the pinned link pin, which detaches its program; a
// missing pin is not an error. It reports whether there was one.
func Detach(pin string) (bool, error) {
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("load pinned link %s: %w", pin, err)
	}
	// Unpinned and closed, the link has no reference left and the kernel
	// detaches it.
	if err := errors.Join(l.Unpin(), l.Close()); err != nil {
		return false, fmt.Errorf("remove pinned link %s: %w", pin, err)
	}
	return true, nil
}

// RunsLast reports whether l's program runs after every other program of
// its hook on the cgroup at path: programs of one cgroup and hook run in
// the order they were attached.
func RunsLast(l link.Link, cgroup string, attach ebpf.AttachType) (bool, error) {
	info, err := l.Info()
	if err != nil {
		return false, fmt.Errorf("link info: %w", err)
	}
	dir, err := os.Open(cgroup)
	if err != nil {
		return false, err
	}
	defer dir.Close()
	res, err := link.QueryPrograms(link.QueryOptions{Target: int(dir.Fd()), Attach: attach})
	if err != nil {
		return false, fmt.Errorf("query programs of %s: %w", cgroup, err)
	}
	if len(res.Programs) == 0 {
		return false, nil
	}
	return res.Programs[len(res.Programs)-1].ID == info.Program, nil
}

// MoveLast attaches prog again on hook attach of cgroup, at the end of
// the hook's programs, and swaps the new link into pin: the old link
// stays attached until the new one runs, so the hook is never without the
// program. It returns the new link; the caller closes old.
func MoveLast(pin string, attach ebpf.AttachType, prog *ebpf.Program, cgroup string) (link.Link, error) {
	tmp := pin + "_new"
	_ = os.Remove(tmp)
	l, err := attachPinned(tmp, attach, prog, cgroup)
	if err != nil {
		return nil, err
	}
	old, err := link.LoadPinnedLink(pin, nil)
	if err == nil {
		defer old.Close()
	}
	// rename(2) over the old pin drops the pin's reference to the old
	// link; closing the last handle detaches it.
	if err := os.Rename(tmp, pin); err != nil {
		l.Close()
		_ = os.Remove(tmp)
		return nil, fmt.Errorf("swap pinned link %s: %w", pin, err)
	}
	// l still names its first pin path; nothing here unpins through it.
	return l, nil
}
