package ipam

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/version"
)

// delegate is the IPAM plugin a CNI network configuration delegates to:
// its type and the configuration it is called with.
type delegate struct {
	// Plugin is the IPAM plugin's type (its binary's name).
	Plugin string `json:"plugin"`
	// Network is the network's name.
	Network string `json:"network"`
	// CNIVersion is the network's cniVersion.
	CNIVersion string `json:"cniVersion"`
	// IPAM is the ipam section, byte for byte, so that plugin-specific
	// fields (host-local's dataDir and ranges, say) reach the plugin.
	IPAM json.RawMessage `json:"ipam"`
}

// netConf is what the IPAM plugin reads on stdin.
type netConf struct {
	CNIVersion string          `json:"cniVersion"`
	Name       string          `json:"name"`
	IPAM       json.RawMessage `json:"ipam"`
	PrevResult json.RawMessage `json:"prevResult,omitempty"`
}

// stdin returns the plugin's configuration, with prevResult (in the
// network's cniVersion) for CHECK.
func (d *delegate) stdin(prevResult json.RawMessage) ([]byte, error) {
	return json.Marshal(netConf{CNIVersion: d.CNIVersion, Name: d.Network, IPAM: d.IPAM, PrevResult: prevResult})
}

// sameLease reports whether a plugin called with d and one called with o
// manage the same leases: same plugin, network and ipam section. The
// cniVersion may differ: it changes the protocol, not the leases.
func (d *delegate) sameLease(o *delegate) bool {
	if d == nil || o == nil {
		return false
	}
	return d.Plugin == o.Plugin && d.Network == o.Network && jsonEqual(d.IPAM, o.IPAM)
}

// supportsCheck reports whether the network's cniVersion has CHECK (≥ 0.4.0).
func (d *delegate) supportsCheck() bool {
	if d.CNIVersion == "" {
		return false
	}
	ok, err := version.GreaterThanOrEqualTo(d.CNIVersion, "0.4.0")
	return err == nil && ok
}

// errNoConf wraps the errors of a configuration file that is not there yet,
// which the retry loop treats as "wait for it".
var errNoConf = errors.New("CNI configuration not found")

// loadDelegate reads a CNI network configuration file (.conflist, or a
// single-plugin .conf) and returns the IPAM plugin of the first plugin that
// has an ipam section.
func loadDelegate(file string) (*delegate, error) {
	data, err := os.ReadFile(file)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s does not exist (yet?)", errNoConf, file)
	}
	if err != nil {
		return nil, fmt.Errorf("read CNI configuration: %w", err)
	}
	d, err := parseDelegate(data)
	if err != nil {
		return nil, fmt.Errorf("CNI configuration %s: %w", file, err)
	}
	return d, nil
}

// parseDelegate parses a CNI network configuration (conflist or single
// plugin conf) with libcni and picks the delegated IPAM plugin.
func parseDelegate(data []byte) (*delegate, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(data, &top); err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	var list *libcni.NetworkConfigList
	if _, ok := top["plugins"]; ok {
		l, err := libcni.NetworkConfFromBytes(data)
		if err != nil {
			return nil, err
		}
		list = l
	} else {
		// A .conf holds one plugin; libcni turns it into a list of one.
		conf, err := libcni.NetworkPluginConfFromBytes(data)
		if err != nil {
			return nil, err
		}
		l, err := libcni.ConfListFromConf(conf)
		if err != nil {
			return nil, err
		}
		list = l
	}
	if list.Name == "" {
		return nil, errors.New(`no network "name"`)
	}
	for i, p := range list.Plugins {
		if p.Network == nil || p.Network.IPAM.Type == "" {
			continue
		}
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(p.Bytes, &fields); err != nil {
			return nil, fmt.Errorf("plugin %d (%s): %w", i, p.Network.Type, err)
		}
		if strings.ContainsRune(p.Network.IPAM.Type, '/') {
			return nil, fmt.Errorf("plugin %d (%s): ipam type %q is not a plugin name", i, p.Network.Type, p.Network.IPAM.Type)
		}
		return &delegate{
			Plugin:     p.Network.IPAM.Type,
			Network:    list.Name,
			CNIVersion: list.CNIVersion,
			IPAM:       compactJSON(fields["ipam"]),
		}, nil
	}
	return nil, fmt.Errorf("no plugin of network %q has an ipam section with a type", list.Name)
}

func compactJSON(raw json.RawMessage) json.RawMessage {
	var buf bytes.Buffer
	if err := json.Compact(&buf, raw); err != nil {
		return raw
	}
	return buf.Bytes()
}

// jsonEqual compares two JSON documents by value, ignoring formatting and
// key order.
func jsonEqual(a, b json.RawMessage) bool {
	var va, vb any
	if json.Unmarshal(a, &va) != nil || json.Unmarshal(b, &vb) != nil {
		return bytes.Equal(a, b)
	}
	ja, _ := json.Marshal(va)
	jb, _ := json.Marshal(vb)
	return bytes.Equal(ja, jb)
}
