package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/iflink"
	"github.com/apiary-net/apiary/bpf/podiface"
)

// errNoAgent: the agent's maps or programs are not pinned (it never ran
// on this node, runs with packet-level enforcement off, or pinned an
// older layout).
var errNoAgent = errors.New("apiary's interface programs are not pinned")

// pins are the agent's pinned maps and programs.
type pins struct {
	ifaces, flows, frags *ebpf.Map
	progs                map[string]*ebpf.Program
}

func (p *pins) close() {
	p.ifaces.Close()
	p.flows.Close()
	p.frags.Close()
	for _, prog := range p.progs {
		prog.Close()
	}
}

// openPins opens what the agent pinned under dir; a missing pin is
// errNoAgent.
func openPins(dir string) (*pins, error) {
	open := func(name string) (*ebpf.Map, error) {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w: no map %s in %s", errNoAgent, name, dir)
		}
		if err != nil {
			return nil, fmt.Errorf("map %s in %s: %w", name, dir, err)
		}
		return m, nil
	}
	ifaces, err := open(bpf.PolicyIfacesMap)
	if err != nil {
		return nil, err
	}
	flows, err := open(bpf.PolicyIfaceFlowsMap)
	if err != nil {
		ifaces.Close()
		return nil, err
	}
	frags, err := open(bpf.PolicyIfaceFragsMap)
	if err != nil {
		ifaces.Close()
		flows.Close()
		return nil, err
	}
	progs, err := podiface.LoadPrograms(dir, ifaces)
	if err != nil {
		ifaces.Close()
		flows.Close()
		frags.Close()
		return nil, fmt.Errorf("%w: %v", errNoAgent, err)
	}
	return &pins{ifaces: ifaces, flows: flows, frags: frags, progs: progs}, nil
}

// noAgentError is the CNI error of an ADD or CHECK without the agent's
// pins.
func noAgentError(conf *netConf, err error) error {
	return types.NewError(types.ErrTryAgainLater,
		"apiary-cni: the pod would start without packet-level policy: start the apiary agent on this node "+
			"(it pins its programs under --bpf-pin-dir "+conf.BPFPinDir+"), or set \"failOpen\": true in the netconf",
		err.Error())
}

func cmdAdd(args *skel.CmdArgs) error {
	conf, err := parseConf(args.StdinData)
	if err != nil {
		return err
	}
	if conf.result == nil {
		return types.NewError(types.ErrInvalidNetworkConfig,
			"apiary-cni must be chained after the plugin that makes the pod's interface (ptp, bridge, …)", "no prevResult")
	}
	if err := cover(conf, args); err != nil {
		if errors.Is(err, errNoAgent) {
			if conf.FailOpen {
				fmt.Fprintf(os.Stderr, "apiary-cni: failOpen: pod %s starts without packet-level policy until the agent finds it: %v\n", args.ContainerID, err)
				return types.PrintResult(conf.PrevResult, conf.CNIVersion)
			}
			return noAgentError(conf, err)
		}
		return types.NewError(types.ErrInternal, "apiary-cni: cannot cover the pod's interface", err.Error())
	}
	return types.PrintResult(conf.PrevResult, conf.CNIVersion)
}

// cover attaches the interface programs to the pod's host veth, after
// writing the entry that denies the pod until the agent classifies it.
// An interface the agent already has (its entry, both links) is left as
// it is.
func cover(conf *netConf, args *skel.CmdArgs) error {
	pod, err := openNetns(args.Netns)
	if err != nil {
		return err
	}
	defer pod.close()
	host, err := hostVeth(hostInterfaces(conf.result), pod, args.IfName)
	if err != nil {
		return err
	}
	addrs, err := podAddrs(conf.result)
	if err != nil {
		return err
	}
	value, err := podiface.PendingValue(addrs)
	if err != nil {
		return fmt.Errorf("the pod's addresses %v: %w", addrs, err)
	}
	p, err := openPins(conf.BPFPinDir)
	if err != nil {
		return err
	}
	defer p.close()
	ifindex := host.Attrs().Index
	if adopted(conf.BPFPinDir, p, ifindex) {
		return nil
	}
	key := uint32(ifindex)
	// The entry first: a program without one lets packets through.
	if err := p.ifaces.Put(key, value); err != nil {
		return fmt.Errorf("write %s[%d]: %w", bpf.PolicyIfacesMap, key, err)
	}
	// Flows and fragments of an earlier interface with this index must
	// not let the new pod's packets through; the agent gives the
	// interface new ones.
	for name, m := range map[string]*ebpf.Map{bpf.PolicyIfaceFlowsMap: p.flows, bpf.PolicyIfaceFragsMap: p.frags} {
		if err := m.Delete(key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete %s[%d]: %w", name, key, err)
		}
	}
	for _, prog := range podiface.Programs {
		if _, err := iflink.Attach(podiface.LinkPin(conf.BPFPinDir, ifindex, prog), podiface.Hook(ifindex, prog), p.progs[prog], conf.mode); err != nil {
			return fmt.Errorf("%s on %s: %w", prog, host.Attrs().Name, err)
		}
	}
	return nil
}

// adopted tells whether the agent has the interface already: the pod's own
// entry and both links on it (the veth is new, so links on it are the
// agent's for this pod).
func adopted(pinDir string, p *pins, ifindex int) bool {
	var cur bpf.PolicyIfaceValue
	if err := p.ifaces.Lookup(uint32(ifindex), &cur); err != nil || podiface.Pending(cur) {
		return false
	}
	return linksLive(pinDir, ifindex)
}

func linksLive(pinDir string, ifindex int) bool {
	for _, prog := range podiface.Programs {
		if !iflink.Live(podiface.LinkPin(pinDir, ifindex, prog), podiface.Hook(ifindex, prog)) {
			return false
		}
	}
	return true
}

// cmdDel removes the programs and entries of the pod's interface, when it
// still exists (the chain's DEL runs this before the plugin that deletes
// the veth) and is still the pod's. Nothing there is no error; what a
// gone interface leaves pinned, the agent removes.
func cmdDel(args *skel.CmdArgs) error {
	conf, err := parseConf(args.StdinData)
	if err != nil {
		return err
	}
	if conf.result == nil || args.Netns == "" {
		return nil
	}
	pod, err := openNetns(args.Netns)
	if err != nil {
		return nil // the namespace, and so the veth, are gone
	}
	defer pod.close()
	host, err := hostVeth(hostInterfaces(conf.result), pod, args.IfName)
	if err != nil {
		return nil
	}
	if err := uncover(conf.BPFPinDir, host.Attrs().Index); err != nil {
		return types.NewError(types.ErrInternal, "apiary-cni: cannot remove the programs of the pod's interface", err.Error())
	}
	return nil
}

// uncover detaches the programs from interface ifindex and deletes its
// entries: the links first, so that no packet meets a program without
// its entry (which would let it through).
func uncover(pinDir string, ifindex int) error {
	var errs []error
	for _, prog := range podiface.Programs {
		errs = append(errs, iflink.Detach(podiface.LinkPin(pinDir, ifindex, prog), podiface.Hook(ifindex, prog)))
	}
	for _, name := range []string{bpf.PolicyIfacesMap, bpf.PolicyIfaceFlowsMap, bpf.PolicyIfaceFragsMap} {
		m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, name), nil)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if err := m.Delete(uint32(ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("delete %s[%d]: %w", name, ifindex, err))
		}
		m.Close()
	}
	return errors.Join(errs...)
}

// cmdCheck verifies that the pod's interface has both programs and an
// entry (the plugin's pending one or the agent's).
func cmdCheck(args *skel.CmdArgs) error {
	conf, err := parseConf(args.StdinData)
	if err != nil {
		return err
	}
	if conf.result == nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "apiary-cni: CHECK needs prevResult", "")
	}
	if err := check(conf, args); err != nil {
		if errors.Is(err, errNoAgent) {
			if conf.FailOpen {
				return nil
			}
			return noAgentError(conf, err)
		}
		return types.NewError(types.ErrInternal, "apiary-cni: the pod's interface is not covered", err.Error())
	}
	return nil
}

func check(conf *netConf, args *skel.CmdArgs) error {
	pod, err := openNetns(args.Netns)
	if err != nil {
		return err
	}
	defer pod.close()
	host, err := hostVeth(hostInterfaces(conf.result), pod, args.IfName)
	if err != nil {
		return err
	}
	p, err := openPins(conf.BPFPinDir)
	if err != nil {
		return err
	}
	defer p.close()
	ifindex := host.Attrs().Index
	var cur bpf.PolicyIfaceValue
	if err := p.ifaces.Lookup(uint32(ifindex), &cur); err != nil {
		return fmt.Errorf("%s has no entry in %s: %w", host.Attrs().Name, bpf.PolicyIfacesMap, err)
	}
	if !linksLive(conf.BPFPinDir, ifindex) {
		return fmt.Errorf("the programs are not attached to %s (pins %s)", host.Attrs().Name,
			filepath.Join(conf.BPFPinDir, podiface.LinksDir, strconv.Itoa(ifindex)+"_*"))
	}
	return nil
}
