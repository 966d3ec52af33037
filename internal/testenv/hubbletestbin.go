package testenv

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// HubbleTestbinEnv names a directory holding the hubble CLI the tests
// run; unset, it is where scripts/hubble-testbin/build.sh puts it.
const HubbleTestbinEnv = "APIARY_HUBBLE_TESTBIN"

// HubbleTestbinDir returns where scripts/hubble-testbin/build.sh puts the
// hubble CLI for the repository at repoRoot: $APIARY_HUBBLE_TESTBIN, or
// its cache directory keyed as build.sh keys it (the first 16 hex digits
// of the SHA-256 of go.sum followed by build.sh).
func HubbleTestbinDir(repoRoot string) (string, error) {
	return testbinDir(repoRoot, "hubble-testbin", HubbleTestbinEnv, "go.sum", "build.sh")
}

// RequireHubble returns the path of the hubble CLI scripts/hubble-testbin
// builds, skipping (or failing under APIARY_STRICT=1) when it has not been
// built.
func RequireHubble(tb testing.TB, repoRoot string) string {
	tb.Helper()
	dir, err := HubbleTestbinDir(repoRoot)
	if err != nil {
		tb.Fatal(err)
	}
	p := filepath.Join(dir, "hubble")
	if st, err := os.Stat(p); err != nil || st.Mode()&0o111 == 0 {
		Skip(tb, fmt.Sprintf("needs %s: build it with scripts/hubble-testbin/build.sh "+
			"(make deps does), or point %s at a directory holding it", p, HubbleTestbinEnv))
	}
	return p
}
