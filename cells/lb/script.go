package lb

import (
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/reconcilers"
)

// scriptCommands provides lb/maps-dump and lb/map-ops to script tests and
// the shell.
func scriptCommands(ops *reconcilers.LB) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"lb/maps-dump": dumpCmd(ops),
		"lb/map-ops":   mapOpsCmd(ops),
	})
}

func dumpCmd(ops *reconcilers.LB) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Print the entries of the load-balancing maps",
			Args:    "[file]",
			Detail: []string{
				"Prints one line per entry of lb4_services, lb4_backends and",
				"lb4_reverse_nat, sorted, as `apiary bpf lb list` does; into file",
				"(relative to the work directory) when one is given.",
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) > 1 {
				return nil, script.ErrUsage
			}
			var out strings.Builder
			err := ops.Maps(func(m reconcilers.LBMaps) error {
				return reconcilers.WriteLBMaps(&out, m)
			})
			if err != nil {
				return nil, err
			}
			if len(args) == 1 {
				return nil, os.WriteFile(s.Path(args[0]), []byte(out.String()), 0o644)
			}
			return func(*script.State) (string, string, error) { return out.String(), "", nil }, nil
		})
}

func mapOpsCmd(ops *reconcilers.LB) script.Cmd {
	var mu sync.Mutex
	var last [len(bpf.LBMapNames)][2]uint64
	return script.Command(
		script.CmdUsage{
			Summary: "Print the load-balancing map operations since the last call",
			Detail: []string{
				"Prints, per map, the updates and deletes the reconciler made since",
				"the previous lb/map-ops (or since start):",
				"  lb4_services: updates=2 deletes=0",
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			mu.Lock()
			defer mu.Unlock()
			var out strings.Builder
			for i, name := range bpf.LBMapNames {
				up, del := ops.Ops.Get(name, false), ops.Ops.Get(name, true)
				fmt.Fprintf(&out, "%s: updates=%d deletes=%d\n", name, up-last[i][0], del-last[i][1])
				last[i] = [2]uint64{up, del}
			}
			return func(*script.State) (string, string, error) { return out.String(), "", nil }, nil
		})
}

// registerMetrics exports the map operation counts as
// apiary_lb_map_operations_total{map, op}.
func registerMetrics(reg prometheus.Registerer, ops *reconcilers.LB) error {
	for _, name := range bpf.LBMapNames {
		for _, del := range []bool{false, true} {
			op := "update"
			if del {
				op = "delete"
			}
			c := prometheus.NewCounterFunc(prometheus.CounterOpts{
				Namespace:   metrics.Namespace,
				Subsystem:   "lb",
				Name:        "map_operations_total",
				Help:        "Entries updated or deleted in the load-balancing maps, batched or not",
				ConstLabels: prometheus.Labels{"map": name, "op": op},
			}, func() float64 { return float64(ops.Ops.Get(name, del)) })
			if err := reg.Register(c); err != nil {
				return err
			}
		}
	}
	return nil
}
