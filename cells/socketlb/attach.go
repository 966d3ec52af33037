package socketlb

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/hive/cell"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/socklb"
	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/lb"
)

// LinksDir is the subdirectory of --bpf-pin-dir holding the pinned links,
// one per hook, named after it (connect4, sendmsg4, ...).
const LinksDir = "links"

// SockRevNatMaxEntries sizes lb4_sock_revnat, an LRU: the oldest sockets'
// entries go first when it is full.
const SockRevNatMaxEntries = 65536

type attacher struct {
	log    *slog.Logger
	cfg    Config
	root   cgroups.Root
	pinDir string
	lbMaps lb.Maps
	retry  time.Duration

	mu     sync.Mutex
	links  []link.Link
	revNat *ebpf.Map
}

func (a *attacher) linksDir() string { return filepath.Join(a.pinDir, LinksDir) }

// run attaches (or detaches), retrying until it succeeds, and then keeps
// its health scope open with what is attached where.
func (a *attacher) run(ctx context.Context, health cell.Health) error {
	for {
		var msg string
		var err error
		if a.cfg.EnableSocketLB {
			msg, err = a.attach()
		} else {
			msg, err = a.detach()
		}
		if err == nil {
			a.log.Info(msg)
			health.OK(msg)
			break
		}
		a.log.Error("Socket load balancing", "error", err)
		health.Degraded("Socket load balancing failed; retrying", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(a.retry):
		}
	}
	<-ctx.Done()
	return nil
}

// attach loads the programs on the agent's maps and puts them into the
// pinned links: a link that exists for the same cgroup and hook gets the new
// program atomically (no moment without a program); otherwise a new link
// is attached and pinned.
func (a *attacher) attach() (string, error) {
	a.close()
	cgroup, err := a.root.Prepare()
	if err != nil {
		return "", err
	}
	cgID, err := cgroups.ID(cgroup)
	if err != nil {
		return "", err
	}

	spec, err := socklb.SockRevNatSpec(SockRevNatMaxEntries)
	if err != nil {
		return "", err
	}
	revNat, err := bpf.OpenPinnedMap(a.log, spec, a.pinDir, nil)
	if err != nil {
		return "", err
	}

	var progs map[string]*ebpf.Program
	err = a.lbMaps.Maps(func(services, backends, rn *ebpf.Map) error {
		progs, err = socklb.Load(socklb.Maps{Services: services, Backends: backends, RevNat: rn, SockRevNat: revNat.Map})
		return err
	})
	if err != nil {
		revNat.Close()
		return "", err
	}
	// The links hold the programs (and the programs the maps).
	defer func() {
		for _, p := range progs {
			p.Close()
		}
	}()

	if err := os.MkdirAll(a.linksDir(), 0o750); err != nil {
		revNat.Close()
		return "", fmt.Errorf("links directory: %w", err)
	}
	var links []link.Link
	var done []string
	for _, h := range socklb.Hooks {
		l, how, err := a.attachHook(h, progs[h.Program], cgroup, cgID)
		if err != nil {
			for _, l := range links {
				l.Close()
			}
			revNat.Close()
			return "", fmt.Errorf("attach %s to %s: %w", h.Name, cgroup, err)
		}
		links = append(links, l)
		done = append(done, h.Name+" "+how)
	}
	a.mu.Lock()
	a.links, a.revNat = links, revNat.Map
	a.mu.Unlock()
	return fmt.Sprintf("Attached to cgroup %s: %s (links pinned in %s)",
		cgroup, strings.Join(done, ", "), a.linksDir()), nil
}

// attachHook returns the link of hook h running prog, and whether it was
// "attached" anew or "updated" in place.
func (a *attacher) attachHook(h socklb.Hook, prog *ebpf.Program, cgroup string, cgID uint64) (link.Link, string, error) {
	if prog == nil {
		return nil, "", fmt.Errorf("object has no program %s", h.Program)
	}
	path := filepath.Join(a.linksDir(), h.Name)
	old, err := link.LoadPinnedLink(path, nil)
	switch {
	case err == nil:
		if same, why := sameAttachment(old, h, cgID); same {
			if err := old.Update(prog); err != nil {
				old.Close()
				return nil, "", fmt.Errorf("update pinned link %s: %w", path, err)
			}
			return old, "updated", nil
		} else {
			// Attached elsewhere (another --cgroup-root): that one goes.
			a.log.Info("Replacing a pinned link", "path", path, "reason", why)
			if err := errors.Join(old.Unpin(), old.Close()); err != nil {
				return nil, "", fmt.Errorf("remove pinned link %s: %w", path, err)
			}
		}
	case errors.Is(err, fs.ErrNotExist):
	default:
		// Not a link, or unreadable: it cannot be ours to keep.
		a.log.Warn("Removing an unusable pin", "path", path, "error", err)
		if err := os.Remove(path); err != nil {
			return nil, "", fmt.Errorf("remove pin %s: %w", path, err)
		}
	}

	l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: h.Attach, Program: prog})
	if err != nil {
		return nil, "", err
	}
	// Until pinned, the link dies with this process, so a crash here
	// leaves nothing attached behind.
	if err := l.Pin(path); err != nil {
		l.Close()
		return nil, "", fmt.Errorf("pin link %s (the kernel must support BPF links): %w", path, err)
	}
	return l, "attached", nil
}

// sameAttachment tells whether l is a cgroup link of hook h on cgroup cgID.
func sameAttachment(l link.Link, h socklb.Hook, cgID uint64) (bool, string) {
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
	if ebpf.AttachType(cg.AttachType) != h.Attach {
		return false, fmt.Sprintf("attach type %d, not %d", cg.AttachType, h.Attach)
	}
	return true, ""
}

// detach removes the pinned links (detaching the programs) and the socket
// reverse-NAT map.
func (a *attacher) detach() (string, error) {
	a.close()
	var errs []error
	var gone []string
	for _, h := range socklb.Hooks {
		path := filepath.Join(a.linksDir(), h.Name)
		l, err := link.LoadPinnedLink(path, nil)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("load pinned link %s: %w", path, err))
			continue
		}
		// Unpinned and closed, the link has no reference left and the
		// kernel detaches it.
		if err := errors.Join(l.Unpin(), l.Close()); err != nil {
			errs = append(errs, fmt.Errorf("remove pinned link %s: %w", path, err))
			continue
		}
		gone = append(gone, h.Name)
	}
	if err := bpf.RemovePinnedMap(a.pinDir, socklb.SockRevNatMap); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return "", err
	}
	if len(gone) == 0 {
		return "Disabled (--" + EnableFlag + "=false); nothing attached", nil
	}
	return "Disabled (--" + EnableFlag + "=false); detached " + strings.Join(gone, ", "), nil
}

// close drops this process's handles; pinned links stay attached.
func (a *attacher) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, l := range a.links {
		l.Close()
	}
	a.links = nil
	if a.revNat != nil {
		a.revNat.Close()
		a.revNat = nil
	}
}
