package testenv

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// KubeTestbinEnv names a directory holding the Kubernetes binaries the
// tests run; unset, they are where scripts/kube-testbin/build.sh puts them.
const KubeTestbinEnv = "APIARY_KUBE_TESTBIN"

// KubeTestbinDir returns where scripts/kube-testbin/build.sh puts its
// binaries for the repository at repoRoot: $APIARY_KUBE_TESTBIN, or its
// cache directory keyed as build.sh keys it (the first 16 hex digits of the
// SHA-256 of go.sum followed by build.sh).
func KubeTestbinDir(repoRoot string) (string, error) {
	return testbinDir(repoRoot, "kube-testbin", KubeTestbinEnv, "go.sum", "build.sh")
}

// RequireKubeTestbin returns the paths of the named binaries of
// scripts/kube-testbin (see KubeTestbinDir), skipping (or failing under
// APIARY_STRICT=1) when one has not been built.
func RequireKubeTestbin(tb testing.TB, repoRoot string, names ...string) map[string]string {
	tb.Helper()
	dir, err := KubeTestbinDir(repoRoot)
	if err != nil {
		tb.Fatal(err)
	}
	paths := make(map[string]string, len(names))
	for _, name := range names {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err != nil || st.Mode()&0o111 == 0 {
			Skip(tb, fmt.Sprintf("needs %s: build it with scripts/kube-testbin/build.sh "+
				"(make deps does; about 20 min the first time), or point %s at a directory holding it", p, KubeTestbinEnv))
		}
		paths[name] = p
	}
	return paths
}
