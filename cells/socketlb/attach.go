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

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/hive/cell"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/cgrouplink"
	"github.com/apiary-net/apiary/bpf/socklb"
	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/lb"
	"github.com/apiary-net/apiary/reconcilers"
)

// LinksDir is the subdirectory of --bpf-pin-dir holding the pinned links,
// one per hook, named after it (connect4, sendmsg4, ...).
const LinksDir = "links"

// AffinityMaxEntries sizes lb4_affinity and lb6_affinity, LRUs: one entry
// per client network namespace and service with session affinity.
const AffinityMaxEntries = 65536

// ownMaxEntries sizes the programs' own maps (socklb.OwnMaps); the socket
// reverse-NAT maps are socket storage, one entry per socket, unsized.
var ownMaxEntries = map[string]uint32{
	bpf.LB4AffinityMap: AffinityMaxEntries,
	bpf.LB6AffinityMap: AffinityMaxEntries,
}

type attacher struct {
	log    *slog.Logger
	cfg    Config
	root   cgroups.Root
	pinDir string
	lbMaps lb.Maps

	// attached is closed once the programs are attached.
	attached chan struct{}

	// translations, when subscribed, gets the programs' reports.
	translations *Translations

	mu    sync.Mutex
	links []link.Link
	own   map[string]*ebpf.Map // the programs' own maps, by name
	xlate *xlateReader         // the reader of the programs' reports
}

func (a *attacher) linksDir() string { return filepath.Join(a.pinDir, LinksDir) }

// run attaches (or detaches) once and then keeps its health scope open
// with what is attached where. A failure is returned: the job retries it
// with backoff (attachRetry), and its health scope shows the error between
// attempts (hive's job says "Running", OK, during each one).
func (a *attacher) run(ctx context.Context, health cell.Health) error {
	var msg string
	var err error
	if a.cfg.EnableSocketLB {
		msg, err = a.attach()
	} else {
		msg, err = a.detach()
	}
	if err != nil {
		return fmt.Errorf("socket load balancing failed: %w", err)
	}
	a.log.Info(msg)
	health.OK(msg)
	if a.cfg.EnableSocketLB {
		close(a.attached)
		// Programs that must run after these (policy) move behind them
		// now.
		a.root.Attached()
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

	own, err := a.openOwnMaps()
	if err != nil {
		return "", err
	}
	var xlate *xlateReader
	var xlateMaps [2]*ebpf.Map
	if a.translations != nil && a.translations.wanted() {
		if xlate, err = a.translations.start(a.log); err != nil {
			closeMaps(own)
			return "", err
		}
		xlateMaps = xlate.maps
	}
	fail := func() {
		closeMaps(own)
		a.translations.stop(xlate)
	}
	var progs map[string]*ebpf.Program
	err = a.lbMaps.Maps(func(lm reconcilers.LBMaps) error {
		// The programs reference the kernel's maps.
		var km [7]*ebpf.Map
		for i, m := range lm.All() {
			if km[i], err = bpf.KernelMap(m); err != nil {
				return err
			}
		}
		progs, err = socklb.Load(socklb.Maps{
			Services4: km[0], Backends4: km[1], RevNat4: km[2],
			Services6: km[3], Backends6: km[4], RevNat6: km[5],
			AffinityMatch: km[6],
			SockRevNat4:   own[socklb.SockRevNat4Map],
			SockRevNat6:   own[socklb.SockRevNat6Map],
			Affinity4:     own[bpf.LB4AffinityMap],
			Affinity6:     own[bpf.LB6AffinityMap],
			DNSSock:       own[bpf.DNSSockMap],
			XlateEvents:   xlateMaps[0],
			XlateLost:     xlateMaps[1],
		})
		return err
	})
	if err != nil {
		fail()
		return "", err
	}
	// The links hold the programs (and the programs the maps).
	defer func() {
		for _, p := range progs {
			p.Close()
		}
	}()

	if err := os.MkdirAll(a.linksDir(), 0o750); err != nil {
		fail()
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
			fail()
			return "", fmt.Errorf("attach %s to %s: %w", h.Name, cgroup, err)
		}
		links = append(links, l)
		done = append(done, h.Name+" "+how)
	}
	a.mu.Lock()
	a.links, a.own, a.xlate = links, own, xlate
	a.mu.Unlock()
	return fmt.Sprintf("Attached to cgroup %s: %s (links pinned in %s)",
		cgroup, strings.Join(done, ", "), a.linksDir()), nil
}

// openOwnMaps opens the programs' own maps, pinned in the pin directory
// so that replies on existing sockets keep being translated, and clients
// keep their backends, across restarts. A pin of other attributes is
// replaced empty: the programs rebuild what the maps remember.
func (a *attacher) openOwnMaps() (map[string]*ebpf.Map, error) {
	own := map[string]*ebpf.Map{}
	open := func(name string) error {
		spec, err := socklb.MapSpec(name, ownMaxEntries[name])
		if err != nil {
			return err
		}
		pm, err := bpf.OpenPinnedMap(a.log, spec, a.pinDir, nil)
		if err != nil {
			return err
		}
		own[name] = pm.Map
		return nil
	}
	for _, name := range socklb.OwnMaps {
		if err := open(name); err != nil {
			closeMaps(own)
			return nil, err
		}
	}
	// Shared with the policy programs, which own it (see
	// bpf/c/dns_redirect.h): not an own map, never removed here.
	dns, err := a.openDNSSock()
	if err != nil {
		closeMaps(own)
		return nil, err
	}
	own[bpf.DNSSockMap] = dns
	return own, nil
}

// openDNSSock opens the sockets' storage of intercepted DNS.
func (a *attacher) openDNSSock() (*ebpf.Map, error) {
	spec, err := socklb.Spec()
	if err != nil {
		return nil, err
	}
	ms, err := bpf.DNSSockMapSpec(spec)
	if err != nil {
		return nil, err
	}
	return bpf.OpenDNSSockMap(a.log, ms, a.pinDir)
}

func closeMaps(maps map[string]*ebpf.Map) {
	for _, m := range maps {
		m.Close()
	}
}

// detach removes the pinned links (detaching the programs) and the
// programs' own maps.
func (a *attacher) detach() (string, error) {
	a.close()
	var errs []error
	gone, err := cgrouplink.DetachAll(a.linksDir(), socklb.Hooks)
	if err != nil {
		errs = append(errs, err)
	}
	for _, name := range socklb.OwnMaps {
		if err := bpf.RemovePinnedMap(a.pinDir, name); err != nil {
			errs = append(errs, err)
		}
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
	closeMaps(a.own)
	a.own = nil
	a.translations.stop(a.xlate)
	a.xlate = nil
}
