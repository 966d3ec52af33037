package e2e

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"

	"github.com/apiary-net/apiary/internal/testenv"
)

type ctMapRow struct {
	Name             string `json:"name"`
	MaxEntries       int    `json:"maxEntries"`
	SizedBy          string `json:"sizedBy"`
	ActualMaxEntries int    `json:"actualMaxEntries"`
	Pin              string `json:"pin"`
	Copied           int    `json:"copied"`
	Status           struct {
		Kind string `json:"kind"`
	} `json:"status"`
}

// waitCTMaps waits until `apiary db show ct-maps -o json` shows each map
// with the wanted "maxEntries actualMaxEntries pin copied status".
func (a *agent) waitCTMaps(t *testing.T, want map[string]string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, fmt.Sprintf("ct-maps %v", want), func() (bool, string) {
		var rows []ctMapRow
		if err := a.showJSON("ct-maps", &rows); err != nil {
			return false, err.Error()
		}
		got := map[string]string{}
		for _, r := range rows {
			got[r.Name] = fmt.Sprintf("maxEntries=%d actual=%d pin=%s copied=%d %s",
				r.MaxEntries, r.ActualMaxEntries, r.Pin, r.Copied, r.Status.Kind)
		}
		return fmt.Sprint(got) == fmt.Sprint(want), fmt.Sprintf("got  %v\nwant %v", got, want)
	})
}

// ctEntries returns `apiary bpf ct list` without the remaining lifetimes
// (which tick): protocol, direction, addresses, flags and counters.
func (a *agent) ctEntries(t *testing.T) []string {
	t.Helper()
	out, err := a.bpf("ct", "list")
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for line := range strings.Lines(out) {
		f := slices.DeleteFunc(strings.Fields(line), func(s string) bool { return strings.HasPrefix(s, "remaining=") })
		lines = append(lines, strings.Join(f, " "))
	}
	return lines
}

// TestConntrackResize: entries the datapath put in the pinned conntrack
// maps survive a restart that grows ct4_global, and ct-maps shows the new
// size.
func TestConntrackResize(t *testing.T) {
	t.Parallel()
	a := startAgent(t, agentOptions{flags: []string{"--bpf-ct-global-tcp-max=4096", "--bpf-ct-global-any-max=2048"}})
	a.waitCTMaps(t, map[string]string{
		"ct4_global":     "maxEntries=4096 actual=4096 pin=created copied=0 Done",
		"ct_any4_global": "maxEntries=2048 actual=2048 pin=created copied=0 Done",
	})

	// Play the datapath: 50 TCP connections and a UDP flow, alive for an
	// hour, written into the pinned maps while the agent runs.
	now, err := bpf.CTClockNow()
	if err != nil {
		t.Fatal(err)
	}
	entry := bpf.CTEntry{Lifetime: now + 3600, RxPackets: 3, RxBytes: 180, TxPackets: 2, TxBytes: 120, Flags: bpf.CTSeenNonSyn}
	put := func(mapName string, key bpf.CTKey4) {
		m, err := ebpf.LoadPinnedMap(filepath.Join(a.pinDir, mapName), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		if err := m.Put(key, entry); err != nil {
			t.Fatalf("write %s: %v", mapName, err)
		}
	}
	for i := range 50 {
		put(bpf.CT4GlobalMap, bpf.CTKey4{
			DAddr: [4]byte{10, 0, 0, 1}, SAddr: [4]byte{10, 0, 1, byte(i)},
			DPort: bpf.NewBe16(uint16(30000 + i)), SPort: bpf.NewBe16(80), NextHdr: unix.IPPROTO_TCP,
		})
	}
	put(bpf.CTAny4GlobalMap, bpf.CTKey4{
		DAddr: [4]byte{10, 0, 0, 1}, SAddr: [4]byte{10, 0, 2, 53},
		DPort: bpf.NewBe16(5353), SPort: bpf.NewBe16(53), NextHdr: unix.IPPROTO_UDP,
	})
	before := a.ctEntries(t)
	if n := countPrefix(before, "TCP "); n != 50 {
		t.Fatalf("apiary bpf ct list shows %d TCP entries, want the 50 written:\n%s", n, strings.Join(before, "\n"))
	}
	if n := countPrefix(before, "UDP "); n != 1 {
		t.Fatalf("apiary bpf ct list shows %d UDP entries, want the 1 written:\n%s", n, strings.Join(before, "\n"))
	}

	// Twice the TCP entries: the map is replaced by a bigger one holding
	// the same connections; the other map is kept as it is.
	a.restart(t, "--bpf-ct-global-tcp-max=8192")
	a.waitCTMaps(t, map[string]string{
		"ct4_global":     "maxEntries=8192 actual=8192 pin=replaced copied=50 Done",
		"ct_any4_global": "maxEntries=2048 actual=2048 pin=reused copied=0 Done",
	})
	if after := a.ctEntries(t); !slices.Equal(after, before) {
		t.Fatalf("apiary bpf ct list after the resize:\n%s\nwant as before:\n%s", strings.Join(after, "\n"), strings.Join(before, "\n"))
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.pinDir, bpf.CT4GlobalMap), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.MaxEntries() != 8192 {
		t.Errorf("the pinned ct4_global has %d max entries, want 8192", m.MaxEntries())
	}
}

func countPrefix(lines []string, prefix string) int {
	n := 0
	for _, l := range lines {
		if strings.HasPrefix(l, prefix) {
			n++
		}
	}
	return n
}
