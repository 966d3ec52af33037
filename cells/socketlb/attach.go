package socketlb

import (
	"context"
	"errors"
	"fmt"
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
	"github.com/apiary-net/apiary/bpf/cgrouplink"
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
		l, how, err := cgrouplink.Attach(a.log, filepath.Join(a.linksDir(), h.Name), h.Attach, progs[h.Program], cgroup, cgID)
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

// detach removes the pinned links (detaching the programs) and the socket
// reverse-NAT map.
func (a *attacher) detach() (string, error) {
	a.close()
	var errs []error
	gone, err := cgrouplink.DetachAll(a.linksDir(), socklb.Hooks)
	if err != nil {
		errs = append(errs, err)
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
