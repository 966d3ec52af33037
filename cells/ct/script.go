package ct

import (
	"fmt"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/reconcilers"
)

// scriptCommands provides ct/dump and ct/gc to script tests and the shell.
func scriptCommands(maps *reconcilers.CTMaps, g *gc) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"ct/dump": dumpCmd(maps),
		"ct/gc":   gcCmd(g),
	})
}

func dumpCmd(maps *reconcilers.CTMaps) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Print the entries of the conntrack maps",
			Args:    "[map...]",
			Detail: []string{
				"Prints one line per entry of the named maps, or of every open",
				"conntrack map, sorted, as `apiary bpf ct list` does.",
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			names := args
			if len(names) == 0 {
				names = maps.Names()
			}
			now, err := bpf.CTClockNow()
			if err != nil {
				return nil, err
			}
			var out strings.Builder
			for _, name := range names {
				if err := maps.Use(name, func(m bpf.Map) error { return WriteEntries(&out, m, now) }); err != nil {
					return nil, err
				}
			}
			return func(*script.State) (string, string, error) { return out.String(), "", nil }, nil
		})
}

func gcCmd(g *gc) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Delete expired conntrack entries now",
			Detail: []string{
				"Runs a garbage collection of every reconciled conntrack map, as the",
				"GC job does on its interval, and prints per map:",
				"  <map>: deleted <n> expired of <m> entries",
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) > 0 {
				return nil, script.ErrUsage
			}
			results, err := g.collect(s.Context())
			if err != nil {
				return nil, err
			}
			var out strings.Builder
			for _, r := range results {
				fmt.Fprintf(&out, "%s: deleted %d expired of %d entries\n", r.name, r.deleted, r.scanned)
			}
			return func(*script.State) (string, string, error) { return out.String(), "", nil }, nil
		})
}
