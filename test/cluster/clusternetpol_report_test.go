//go:build cluster

package cluster

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// readTest2JSON gives one result per subtest: a pass whose probes were all
// SCTP's left out is a skip, one with TCP or UDP probes too says how many
// it left out, and a failure names the probe that failed last.
func TestReadTest2JSON(t *testing.T) {
	ev := func(action, test, output string) string {
		if output != "" {
			output = `,"Output":"` + strings.ReplaceAll(output, `"`, `\"`) + `\n"`
		}
		return `{"Action":"` + action + `","Test":"` + test + `"` + output + "}\n"
	}
	const top = "TestConformanceProfiles"
	const tcp = top + "/CNPAdminTierIngressTCP"
	const sctp = top + "/CNPAdminTierIngressSCTP"
	var b strings.Builder
	for _, l := range []string{
		ev("run", top, ""),
		ev("output", top, "suite.go:1: Test Setup: Applying base manifests"),
		ev("run", tcp, ""),
		ev("run", tcp+"/allows", ""),
		ev("output", tcp+"/allows", "nosctp.go:1: APIARY-PROBE tcp ns/a-0 -> 10.0.0.1:80 connect=true skipped=false"),
		ev("output", tcp+"/allows", "nosctp.go:1: APIARY-PROBE sctp ns/a-0 -> 10.0.0.1:9003 connect=true skipped=true"),
		ev("output", tcp+"/allows", "nosctp.go:1: APIARY-PROBE sctp ns/a-0 -> 10.0.0.1:9003 connect=true skipped=true"),
		ev("pass", tcp+"/allows", ""),
		ev("run", tcp+"/denies", ""),
		ev("output", tcp+"/denies", "helper.go:71: FAILED Command was [/agnhost connect --protocol=tcp 10.0.0.1:80]"),
		ev("output", tcp+"/denies", "helper.go:71: Expected connection to be dropped, but instead it returned a different status: OTHER: EPERM"),
		ev("fail", tcp+"/denies", ""),
		ev("fail", tcp, ""),
		ev("run", sctp+"/only_sctp", ""),
		ev("output", sctp+"/only_sctp", "nosctp.go:1: APIARY-PROBE sctp ns/a-0 -> 10.0.0.1:9003 connect=false skipped=true"),
		ev("pass", sctp+"/only_sctp", ""),
		ev("pass", sctp, ""),
		ev("fail", top, ""),
	} {
		b.WriteString(l)
	}
	path := filepath.Join(t.TempDir(), "events.json")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := readTest2JSON(path)
	if err != nil {
		t.Fatal(err)
	}
	want := []specResult{
		{"CNPAdminTierIngressTCP: allows", "passed", "its 1 TCP/UDP probes passed; its 1 SCTP probes were left out (no SCTP in this kernel)"},
		{"CNPAdminTierIngressTCP: denies", "failed", "FAILED Command was [/agnhost connect --protocol=tcp 10.0.0.1:80]: Expected connection to be dropped, but instead it returned a different status: OTHER: EPERM"},
		{"CNPAdminTierIngressSCTP: only sctp", "skipped", "needs SCTP: all its 1 probes are SCTP's, and this kernel has no SCTP (no CONFIG_IP_SCTP)"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d results, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("result %d:\n got %+v\nwant %+v", i, got[i], want[i])
		}
	}
}

// cnpRunPattern selects each subtest of the subset by its test and its
// own name, level by level as go test matches -test.run.
func TestCNPRunPattern(t *testing.T) {
	got := cnpRunPattern(map[string][]string{"B": {"y (z)"}, "A": {"x; 'w'"}})
	want := `^(A|B)$/^(x;_'w'|y_\(z\))$`
	if got != want {
		t.Fatalf("got %s, want %s", got, want)
	}
	for _, level := range strings.Split(got, "/") {
		if _, err := regexp.Compile(level); err != nil {
			t.Errorf("%s: %v", level, err)
		}
	}
}
