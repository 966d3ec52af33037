package testenv

import (
	"crypto/sha256"
	"encoding/hex"
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
	if dir := os.Getenv(HubbleTestbinEnv); dir != "" {
		return dir, nil
	}
	h := sha256.New()
	for _, f := range []string{"go.sum", "build.sh"} {
		data, err := os.ReadFile(filepath.Join(repoRoot, "scripts/hubble-testbin", f))
		if err != nil {
			return "", fmt.Errorf("hubble-testbin key: %w", err)
		}
		h.Write(data)
	}
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("hubble-testbin cache: %w", err)
		}
		cache = filepath.Join(home, ".cache")
	}
	return filepath.Join(cache, "apiary", "hubble-testbin", hex.EncodeToString(h.Sum(nil))[:16]), nil
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
