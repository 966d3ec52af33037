package ipam

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"

	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/types/create"
)

// pickIPs returns the first IPv4 address of an ADD result and, if ipv6,
// its first IPv6 address. The agent needs one address of each family it
// runs per kind; other addresses in the result stay with the lease and are
// released with it.
func pickIPs(res types.Result, ipv6 bool) (v4, v6 netip.Addr, err error) {
	if res == nil {
		return v4, v6, errors.New("no result")
	}
	r, err := types100.NewResultFromResult(res)
	if err != nil {
		return v4, v6, fmt.Errorf("convert result: %w", err)
	}
	var all []string
	for _, ipc := range r.IPs {
		if ipc == nil || ipc.Address.IP == nil {
			continue
		}
		addr, ok := netip.AddrFromSlice(ipc.Address.IP)
		if !ok {
			continue
		}
		addr = addr.Unmap()
		all = append(all, addr.String())
		switch {
		case addr.IsUnspecified() || addr.IsMulticast():
		case addr.Is4() && !v4.IsValid():
			v4 = addr
		case addr.Is6() && !v6.IsValid():
			v6 = addr
		}
	}
	switch {
	case len(all) == 0:
		return netip.Addr{}, netip.Addr{}, errors.New("the plugin's result has no IP address")
	case !v4.IsValid():
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("the plugin's result has no IPv4 address (only %v)", all)
	case ipv6 && !v6.IsValid():
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("the plugin's result has no IPv6 address, which --enable-ipv6 needs (only %v)", all)
	case !ipv6:
		v6 = netip.Addr{}
	}
	return v4, v6, nil
}

// parseResult decodes a result as the plugin printed it for cniVersion and
// picks its IPs, as the ADD path does (the fuzz target).
func parseResult(cniVersion string, data []byte, ipv6 bool) (v4, v6 netip.Addr, err error) {
	res, err := create.Create(cniVersion, data)
	if err != nil {
		return v4, v6, err
	}
	return pickIPs(res, ipv6)
}

// resultJSON encodes a result for the record, in its own version.
func resultJSON(res types.Result) (json.RawMessage, error) {
	return json.Marshal(res)
}

// prevResult converts a recorded result to cniVersion, for CHECK's
// prevResult.
func prevResult(recorded json.RawMessage, cniVersion string) (json.RawMessage, error) {
	res, err := create.CreateFromBytes(recorded)
	if err != nil {
		return nil, fmt.Errorf("recorded result: %w", err)
	}
	conv, err := res.GetAsVersion(cniVersion)
	if err != nil {
		return nil, fmt.Errorf("recorded result as version %s: %w", cniVersion, err)
	}
	return json.Marshal(conv)
}
