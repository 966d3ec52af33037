package nodeport

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/iflink"
	"github.com/apiary-net/apiary/bpf/nodeport"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/lb"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// LinksDir is the subdirectory of --bpf-pin-dir holding the pinned tcx
// links, <ifindex>_ingress and <ifindex>_egress.
const LinksDir = "links/nodeport"

type attacher struct {
	log     *slog.Logger
	cfg     Config
	pinDir  string
	lbMaps  lb.Maps
	nodeIPs []netip.Addr
	db      *statedb.DB
	devices statedb.RWTable[*tables.NodePortDevice]
	// maglev writes lb_maglev; nil with random selection.
	maglev *reconcilers.Maglev

	// attached is closed once the programs and their maps are in place.
	attached     chan struct{}
	attachedOnce sync.Once

	mu  sync.Mutex
	own map[string]*ebpf.Map
}

func newAttacher(log *slog.Logger, cfg Config, pinDir bpffs.PinDir, maps lb.Maps, nodeCfg node.Config,
	db *statedb.DB, devices statedb.RWTable[*tables.NodePortDevice], mg *reconcilers.Maglev) (*attacher, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &attacher{log: log, cfg: cfg, pinDir: string(pinDir), lbMaps: maps, nodeIPs: nodeCfg.NodeIPs,
		db: db, devices: devices, maglev: mg, attached: make(chan struct{})}, nil
}

func (a *attacher) linksDir() string { return filepath.Join(a.pinDir, LinksDir) }

func linkPin(dir string, ifindex int, egress bool) string {
	hook := "ingress"
	if egress {
		hook = "egress"
	}
	return filepath.Join(dir, strconv.Itoa(ifindex)+"_"+hook)
}

func (a *attacher) progConfig() nodeport.Config {
	return nodeport.Config{TCPTimeout: a.cfg.NATTCPTimeout, UDPTimeout: a.cfg.NATUDPTimeout, MaglevSize: a.cfg.maglevSize()}
}

// run attaches (or detaches), then, attached, follows the devices: when
// a device named by --devices comes or goes, when the default routes name
// other devices (--devices empty), or when a device's addresses change,
// the programs are attached again to what is found, the devices map and
// the nodeport-devices table rewritten.
func (a *attacher) run(ctx context.Context, health cell.Health) error {
	if !a.cfg.EnableNodePort {
		msg, err := a.detach()
		if err != nil {
			return fmt.Errorf("nodeport: %w", err)
		}
		a.log.Info(msg)
		health.OK(msg)
		<-ctx.Done()
		return nil
	}
	// Subscribed before the first look, so that nothing between the two
	// is missed.
	events, err := a.subscribe(ctx)
	if err != nil {
		return fmt.Errorf("nodeport: follow the devices: %w", err)
	}
	msg, err := a.attach()
	if err != nil {
		return fmt.Errorf("nodeport: %w", err)
	}
	a.log.Info(msg)
	health.OK(msg)
	a.attachedOnce.Do(func() { close(a.attached) })
	last := a.fingerprint()
	recheck := time.NewTicker(deviceRecheckInterval)
	defer recheck.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-events:
			// A device comes with its addresses and routes in a burst:
			// look once it has settled.
			settle := time.NewTimer(deviceSettle)
		drain:
			for {
				select {
				case <-events:
				case <-settle.C:
					break drain
				case <-ctx.Done():
					settle.Stop()
					return nil
				}
			}
		case <-recheck.C:
		}
		_, rows, err := a.findDevices()
		if err == nil && deviceFingerprint(rows) == last {
			continue
		}
		msg, err := a.attach()
		last = a.fingerprint()
		if err != nil {
			a.log.Warn("The external devices changed; attaching failed", "error", err)
			health.Degraded("nodeport devices", err)
			continue
		}
		a.log.Info("The external devices changed", "now", msg)
		health.OK(msg)
	}
}

// How the devices are followed: events settle for deviceSettle before
// the devices are looked up again; every deviceRecheckInterval they are
// looked up anyway (a lost netlink message must not leave them stale).
const (
	deviceSettle          = 200 * time.Millisecond
	deviceRecheckInterval = 30 * time.Second
)

// subscribe delivers a tick on the returned channel for every change of
// links and addresses, and of routes when the devices are found from them;
// the subscriptions end with ctx. A subscription's error (a message lost)
// ticks too.
func (a *attacher) subscribe(ctx context.Context) (<-chan struct{}, error) {
	tick := make(chan struct{}, 1)
	kick := func() {
		select {
		case tick <- struct{}{}:
		default:
		}
	}
	onErr := func(err error) {
		if ctx.Err() == nil {
			a.log.Debug("Device events", "error", err)
			kick()
		}
	}
	links := make(chan netlink.LinkUpdate, 64)
	addrs := make(chan netlink.AddrUpdate, 64)
	routes := make(chan netlink.RouteUpdate, 64)
	done := ctx.Done()
	if err := netlink.LinkSubscribeWithOptions(links, done, netlink.LinkSubscribeOptions{ErrorCallback: onErr}); err != nil {
		return nil, fmt.Errorf("links: %w", err)
	}
	if err := netlink.AddrSubscribeWithOptions(addrs, done, netlink.AddrSubscribeOptions{ErrorCallback: onErr}); err != nil {
		return nil, fmt.Errorf("addresses: %w", err)
	}
	if len(a.cfg.Devices) == 0 {
		if err := netlink.RouteSubscribeWithOptions(routes, done, netlink.RouteSubscribeOptions{ErrorCallback: onErr}); err != nil {
			return nil, fmt.Errorf("routes: %w", err)
		}
	}
	go func() {
		for {
			select {
			case <-done:
				return
			case _, ok := <-links:
				if !ok {
					links = nil
				}
			case _, ok := <-addrs:
				if !ok {
					addrs = nil
				}
			case _, ok := <-routes:
				if !ok {
					routes = nil
				}
			}
			kick()
		}
	}()
	return tick, nil
}

// deviceFingerprint says what of the devices found matters to the
// programs: names, indexes, SNAT addresses and why one is missing.
func deviceFingerprint(rows []*tables.NodePortDevice) string {
	lines := make([]string, 0, len(rows))
	for _, r := range rows {
		lines = append(lines, fmt.Sprintf("%s|%d|%v|%v|%s", r.Name, r.Ifindex, r.SNATAddr, r.SNATAddr6, r.Error))
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

// fingerprint is deviceFingerprint of the nodeport-devices table: what
// was found when the programs were last attached. A device the programs
// could not be attached to has that error there, which a new lookup does
// not: it differs, and the next change tries again.
func (a *attacher) fingerprint() string {
	return deviceFingerprint(slices.Collect(statedb.ToSeq(a.devices.All(a.db.ReadTxn()))))
}

// device is an external device found.
type device struct {
	name         string
	ifindex      int
	addr4, addr6 netip.Addr
}

// findDevices resolves --devices, or the devices of the default routes.
func (a *attacher) findDevices() ([]device, []*tables.NodePortDevice, error) {
	names := slices.Clone(a.cfg.Devices)
	if len(names) == 0 {
		routes, err := netlink.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return nil, nil, fmt.Errorf("list routes: %w", err)
		}
		for _, r := range routes {
			if r.Dst != nil && r.Dst.IP != nil {
				if ones, _ := r.Dst.Mask.Size(); ones != 0 {
					continue
				}
			}
			if r.LinkIndex == 0 {
				continue
			}
			l, err := netlink.LinkByIndex(r.LinkIndex)
			if err == nil && !slices.Contains(names, l.Attrs().Name) {
				names = append(names, l.Attrs().Name)
			}
		}
		if len(names) == 0 {
			return nil, nil, fmt.Errorf("no default route names a device: set --%s", DevicesFlag)
		}
	}
	var devs []device
	var rows []*tables.NodePortDevice
	for _, name := range names {
		row := &tables.NodePortDevice{Name: name}
		rows = append(rows, row)
		ifc, err := net.InterfaceByName(name)
		if err != nil {
			row.Error = err.Error()
			continue
		}
		d := device{name: name, ifindex: ifc.Index, addr4: a.deviceAddr(ifc, true), addr6: a.deviceAddr(ifc, false)}
		row.Ifindex, row.SNATAddr, row.SNATAddr6 = d.ifindex, d.addr4, d.addr6
		devs = append(devs, d)
	}
	return devs, rows, nil
}

// deviceAddr picks the device's IPv4 (or IPv6) address for SNAT: a node
// address on it first, else its first global unicast one.
func (a *attacher) deviceAddr(ifc *net.Interface, v4 bool) netip.Addr {
	addrs, err := ifc.Addrs()
	if err != nil {
		return netip.Addr{}
	}
	var first netip.Addr
	for _, ad := range addrs {
		pfx, err := netip.ParsePrefix(ad.String())
		if err != nil || pfx.Addr().Is4() != v4 || !pfx.Addr().IsGlobalUnicast() {
			continue
		}
		ip := pfx.Addr()
		if slices.Contains(a.nodeIPs, ip) {
			return ip
		}
		if !first.IsValid() {
			first = ip
		}
	}
	return first
}

func (a *attacher) openOwnMaps() (map[string]*ebpf.Map, error) {
	own := map[string]*ebpf.Map{}
	for _, name := range nodeport.OwnMaps {
		spec, err := nodeport.MapSpec(name, a.cfg.BPFNATMax)
		if name == nodeport.MaglevMap {
			// Another table size than the pin's: the pin is replaced
			// (nothing migrates; the reconciler writes every table).
			spec, err = nodeport.MaglevMapSpec(a.cfg.maglevSize())
		}
		if err != nil {
			closeMaps(own)
			return nil, err
		}
		pm, err := bpf.OpenPinnedMap(a.log, spec, a.pinDir, nil)
		if err != nil {
			closeMaps(own)
			return nil, err
		}
		own[name] = pm.Map
	}
	return own, nil
}

func closeMaps(maps map[string]*ebpf.Map) {
	for _, m := range maps {
		m.Close()
	}
}

// attach loads the programs on the agent's maps, writes the devices map
// and puts the programs on each device's ingress and egress. Devices the
// agent attached to before and are no longer listed are detached.
func (a *attacher) attach() (string, error) {
	a.close()
	devs, rows, err := a.findDevices()
	if err != nil {
		return "", err
	}
	own, err := a.openOwnMaps()
	if err != nil {
		return "", err
	}
	var progs map[string]*ebpf.Program
	err = a.lbMaps.Maps(func(lm reconcilers.LBMaps) error {
		s4, err := bpf.KernelMap(lm.Services4)
		if err != nil {
			return err
		}
		b4, err := bpf.KernelMap(lm.Backends4)
		if err != nil {
			return err
		}
		am, err := bpf.KernelMap(lm.AffinityMatch)
		if err != nil {
			return err
		}
		s6, err := bpf.KernelMap(lm.Services6)
		if err != nil {
			return err
		}
		b6, err := bpf.KernelMap(lm.Backends6)
		if err != nil {
			return err
		}
		progs, err = nodeport.Load(a.progConfig(), nodeport.Maps{Services4: s4, Backends4: b4, AffinityMatch: am,
			Affinity4: own[nodeport.Affinity4Map], Affinity6: own[nodeport.Affinity6Map], Services6: s6, Backends6: b6,
			NAT6: own[nodeport.NAT6Map], SourceRange6: own[nodeport.SourceRange6Map],
			Devices: own[nodeport.DevicesMap], NAT4: own[nodeport.NAT4Map], Stats: own[nodeport.StatsMap],
			SourceRange4: own[nodeport.SourceRange4Map], Maglev: own[nodeport.MaglevMap]})
		return err
	})
	if err != nil {
		closeMaps(own)
		return "", err
	}
	defer func() {
		for _, p := range progs {
			p.Close()
		}
	}()
	if err := os.MkdirAll(a.linksDir(), 0o750); err != nil {
		closeMaps(own)
		return "", fmt.Errorf("links directory: %w", err)
	}

	// The devices map first: a remote backend is told apart by the device
	// it is routed through.
	keep := map[uint32]bool{}
	for _, d := range devs {
		var v nodeport.Device
		if d.addr4.IsValid() {
			v.Addr4 = d.addr4.As4()
		}
		if d.addr6.IsValid() {
			v.Addr6 = d.addr6.As16()
		}
		if err := own[nodeport.DevicesMap].Put(uint32(d.ifindex), v); err != nil {
			closeMaps(own)
			return "", fmt.Errorf("write %s: %w", nodeport.DevicesMap, err)
		}
		keep[uint32(d.ifindex)] = true
	}
	var stale []uint32
	var k uint32
	var v nodeport.Device
	for it := own[nodeport.DevicesMap].Iterate(); it.Next(&k, &v); {
		if !keep[k] {
			stale = append(stale, k)
		}
	}

	var done []string
	for i, row := range rows {
		d := slices.IndexFunc(devs, func(d device) bool { return d.name == row.Name })
		if d < 0 {
			continue
		}
		dev := devs[d]
		// Egress first: no flow is translated one way before its replies
		// can be translated back.
		var errs []error
		for _, egress := range []bool{true, false} {
			prog := progs[nodeport.IngressProg]
			if egress {
				prog = progs[nodeport.EgressProg]
			}
			pin := linkPin(a.linksDir(), dev.ifindex, egress)
			if _, err := iflink.Attach(pin, iflink.Hook{Ifindex: dev.ifindex, Egress: egress}, prog, iflink.Mode(a.cfg.NodePortAttach)); err != nil {
				errs = append(errs, err)
			}
		}
		if err := errors.Join(errs...); err != nil {
			rows[i].Error = err.Error()
			continue
		}
		rows[i].Attach = "tc"
		if _, err := os.Stat(linkPin(a.linksDir(), dev.ifindex, false)); err == nil {
			rows[i].Attach = "tcx"
		}
		done = append(done, fmt.Sprintf("%s (%s, SNAT %v %v)", dev.name, rows[i].Attach, dev.addr4, dev.addr6))
	}
	for _, ifindex := range stale {
		a.detachDevice(int(ifindex))
		_ = own[nodeport.DevicesMap].Delete(ifindex)
	}
	a.publish(rows)
	a.mu.Lock()
	a.own = own
	a.mu.Unlock()
	if a.maglev != nil {
		if err := a.maglev.SetMap(own[nodeport.MaglevMap]); err != nil {
			return "", err
		}
	}
	var failed []string
	for _, r := range rows {
		if r.Error != "" {
			failed = append(failed, r.Name+": "+r.Error)
		}
	}
	if len(done) == 0 {
		return "", fmt.Errorf("no external device has the programs: %s", strings.Join(failed, "; "))
	}
	msg := "Attached to " + strings.Join(done, ", ")
	if len(failed) > 0 {
		msg += "; failed: " + strings.Join(failed, "; ")
	}
	return msg, nil
}

func (a *attacher) detachDevice(ifindex int) error {
	return errors.Join(
		iflink.Detach(linkPin(a.linksDir(), ifindex, false), iflink.Hook{Ifindex: ifindex}),
		iflink.Detach(linkPin(a.linksDir(), ifindex, true), iflink.Hook{Ifindex: ifindex, Egress: true}),
	)
}

func (a *attacher) publish(rows []*tables.NodePortDevice) {
	txn := a.db.WriteTxn(a.devices)
	a.devices.DeleteAll(txn)
	for _, r := range rows {
		a.devices.Insert(txn, r)
	}
	txn.Commit()
}

// detach removes the programs from every device the devices map names
// (the ones a previous agent attached to), then the programs' maps.
func (a *attacher) detach() (string, error) {
	a.close()
	var ifindexes []int
	spec, err := nodeport.MapSpec(nodeport.DevicesMap, 0)
	if err != nil {
		return "", err
	}
	if m, err := ebpf.LoadPinnedMap(filepath.Join(a.pinDir, spec.Name), nil); err == nil {
		var k uint32
		var v nodeport.Device
		for it := m.Iterate(); it.Next(&k, &v); {
			ifindexes = append(ifindexes, int(k))
		}
		m.Close()
	}
	var errs []error
	for _, ifindex := range ifindexes {
		errs = append(errs, a.detachDevice(ifindex))
	}
	for _, name := range nodeport.OwnMaps {
		errs = append(errs, bpf.RemovePinnedMap(a.pinDir, name))
	}
	if err := errors.Join(errs...); err != nil {
		return "", err
	}
	if len(ifindexes) == 0 {
		return "Disabled (--" + EnableFlag + "=false); nothing attached", nil
	}
	return fmt.Sprintf("Disabled (--%s=false); detached from %d devices", EnableFlag, len(ifindexes)), nil
}

// gc removes the NAT entries idle past their timeout.
func (a *attacher) gc(ctx context.Context) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	nat4, nat6 := a.own[nodeport.NAT4Map], a.own[nodeport.NAT6Map]
	if nat4 == nil || nat6 == nil {
		return nil
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return err
	}
	now := time.Duration(ts.Nano())
	d4, _, err4 := nodeport.Expire(nat4, now, a.progConfig())
	d6, _, err6 := nodeport.Expire6(nat6, now, a.progConfig())
	if d4+d6 > 0 {
		a.log.Debug("Expired idle nodeport NAT entries", "deleted", d4+d6)
	}
	return errors.Join(err4, err6)
}

// close drops this process's handles; pinned links and maps stay.
func (a *attacher) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	closeMaps(a.own)
	a.own = nil
	if a.maglev != nil {
		_ = a.maglev.SetMap(nil)
	}
}
