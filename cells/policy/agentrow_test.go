package policy

import (
	"os"
	"path/filepath"
	"testing"
)

// TestAgentCgroup: the agent's container cgroup is read from
// /proc/self/cgroup when it names a cgroup below a pod tree, and found by
// its PID in cgroup.procs where a cgroup namespace hides the path.
func TestAgentCgroup(t *testing.T) {
	root := t.TempDir()
	ctr := "kubepods/besteffort/pod0c9a1f5e-1d8e-4a53-9b7c-6d1f3d5f1a2b/abc123"
	if err := os.MkdirAll(filepath.Join(root, ctr), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, ctr, "cgroup.procs"), []byte("7\n42\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, self string
		pid        int
		want       string
		ok         bool
	}{
		{"hybrid host", "12:pids:/kubepods/besteffort\n0::/" + ctr + "\n", 0, ctr, true},
		{"own cgroup namespace", "0::/\n", 42, ctr, true},
		{"not in a pod", "0::/user.slice/session-1.scope\n", 4242, "", false},
		{"pid 4 is not pid 42", "0::/\n", 4, "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := agentCgroup(root, []byte(tc.self), tc.pid)
			if got != tc.want || ok != tc.ok {
				t.Errorf("agentCgroup = %q, %v; want %q, %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}
