package reconcilers_test

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

func ipcEntry(prefix string, id uint32) *tables.IPCacheEntry {
	return &tables.IPCacheEntry{Prefix: netip.MustParsePrefix(prefix), Identity: id}
}

func mapEntries(t *testing.T, c *reconcilers.IPCache) map[string]uint32 {
	t.Helper()
	out := map[string]uint32{}
	if err := c.Dump(func(k bpf.IPCacheKey, v bpf.IPCacheValue) {
		p, err := k.Prefix()
		if err != nil {
			t.Fatal(err)
		}
		out[p.String()] = v.Identity
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestIPCacheOps writes, skips unchanged values, deletes, prunes, and reads
// the map back after a reopen.
func TestIPCacheOps(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	ctx := context.Background()
	c := reconcilers.NewIPCache(nil)
	if restored, err := c.Open(dir, 1024); err != nil || len(restored) != 0 {
		t.Fatalf("open: %v, %d restored", err, len(restored))
	}
	for _, e := range []*tables.IPCacheEntry{ipcEntry("10.0.0.0/8", 100), ipcEntry("fd00::/64", 101), ipcEntry("192.0.2.1/32", 0)} {
		if err := c.Update(ctx, nil, 0, e); err != nil {
			t.Fatal(err)
		}
	}
	if got := mapEntries(t, c); len(got) != 2 || got["10.0.0.0/8"] != 100 || got["fd00::/64"] != 101 {
		t.Fatalf("map %v", got)
	}
	// The same value again costs no write.
	u, _ := c.Writes()
	if err := c.Update(ctx, nil, 0, ipcEntry("10.0.0.0/8", 100)); err != nil {
		t.Fatal(err)
	}
	if u2, _ := c.Writes(); u2 != u {
		t.Errorf("unchanged entry written again: %d writes, was %d", u2, u)
	}
	// A batch: one new entry, one changed, one that loses its identity.
	batch := []reconciler.BatchEntry[*tables.IPCacheEntry]{
		{Object: ipcEntry("198.51.100.0/24", 102)},
		{Object: ipcEntry("10.0.0.0/8", 200)},
		{Object: ipcEntry("fd00::/64", 0)},
	}
	c.UpdateBatch(ctx, nil, batch)
	for _, b := range batch {
		if b.Result != nil {
			t.Fatal(b.Result)
		}
	}
	if got := mapEntries(t, c); len(got) != 2 || got["10.0.0.0/8"] != 200 || got["198.51.100.0/24"] != 102 {
		t.Fatalf("after batch: %v", got)
	}
	// Prune keeps only what the table holds.
	desired := func(yield func(*tables.IPCacheEntry, statedb.Revision) bool) {
		yield(ipcEntry("10.0.0.0/8", 200), 1)
	}
	if err := c.Prune(ctx, nil, desired); err != nil {
		t.Fatal(err)
	}
	if got := mapEntries(t, c); len(got) != 1 {
		t.Fatalf("after prune: %v", got)
	}
	c.Close()

	// Reopened, the map tells which identities the datapath uses; a
	// bigger size keeps the entries.
	c = reconcilers.NewIPCache(nil)
	restored, err := c.Open(dir, 2048)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if !slices.Equal(restored, []reconcilers.IPCacheRestored{{Prefix: netip.MustParsePrefix("10.0.0.0/8"), Identity: 200}}) {
		t.Errorf("restored %v", restored)
	}
	if err := c.Update(ctx, nil, 0, ipcEntry("10.0.0.0/8", 200)); err != nil {
		t.Fatal(err)
	}
	if u, d := c.Writes(); u != 0 || d != 0 {
		t.Errorf("%d writes, %d deletes for an entry the map held", u, d)
	}
}

// TestIPCacheOtherLayoutRefused pins an ipcache of another key size: Open
// fails with the layout and leaves the pin, rather than failing on reading
// it ("buffer too small").
func TestIPCacheOtherLayoutRefused(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	path := filepath.Join(dir, bpf.IPCacheMap)
	stale, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LPMTrie, KeySize: 8, ValueSize: 8, MaxEntries: 64,
		Flags: unix.BPF_F_NO_PREALLOC})
	if err != nil {
		t.Fatal(err)
	}
	defer stale.Close()
	if err := stale.Pin(path); err != nil {
		t.Fatal(err)
	}
	c := reconcilers.NewIPCache(nil)
	_, err = c.Open(dir, 1024)
	var layoutErr *bpf.LayoutError
	if !errors.As(err, &layoutErr) || !strings.HasPrefix(err.Error(), "pinned map ipcache has key size 8, want 24; value size 8, want 24: ") {
		t.Fatalf("got %v, want the layout of the pinned ipcache", err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("the refused pin is gone: %v", err)
	}
}
