package ipcache

import (
	"fmt"
	"io"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/reconcilers"
)

// Entry is one entry of the ipcache map, decoded.
type Entry struct {
	Key   bpf.IPCacheKey
	Value bpf.IPCacheValue
}

// WriteEntries prints entries sorted by prefix, one per line:
//
//	10.0.0.0/8 identity=16777217
//
// followed by tunnel=, key= and flags= when they are set, and cluster= for
// another cluster's entry.
func WriteEntries(w io.Writer, entries []Entry) error {
	type line struct {
		p    netip.Prefix
		text string
	}
	lines := make([]line, 0, len(entries))
	for _, e := range entries {
		p, err := e.Key.Prefix()
		text := ""
		if err != nil {
			text = fmt.Sprintf("invalid key %+v", e.Key)
		} else {
			text = fmt.Sprintf("%s identity=%d", p, e.Value.Identity)
		}
		if e.Key.ClusterID != 0 {
			text += fmt.Sprintf(" cluster=%d", e.Key.ClusterID)
		}
		if e.Value.TunnelEndpoint != ([16]byte{}) {
			var tun netip.Addr
			if e.Value.Flags&4 != 0 {
				tun = netip.AddrFrom16(e.Value.TunnelEndpoint)
			} else {
				tun = netip.AddrFrom4([4]byte(e.Value.TunnelEndpoint[:4]))
			}
			text += " tunnel=" + tun.String()
		}
		if e.Value.Key != 0 {
			text += fmt.Sprintf(" key=%d", e.Value.Key)
		}
		if e.Value.Flags != 0 {
			text += fmt.Sprintf(" flags=%#x", e.Value.Flags)
		}
		lines = append(lines, line{p, text})
	}
	slices.SortFunc(lines, func(a, b line) int {
		if c := comparePrefixes(a.p, b.p); c != 0 {
			return c
		}
		return strings.Compare(a.text, b.text)
	})
	for _, l := range lines {
		if _, err := fmt.Fprintln(w, l.text); err != nil {
			return err
		}
	}
	return nil
}

// WritePinned prints the entries of the ipcache map pinned in pinDir, as
// WriteEntries does, reading the map directly (`apiary bpf ipcache list`).
func WritePinned(w io.Writer, pinDir string) error {
	return WritePinnedMap(w, pinDir, bpf.IPCacheMap)
}

// WritePinnedMap is WritePinned for the map name, bpf.IPCacheMap or
// bpf.PolicyPrefixesMap (`apiary bpf policy-prefixes list`).
func WritePinnedMap(w io.Writer, pinDir, name string) error {
	path := filepath.Join(pinDir, name)
	m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	defer m.Close()
	if m.KeySize() != bpf.IPCacheKeySize || m.ValueSize() != bpf.IPCacheValueSize {
		return fmt.Errorf("%s: key/value sizes %d/%d, want %d/%d", path, m.KeySize(), m.ValueSize(),
			bpf.IPCacheKeySize, bpf.IPCacheValueSize)
	}
	var (
		entries []Entry
		k       bpf.IPCacheKey
		v       bpf.IPCacheValue
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		entries = append(entries, Entry{k, v})
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	return WriteEntries(w, entries)
}

// scriptCommands provides ipcache/dump and policy-prefixes/dump.
func scriptCommands(ops *reconcilers.IPCache, pp policyPrefixesOps) hive.ScriptCmdsOut {
	dump := func(name string, ops *reconcilers.IPCache) script.Cmd {
		return script.Command(
			script.CmdUsage{
				Summary: "Print the entries of the " + name + " map",
				Detail: []string{
					"Prints one line per entry of the pinned map, read from the kernel,",
					"sorted by prefix, as `apiary bpf " + strings.ReplaceAll(name, "_", "-") + " list` does:",
					"  <prefix> identity=<id>",
				},
			},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) > 0 {
					return nil, script.ErrUsage
				}
				var entries []Entry
				if err := ops.Dump(func(k bpf.IPCacheKey, v bpf.IPCacheValue) { entries = append(entries, Entry{k, v}) }); err != nil {
					return nil, fmt.Errorf("dump %s: %w", name, err)
				}
				return func(*script.State) (string, string, error) {
					var out strings.Builder
					err := WriteEntries(&out, entries)
					return out.String(), "", err
				}, nil
			})
	}
	return hive.NewScriptCmds(map[string]script.Cmd{
		"ipcache/dump":         dump(bpf.IPCacheMap, ops),
		"policy-prefixes/dump": dump(bpf.PolicyPrefixesMap, pp.IPCache),
	})
}
