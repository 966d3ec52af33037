package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// KubeTestbinDir finds the directory build.sh prints, and the override.
func TestKubeTestbinDir(t *testing.T) {
	repo := "../.."
	cache := t.TempDir()
	t.Setenv("XDG_CACHE_HOME", cache)
	t.Setenv(KubeTestbinEnv, "")
	got, err := KubeTestbinDir(repo)
	if err != nil {
		t.Fatal(err)
	}
	// build.sh computes its key the same way; with every binary there it
	// prints the directory and builds nothing. Without go on its PATH, a
	// build.sh that looked elsewhere fails at once instead of building.
	if err := os.MkdirAll(got, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "e2e.test", "agnhost"} {
		if err := os.WriteFile(filepath.Join(got, b), nil, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(filepath.Join(repo, "scripts/kube-testbin/build.sh"))
	cmd.Env = append(os.Environ(), "PATH=/usr/bin:/bin")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("build.sh looked elsewhere than %s: %v", got, err)
	}
	if want := strings.TrimSpace(string(out)); got != want {
		t.Fatalf("KubeTestbinDir = %s, build.sh prints %s", got, want)
	}

	t.Setenv(KubeTestbinEnv, "/elsewhere")
	if got, _ := KubeTestbinDir(repo); got != "/elsewhere" {
		t.Fatalf("with %s set: %s", KubeTestbinEnv, got)
	}
}
