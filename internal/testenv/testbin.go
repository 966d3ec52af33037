package testenv

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
)

// testbinDir returns where scripts/<name>/build.sh puts what it builds for
// the repository at repoRoot: the directory the environment variable env
// names, or its cache directory keyed as build.sh keys it: the first 16 hex
// digits of the SHA-256 of keyFiles (paths in scripts/<name>), in order,
// under $XDG_CACHE_HOME (or ~/.cache)/apiary/<name>.
func testbinDir(repoRoot, name, env string, keyFiles ...string) (string, error) {
	if dir := os.Getenv(env); dir != "" {
		return dir, nil
	}
	h := sha256.New()
	for _, f := range keyFiles {
		data, err := os.ReadFile(filepath.Join(repoRoot, "scripts", name, f))
		if err != nil {
			return "", fmt.Errorf("%s key: %w", name, err)
		}
		h.Write(data)
	}
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("%s cache: %w", name, err)
		}
		cache = filepath.Join(home, ".cache")
	}
	return filepath.Join(cache, "apiary", name, hex.EncodeToString(h.Sum(nil))[:16]), nil
}
