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

// pickIP returns the first IPv4 address of an ADD result. The agent needs
// one IPv4 address per kind; other addresses in the result (IPv6, further
// IPv4 ones) stay with the lease and are released with it.
func pickIP(res types.Result) (netip.Addr, error) {
	if res == nil {
		return netip.Addr{}, errors.New("no result")
	}
	r, err := types100.NewResultFromResult(res)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("convert result: %w", err)
	}
	var others []string
	for _, ipc := range r.IPs {
		if ipc == nil || ipc.Address.IP == nil {
			continue
		}
		addr, ok := netip.AddrFromSlice(ipc.Address.IP)
		if !ok {
			continue
		}
		addr = addr.Unmap()
		if addr.Is4() && !addr.IsUnspecified() {
			return addr, nil
		}
		others = append(others, addr.String())
	}
	if len(others) == 0 {
		return netip.Addr{}, errors.New("the plugin's result has no IP address")
	}
	return netip.Addr{}, fmt.Errorf("the plugin's result has no IPv4 address (only %v)", others)
}

// parseResult decodes a result as the plugin printed it for cniVersion and
// picks its IP, as the ADD path does (the fuzz target).
func parseResult(cniVersion string, data []byte) (netip.Addr, error) {
	res, err := create.Create(cniVersion, data)
	if err != nil {
		return netip.Addr{}, err
	}
	return pickIP(res)
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
