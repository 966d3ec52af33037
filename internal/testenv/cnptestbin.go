package testenv

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// CNPTestbinEnv names a directory holding network-policy-api's conformance
// suite as scripts/cnp-testbin/build.sh builds it; unset, it is where
// build.sh puts it.
const CNPTestbinEnv = "APIARY_CNP_TESTBIN"

// CNPTestbinDir returns where scripts/cnp-testbin/build.sh puts the suite
// for the repository at repoRoot: $APIARY_CNP_TESTBIN, or its cache
// directory keyed as build.sh keys it (the first 16 hex digits of the
// SHA-256 of go.sum, build.sh and nosctp/nosctp.go, in that order).
func CNPTestbinDir(repoRoot string) (string, error) {
	return testbinDir(repoRoot, "cnp-testbin", CNPTestbinEnv, "go.sum", "build.sh", "nosctp/nosctp.go")
}

// RequireCNPTestbin returns the directory scripts/cnp-testbin/build.sh
// fills (the suite's test binary cnp-conformance.test, the experimental
// ClusterNetworkPolicy CRD it needs, the images its manifests name),
// skipping (or failing under APIARY_STRICT=1) when it has not been built.
func RequireCNPTestbin(tb testing.TB, repoRoot string) string {
	tb.Helper()
	dir, err := CNPTestbinDir(repoRoot)
	if err != nil {
		tb.Fatal(err)
	}
	if st, err := os.Stat(filepath.Join(dir, "cnp-conformance.test")); err != nil || st.Mode()&0o111 == 0 {
		Skip(tb, fmt.Sprintf("needs %s/cnp-conformance.test: build it with scripts/cnp-testbin/build.sh "+
			"(make deps does), or point %s at a directory holding it", dir, CNPTestbinEnv))
	}
	return dir
}
