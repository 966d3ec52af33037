package policy

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// Endpoint is one entry of policy_endpoints, decoded.
type Endpoint struct {
	CgroupID uint64
	Value    bpf.PolicyEndpointValue
}

// Entry is one entry of the policy map, decoded.
type Entry struct {
	Key   bpf.PolicyKey
	Value bpf.PolicyValue
}

// ReadPinned reads the policy maps pinned in pinDir (read-only).
func ReadPinned(pinDir string) ([]Endpoint, []Entry, error) {
	return readMaps(pinDir, func(name string) (bpf.Map, error) {
		return ebpf.LoadPinnedMap(filepath.Join(pinDir, name), &ebpf.LoadPinOptions{ReadOnly: true})
	})
}

// ReadMaps reads the policy maps pinned in pinDir through opener: the
// kernel's (bpf.KernelMaps) or a test's in memory.
func ReadMaps(opener bpf.Opener, pinDir string) ([]Endpoint, []Entry, error) {
	return readMaps(pinDir, func(name string) (bpf.Map, error) { return opener.LoadMap(pinDir, name) })
}

func readMaps(pinDir string, load func(name string) (bpf.Map, error)) ([]Endpoint, []Entry, error) {
	var eps []Endpoint
	var entries []Entry
	err := withPinned(pinDir, bpf.PolicyEndpointsMap, load, func(m bpf.Map) error {
		return bpf.Walk(m, 1024, func(keys []uint64, values []bpf.PolicyEndpointValue) error {
			for i, k := range keys {
				eps = append(eps, Endpoint{k, values[i]})
			}
			return nil
		})
	})
	if err != nil {
		return nil, nil, err
	}
	err = withPinned(pinDir, bpf.PolicyMap, load, func(m bpf.Map) error {
		return bpf.Walk(m, 1024, func(keys []bpf.PolicyKey, values []bpf.PolicyValue) error {
			for i, k := range keys {
				entries = append(entries, Entry{k, values[i]})
			}
			return nil
		})
	})
	return eps, entries, err
}

func withPinned(pinDir, name string, load func(string) (bpf.Map, error), fn func(bpf.Map) error) error {
	path := filepath.Join(pinDir, name)
	m, err := load(name)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s: not pinned (has the agent run with policy enforcement?)", path)
	}
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	defer m.Close()
	if err := fn(m); err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	return nil
}

// WriteEntries prints the endpoints and their entries, sorted: for each
// endpoint a line
//
//	endpoint 3 cgroup 1234 enforce=ingress,egress
//
// then one line per entry,
//
//	egress identity=256 TCP/80-95 allow
//
// identity=any for identity 0, "allow pod-addrs" for an allow that matches
// pods' addresses too (bpf.PolicyFlagPodAddrs), " final" after the verdict
// of an entry that decides alone (bpf.PolicyFlagFinal), "pass" for one that
// decides nothing (bpf.PolicyFlagPass). endpointID, when not 0,
// keeps one endpoint
// (an error if the maps do not have it).
// Entries of an endpoint without a policy_endpoints entry (not enforced
// yet) are printed under "endpoint N (no cgroup)".
func WriteEntries(w io.Writer, eps []Endpoint, entries []Entry, endpointID uint32) error {
	byID := map[uint32][]Entry{}
	for _, e := range entries {
		if endpointID == 0 || e.Key.EndpointID == endpointID {
			byID[e.Key.EndpointID] = append(byID[e.Key.EndpointID], e)
		}
	}
	heads := map[uint32]string{}
	for _, ep := range eps {
		if ep.Value.Flags&bpf.PolicyPodTree != 0 {
			if endpointID == 0 {
				if _, err := fmt.Fprintf(w, "pod tree cgroup %d denies the pods below it in no endpoint\n", ep.CgroupID); err != nil {
					return err
				}
			}
			continue
		}
		id := ep.Value.EndpointID
		if endpointID != 0 && id != endpointID {
			continue
		}
		var on []string
		if ep.Value.Flags&bpf.PolicyEnforceIngress != 0 {
			on = append(on, "ingress")
		}
		if ep.Value.Flags&bpf.PolicyEnforceEgress != 0 {
			on = append(on, "egress")
		}
		if len(on) == 0 {
			on = append(on, "none")
		}
		h := fmt.Sprintf("endpoint %d cgroup %d enforce=%s", id, ep.CgroupID, strings.Join(on, ","))
		if ep.Value.Flags&bpf.PolicyAudit != 0 {
			h += " audit"
		}
		heads[id] = h
		if _, ok := byID[id]; !ok {
			byID[id] = nil
		}
	}
	if endpointID != 0 && len(byID) == 0 {
		return fmt.Errorf("endpoint %d is not in the policy maps", endpointID)
	}
	ids := slices.Sorted(maps.Keys(byID))
	for _, id := range ids {
		h, ok := heads[id]
		if !ok {
			h = fmt.Sprintf("endpoint %d (no cgroup)", id)
		}
		if _, err := fmt.Fprintln(w, h); err != nil {
			return err
		}
		list := byID[id]
		slices.SortFunc(list, func(a, b Entry) int {
			return cmp.Or(
				cmp.Compare(a.Key.Egress, b.Key.Egress),
				cmp.Compare(a.Key.Identity, b.Key.Identity),
				cmp.Compare(a.Key.Protocol, b.Key.Protocol),
				cmp.Compare(a.Key.Port.Uint16(), b.Key.Port.Uint16()),
				cmp.Compare(a.Key.PrefixLen, b.Key.PrefixLen),
			)
		})
		for _, e := range list {
			dir := "ingress"
			if e.Key.Egress == bpf.PolicyEgress {
				dir = "egress"
			}
			peer := "any"
			if e.Key.Identity != 0 {
				peer = fmt.Sprint(e.Key.Identity)
			}
			verdict := "allow"
			switch {
			case e.Value.Flags&bpf.PolicyFlagDeny != 0:
				verdict = "deny"
			case e.Value.Flags&bpf.PolicyFlagPodAddrs != 0:
				verdict = "allow pod-addrs"
			}
			switch {
			case e.Value.Flags&bpf.PolicyFlagPass != 0:
				verdict = "pass"
			case e.Value.Flags&bpf.PolicyFlagFinal != 0:
				verdict += " final"
			}
			if _, err := fmt.Fprintf(w, "  %s identity=%s %s %s\n", dir, peer,
				tables.PortPrefixString(e.Key.Protocol, e.Key.Port.Uint16(), uint8(e.Key.PortBits())), verdict); err != nil {
				return err
			}
		}
	}
	return nil
}
