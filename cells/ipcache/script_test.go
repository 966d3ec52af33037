package ipcache_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/tables"
)

func TestScript(t *testing.T) {
	apiarytest.RunCells(t, "testdata/*.txtar", identity.Cell, ipcache.Cell, scriptTestCell)
}

// TestScriptExhausted runs testdata/exhausted/*.txtar with a local range of
// two numbers.
func TestScriptExhausted(t *testing.T) {
	apiarytest.RunCells(t, "testdata/exhausted/*.txtar", identity.Cell, ipcache.Cell, scriptTestCell,
		cell.Invoke(func(a *identity.Allocator) { a.LimitLocal(2) }))
}

// scriptTestCell adds commands that label prefixes through the Prefixes
// interface, as the owners in other cells (policies, pods, IPAM, DNS) do:
//
//	prefixes/upsert PREFIX OWNER LABEL...
//	prefixes/delete PREFIX OWNER
//	prefixes/wait            waits until the last change is in the map
//	prefixes/synced          the test owner's initial prefixes are in; waits
//	                         for the other owners (the node's addresses) too
//	checkpoint/corrupt       overwrites the identity checkpoint with garbage
//	checkpoint/remove        removes it
var scriptTestCell = cell.Provide(func(p ipcache.Prefixes, nc node.Config, db *statedb.DB, table statedb.Table[*tables.PrefixLabels]) hive.ScriptCmdsOut {
	var last ipcache.Revision
	// The test is an owner like any other: the map is not pruned before
	// it says its prefixes are in.
	synced := p.RegisterInitializer("test")
	checkpoint := filepath.Join(nc.StateDir, identity.CheckpointFile)
	return hive.NewScriptCmds(map[string]script.Cmd{
		"prefixes/synced": script.Command(
			script.CmdUsage{Summary: "Say that the test owner's initial prefixes are in"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				synced()
				// The node's addresses are added by a job of their own; once
				// every owner has synced, the next prefixes/wait covers them.
				txn := db.ReadTxn()
				init, initialized := table.Initialized(txn)
				if !init {
					select {
					case <-initialized:
					case <-time.After(10 * time.Second):
						return nil, fmt.Errorf("prefixes not initialized: %v", table.PendingInitializers(db.ReadTxn()))
					}
				}
				last = max(last, table.Revision(db.ReadTxn()))
				return nil, nil
			}),
		"checkpoint/corrupt": script.Command(
			script.CmdUsage{Summary: "Overwrite the identity checkpoint with garbage"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				return nil, os.WriteFile(checkpoint, []byte("{\"version\":1,\"identities\":[{\"id\":"), 0o600)
			}),
		"checkpoint/remove": script.Command(
			script.CmdUsage{Summary: "Remove the identity checkpoint"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				return nil, os.Remove(checkpoint)
			}),
		"prefixes/upsert": script.Command(
			script.CmdUsage{Summary: "Label a prefix for an owner", Args: "prefix owner label..."},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) < 3 {
					return nil, script.ErrUsage
				}
				pfx, err := parsePrefix(args[0])
				if err != nil {
					return nil, err
				}
				last, err = p.Update(ipcache.Upsert(pfx, args[1], args[2:]...))
				return nil, err
			}),
		"prefixes/delete": script.Command(
			script.CmdUsage{Summary: "Remove an owner's labels from a prefix", Args: "prefix owner"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				pfx, err := parsePrefix(args[0])
				if err != nil {
					return nil, err
				}
				last, err = p.Update(ipcache.Delete(pfx, args[1]))
				return nil, err
			}),
		"prefixes/wait": script.Command(
			script.CmdUsage{Summary: "Wait until the last change is written to the ipcache map"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				ctx, cancel := context.WithTimeout(s.Context(), 10*time.Second)
				defer cancel()
				return nil, p.Wait(ctx, last)
			}),
	})
})

func parsePrefix(s string) (netip.Prefix, error) {
	if p, err := netip.ParsePrefix(s); err == nil {
		return p, nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%q is neither a prefix nor an address", s)
	}
	return tables.HostPrefix(a), nil
}
