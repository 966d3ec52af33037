//go:build cluster

package cluster

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestWriteShapeSection: each cluster shape's run rewrites its own section
// of docs/conformance.md and keeps the others, in order of nodes.
func TestWriteShapeSection(t *testing.T) {
	path := filepath.Join(t.TempDir(), "conformance.md")
	pass := []specResult{{Name: "a", Result: "passed"}}
	fail := []specResult{{Name: "a", Result: "failed", Reason: "x|y"}}
	for _, step := range []struct {
		shape   string
		results []specResult
	}{
		{"2 nodes", fail},
		{"1 node", pass},
		{"2 nodes", pass},
	} {
		if err := writeShapeSection(path, step.shape, "On "+step.shape+".", step.results, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	got := string(b)
	want := conformanceIntro + `
## 1 node

On 1 node.

**1 passed, 0 failed, 0 skipped** of 1, in 1m0s.

| Test | Result | Reason |
| --- | --- | --- |
| a | passed |  |

## 2 nodes

On 2 nodes.

**1 passed, 0 failed, 0 skipped** of 1, in 1m0s.

| Test | Result | Reason |
| --- | --- | --- |
| a | passed |  |
`
	if got != want {
		t.Errorf("report:\n%s\nwant:\n%s", got, want)
	}
	if strings.Contains(got, "x\\|y") {
		t.Error("the first run's 2-node section was kept beside the second's")
	}
}
