// Package podiface names what the agent and the apiary-cni plugin share
// on a pod's interface: where the two interface programs (policy_from_pod,
// policy_to_pod) are pinned for the plugin to use, where the links that
// attach them to the host side of a pod's veth are pinned, and the
// policy_ifaces entry that denies a pod until the agent classifies it.
//
// The plugin attaches what the agent loaded and pinned (it loads nothing
// itself), at the same pins the agent uses, so that the agent adopts the
// links when it finds the pod: it writes the pod's own entry over the
// pending one and keeps the links in place.
package podiface

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"strconv"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/iflink"
)

// The interface programs (the names of bpf/c/policy.c's sections, and of
// their pins under ProgramsDir).
const (
	// FromPod judges what the pod sends: on the host side's ingress.
	FromPod = "policy_from_pod"
	// ToPod judges what the pod receives: on the host side's egress.
	ToPod = "policy_to_pod"
)

// Programs are the interface programs, in attach order.
var Programs = []string{FromPod, ToPod}

// ProgramsDir is the subdirectory of --bpf-pin-dir where the agent pins
// the interface programs it loaded, for the plugin.
const ProgramsDir = "programs/ifaces"

// LinksDir is the subdirectory of --bpf-pin-dir holding the pinned tcx
// links of pod interfaces, two per interface: "<ifindex>_from_pod" and
// "<ifindex>_to_pod".
const LinksDir = "links/ifaces"

// ProgramPin is where the agent pins program prog (FromPod or ToPod).
func ProgramPin(pinDir, prog string) string {
	return filepath.Join(pinDir, ProgramsDir, prog)
}

// LinkPin is the pin of the link of prog on interface ifindex.
func LinkPin(pinDir string, ifindex int, prog string) string {
	return filepath.Join(pinDir, LinksDir, strconv.Itoa(ifindex)+PinSuffix(prog))
}

// PinSuffix is the part of a link's pin name after the ifindex.
func PinSuffix(prog string) string {
	if prog == ToPod {
		return "_to_pod"
	}
	return "_from_pod"
}

// Hook is where prog goes on the host side of interface ifindex: FromPod
// on its ingress, ToPod on its egress.
func Hook(ifindex int, prog string) iflink.Hook {
	return iflink.Hook{Ifindex: ifindex, Egress: prog == ToPod}
}

// PendingValue is the policy_ifaces entry of a pod the agent has not
// classified yet: no cgroup (so no endpoint), denied both ways whatever
// --unclassified-pods says, and its own addresses, so that its ARP and
// neighbour discovery of them pass. The agent overwrites it with the
// pod's entry when it finds the pod.
func PendingValue(addrs []netip.Addr) (bpf.PolicyIfaceValue, error) {
	return bpf.NewPolicyIfaceValue(0, bpf.PolicyIfaceUnclassifiedDeny|bpf.PolicyIfacePending, addrs)
}

// Pending tells whether v is an entry the plugin wrote and the agent has
// not replaced yet.
func Pending(v bpf.PolicyIfaceValue) bool {
	return v.Flags&bpf.PolicyIfacePending != 0
}

// LoadPrograms opens the interface programs the agent pinned under pinDir
// and checks that they use the policy_ifaces map pinned there (an agent
// that moved to a new map pins its programs again): entries written into
// that map are the ones the programs read. The caller closes the
// programs.
func LoadPrograms(pinDir string, ifaces *ebpf.Map) (map[string]*ebpf.Program, error) {
	progs := map[string]*ebpf.Program{}
	closeAll := func() {
		for _, p := range progs {
			p.Close()
		}
	}
	mapInfo, err := ifaces.Info()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", bpf.PolicyIfacesMap, err)
	}
	mapID, ok := mapInfo.ID()
	if !ok {
		return nil, fmt.Errorf("%s: the kernel gives no map ID", bpf.PolicyIfacesMap)
	}
	for _, name := range Programs {
		pin := ProgramPin(pinDir, name)
		p, err := ebpf.LoadPinnedProgram(pin, nil)
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("program %s: %w", pin, err)
		}
		progs[name] = p
		if err := usesMap(p, mapID); err != nil {
			closeAll()
			return nil, fmt.Errorf("program %s: %w", pin, err)
		}
	}
	return progs, nil
}

// errStaleProgram: a pinned program reads another policy_ifaces than the
// pinned one.
var errStaleProgram = errors.New("it does not use the pinned " + bpf.PolicyIfacesMap + " map (pinned by an earlier agent; start the agent to pin its programs again)")

func usesMap(p *ebpf.Program, id ebpf.MapID) error {
	info, err := p.Info()
	if err != nil {
		return err
	}
	ids, ok := info.MapIDs()
	if !ok {
		return errors.New("the kernel does not list the program's maps")
	}
	for _, m := range ids {
		if m == id {
			return nil
		}
	}
	return errStaleProgram
}
