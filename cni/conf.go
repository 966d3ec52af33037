package main

import (
	"encoding/json"
	"fmt"
	"net/netip"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/apiary-net/apiary/bpf/iflink"
)

// defaultPinDir is the agent's default --bpf-pin-dir.
const defaultPinDir = "/sys/fs/bpf/apiary"

// netConf is the plugin's configuration in the conflist.
type netConf struct {
	types.PluginConf
	// BPFPinDir is the agent's --bpf-pin-dir.
	BPFPinDir string `json:"bpfPinDir,omitempty"`
	// Attach is how links are made: auto, tcx or tc (the agent's
	// --policy-interface-attach).
	Attach string `json:"attach,omitempty"`
	// FailOpen lets ADD succeed, the pod unenforced at the packet level
	// until the agent finds it, when the agent's programs are not pinned.
	FailOpen bool `json:"failOpen,omitempty"`

	mode   iflink.Mode
	result *current.Result // prevResult, or nil
}

func parseConf(stdin []byte) (*netConf, error) {
	conf := &netConf{}
	if err := json.Unmarshal(stdin, conf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "apiary-cni: cannot parse the network configuration", err.Error())
	}
	if conf.BPFPinDir == "" {
		conf.BPFPinDir = defaultPinDir
	}
	if conf.Attach == "" {
		conf.Attach = string(iflink.ModeAuto)
	}
	mode, err := iflink.ParseMode(conf.Attach)
	if err != nil {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "apiary-cni: attach", err.Error())
	}
	conf.mode = mode
	if err := version.ParsePrevResult(&conf.PluginConf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "apiary-cni: cannot parse prevResult", err.Error())
	}
	if conf.PrevResult != nil {
		res, err := current.NewResultFromResult(conf.PrevResult)
		if err != nil {
			return nil, types.NewError(types.ErrDecodingFailure, "apiary-cni: cannot convert prevResult", err.Error())
		}
		conf.result = res
	}
	return conf, nil
}

// hostInterfaces are the names of the interfaces of res outside any
// sandbox: the host side of the pod's veth among them.
func hostInterfaces(res *current.Result) []string {
	var out []string
	for _, i := range res.Interfaces {
		if i.Sandbox == "" {
			out = append(out, i.Name)
		}
	}
	return out
}

// podAddrs are the addresses res gives the pod: those of its interfaces
// in a sandbox, or with no interface named.
func podAddrs(res *current.Result) ([]netip.Addr, error) {
	var out []netip.Addr
	for _, ip := range res.IPs {
		if ip.Interface != nil {
			i := *ip.Interface
			if i < 0 || i >= len(res.Interfaces) {
				return nil, fmt.Errorf("prevResult: address %s names interface %d of %d", ip.Address.IP, i, len(res.Interfaces))
			}
			if res.Interfaces[i].Sandbox == "" {
				continue
			}
		}
		a, ok := netip.AddrFromSlice(ip.Address.IP)
		if !ok {
			return nil, fmt.Errorf("prevResult: address %q", ip.Address.IP)
		}
		out = append(out, a.Unmap())
	}
	return out, nil
}
