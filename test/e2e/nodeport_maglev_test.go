package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/testenv"
)

// TestNodePortMaglev: with --lb-algorithm=maglev the agent computes a
// Maglev table for every north-south frontend (the nodeport-maglev table,
// each row reconciled into lb_maglev) and the programs pick backends from
// them: the outside client reaches the local and the remote backend over
// TCP and UDP, IPv4 and IPv6. A table size that is no prime stops the
// agent with a clear error before it touches anything.
func TestNodePortMaglev(t *testing.T) {
	t.Run("table size not a prime", func(t *testing.T) {
		testenv.RequireRoot(t)
		dir := t.TempDir()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, apiaryBin, "agent", "--enable-nodeport", "--lb-algorithm=maglev", "--lb-maglev-table-size=16384",
			"--api-addr=127.0.0.1:0", "--state-dir="+filepath.Join(dir, "state"), "--bpf-pin-dir="+testenv.BPFPinDir(t), "--config-dir="+dir)
		cmd.Env = cleanEnv()
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), "--lb-maglev-table-size: maglev table size 16384 is not a prime") {
			t.Errorf("agent with --lb-maglev-table-size=16384: %v, want an exit naming the flag\n%s", err, out)
		}
	})

	s := setupNodePort(t, "", "auto")
	s.a.restart(t, "--lb-algorithm=maglev", "--lb-maglev-table-size=1021")
	testenv.Eventually(t, waitTimeout, "a reconciled Maglev table for each node port frontend", func() (bool, string) {
		var rows []struct {
			Frontend string
			ID       int
			Backends []string
			Status   struct{ Kind string }
		}
		if err := s.a.dump("nodeport-maglev", &rows); err != nil {
			return false, err.Error()
		}
		done := map[string]bool{}
		for _, r := range rows {
			if r.Status.Kind == "Done" && len(r.Backends) == 1 {
				done[r.Frontend] = true
			}
		}
		for _, fe := range []string{npNode4 + ":30081/TCP", npNode4 + ":30082/UDP", "[" + npNode6 + "]:30081/TCP", "[" + npNode6 + "]:30082/UDP"} {
			if !done[fe] {
				return false, fmt.Sprintf("%s not done: %+v", fe, rows)
			}
		}
		return true, ""
	})
	for _, tc := range []struct {
		addr, seen string
	}{
		{npNode4 + ":30081", npClient4},
		{npNode4 + ":30082", npRemoteGw4},
		{"[" + npNode6 + "]:30081", npClient6},
		{"[" + npNode6 + "]:30082", npRemoteGw6},
	} {
		testenv.Eventually(t, waitTimeout, "TCP to "+tc.addr, func() (bool, string) {
			got := s.client.run(t, connectEnv+"="+tc.addr)
			return got == "ok: hello "+tc.seen, got
		})
		if got := s.client.run(t, npUDPEnv+"="+tc.addr); got != "hello "+tc.seen {
			t.Errorf("UDP to %s: %q", tc.addr, got)
		}
	}
}
