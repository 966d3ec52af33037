package fqdn_test

import (
	"os"
	"testing"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/selectors"
)

// TestScript runs testdata/*.txtar against hives with the DNS proxy on a
// random loopback port forwarding to an in-test upstream, which scripts
// fill with
//
//	dns/set NAME RECORD...   e.g. dns/set www.cilium.io '60 IN A 192.0.2.1'
func TestScript(t *testing.T) {
	up := startUpstream(t)
	// Flags from the environment: a script's `#!` line cannot know the
	// upstream's port. Scripts run in parallel, hence no t.Setenv.
	os.Setenv("APIARY_DNS_UPSTREAM", up.addr)
	os.Setenv("APIARY_DNS_PROXY_ADDR", "127.0.0.1:0")
	// Scripts check that an answer waits for the map; how long the map
	// takes depends on the machine's load, so they may wait long (delay.txtar
	// sets its own bound on its #! line).
	os.Setenv("APIARY_TOFQDNS_PROXY_RESPONSE_MAX_DELAY", "10s")
	t.Cleanup(func() {
		os.Unsetenv("APIARY_DNS_UPSTREAM")
		os.Unsetenv("APIARY_DNS_PROXY_ADDR")
		os.Unsetenv("APIARY_TOFQDNS_PROXY_RESPONSE_MAX_DELAY")
	})
	apiarytest.Run(t, "testdata/*.txtar", func(fakeClient cell.Cell) []cell.Cell {
		return []cell.Cell{infra.Cell, fakeClient, identity.Cell, ipcache.Cell, selectors.Cell, fqdn.Cell}
	}, apiarytest.MemoryMaps(), apiarytest.WithCommand("dns/set", func(func() (string, error)) script.Cmd {
		return script.Command(
			script.CmdUsage{Summary: "Set the records of a name in the test's upstream DNS server", Args: "name record..."},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) < 1 {
					return nil, script.ErrUsage
				}
				return nil, up.setErr(args[0], args[1:]...)
			})
	}),
		// The scripts share the upstream and set the same names in it.
		apiarytest.Sequential())
}
