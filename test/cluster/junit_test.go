//go:build cluster

package cluster

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"
)

// readJUnit counts anything but a pass or a skip as a failure, names why
// a test was skipped, and leaves out the specs of other suites.
func TestReadJUnit(t *testing.T) {
	report := `<?xml version="1.0" encoding="UTF-8"?>
<testsuites><testsuite name="Kubernetes e2e suite">
  <testcase name="[SynchronizedBeforeSuite]" status="passed"></testcase>
  <testcase name="[It] [sig-network] Netpol NetworkPolicy a passes" status="passed"></testcase>
  <testcase name="[It] [sig-network] Netpol NetworkPolicy b fails" status="failed"><failure message="[FAILED] Had 1 wrong results" type="failed">at test_helper.go:129</failure></testcase>
  <testcase name="[It] [sig-network] Netpol NetworkPolicy c panics" status="panicked"><error message="[PANICKED] nil map" type="panicked">stack</error></testcase>
  <testcase name="[It] [sig-network] Netpol NetworkPolicy d times out" status="timedout"></testcase>
  <testcase name="[It] [sig-network] Netpol [Feature:SCTPConnectivity] e" status="skipped"><skipped message="skipped"></skipped></testcase>
  <testcase name="[It] [sig-network] Netpol NetworkPolicy f not focused" status="skipped"><skipped message="skipped"></skipped></testcase>
  <testcase name="[It] [sig-storage] other suite" status="failed"><failure message="x"></failure></testcase>
</testsuite></testsuites>`
	path := filepath.Join(t.TempDir(), "junit_01.xml")
	if err := os.WriteFile(path, []byte(report), 0o644); err != nil {
		t.Fatal(err)
	}
	lacking := []lack{{regexp.MustCompile(`\[Feature:SCTPConnectivity\]`), "no SCTP"}}
	got, err := readJUnit(path, netpolSuite, lacking)
	if err != nil {
		t.Fatal(err)
	}
	want := []specResult{
		{"Netpol NetworkPolicy a passes", "passed", ""},
		{"Netpol NetworkPolicy b fails", "failed", "[FAILED] Had 1 wrong results at test_helper.go:129"},
		{"Netpol NetworkPolicy c panics", "failed", "[PANICKED] nil map stack"},
		{"Netpol NetworkPolicy d times out", "failed", "ended timedout"},
		{"Netpol NetworkPolicy f not focused", "skipped", "not in this run (APIARY_CONFORMANCE=all runs it)"},
		{"Netpol [Feature:SCTPConnectivity] e", "skipped", "no SCTP"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d results, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("result %d: got %+v, want %+v", i, got[i], want[i])
		}
	}
}
