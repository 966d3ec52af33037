package ipam_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// TestIPsResolveToReservedIdentities runs IPAM with the ipcache: the health
// IP resolves to identity 4 and the ingress IP to identity 8, under the
// owners ipam/health and ipam/ingress; disabling ingress withdraws its
// prefix.
func TestIPsResolveToReservedIdentities(t *testing.T) {
	e := newEnv(t)
	e.writeConflist(t, "1.0.0", e.hostLocalIPAM("host-local", "10.77.0.0/24"))
	pinDir := testenv.BPFPinDir(t)

	start := func(health, ingress bool) (*statedb.DB, statedb.Table[*tables.IPCacheEntry], func()) {
		var db *statedb.DB
		var cache statedb.Table[*tables.IPCacheEntry]
		log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelInfo))
		h, err := newHive(log, e.flags(health, ingress, "--bpf-pin-dir="+pinDir),
			metrics.Cell, bpffs.Cell, identity.Cell, ipcache.Cell,
			cell.Invoke(func(d *statedb.DB, c statedb.Table[*tables.IPCacheEntry]) { db, cache = d, c }))
		if err != nil {
			t.Fatal(err)
		}
		if err := h.Start(log, context.Background()); err != nil {
			t.Fatal(err)
		}
		return db, cache, func() { h.Stop(log, context.Background()) }
	}
	// identities returns the identity of each agent IP prefix by owner.
	identities := func(db *statedb.DB, cache statedb.Table[*tables.IPCacheEntry]) map[string]uint32 {
		got := map[string]uint32{}
		for entry := range cache.All(db.ReadTxn()) {
			for _, owner := range entry.Owners {
				if owner == tables.AgentIPOwner("health") || owner == tables.AgentIPOwner("ingress") {
					got[owner] = entry.Identity
				}
			}
		}
		return got
	}
	wait := func(db *statedb.DB, cache statedb.Table[*tables.IPCacheEntry], want map[string]uint32) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		var got map[string]uint32
		for time.Now().Before(deadline) {
			got = identities(db, cache)
			if len(got) == len(want) && got["ipam/health"] == want["ipam/health"] && got["ipam/ingress"] == want["ipam/ingress"] {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Fatalf("agent IP identities: got %v, want %v", got, want)
	}

	db, cache, stop := start(true, true)
	wait(db, cache, map[string]uint32{"ipam/health": 4, "ipam/ingress": 8})
	stop()

	db, cache, stop = start(true, false)
	defer stop()
	wait(db, cache, map[string]uint32{"ipam/health": 4})
}
