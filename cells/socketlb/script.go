package socketlb

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/apiary-net/apiary/bpf"
)

// scriptCommands provides socketlb/affinity to script tests and the shell.
func scriptCommands(a *attacher) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"socketlb/affinity": affinityCmd(a),
	})
}

func affinityCmd(a *attacher) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Print the session affinity entries of the socket LB",
			Detail: []string{
				"Prints one line per entry of lb4_affinity and lb6_affinity, sorted:",
				"  lb4_affinity NETNS=4026531840 ID=3 BEID=7",
				"the client's network namespace cookie, the service ID and the",
				"backend ID it sticks to (while the entry is fresh).",
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 0 {
				return nil, script.ErrUsage
			}
			lines, err := a.affinityEntries()
			if err != nil {
				return nil, err
			}
			out := strings.Join(lines, "")
			return func(*script.State) (string, string, error) { return out, "", nil }, nil
		})
}

// affinityEntries returns the entries of the affinity maps, a sorted line
// each.
func (a *attacher) affinityEntries() ([]string, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	aff4, aff6 := a.own[bpf.LB4AffinityMap], a.own[bpf.LB6AffinityMap]
	if aff4 == nil || aff6 == nil {
		return nil, errors.New("the socket LB programs are not attached")
	}
	var lines []string
	line := func(name string, netns uint64, revNat bpf.Be16, v bpf.LBAffinityValue) {
		lines = append(lines, fmt.Sprintf("%s NETNS=%d ID=%d BEID=%d\n", name, netns, revNat.Uint16(), v.BackendID))
	}
	err4 := bpf.Walk(aff4, walkBatch, func(keys []bpf.LB4AffinityKey, values []bpf.LBAffinityValue) error {
		for i, k := range keys {
			line(bpf.LB4AffinityMap, k.ClientID, k.RevNat, values[i])
		}
		return nil
	})
	err6 := bpf.Walk(aff6, walkBatch, func(keys []bpf.LB6AffinityKey, values []bpf.LBAffinityValue) error {
		for i, k := range keys {
			line(bpf.LB6AffinityMap, binary.NativeEndian.Uint64(k.ClientID[:8]), k.RevNat, values[i])
		}
		return nil
	})
	if err := errors.Join(err4, err6); err != nil {
		return nil, fmt.Errorf("read the affinity maps: %w", err)
	}
	slices.Sort(lines)
	return lines, nil
}
