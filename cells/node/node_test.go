package node

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestNewConfig(t *testing.T) {
	tmp := t.TempDir()
	file := filepath.Join(tmp, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		flags   Flags
		wantErr string
	}{
		{"existing dir", Flags{NodeName: "n1", StateDir: tmp}, ""},
		{"created with parents", Flags{NodeName: "n1", StateDir: filepath.Join(tmp, "a", "b")}, ""},
		{"relative made absolute", Flags{NodeName: "n1", StateDir: "rel-state"}, ""},
		{"below a file", Flags{NodeName: "n1", StateDir: filepath.Join(file, "sub")}, "--state-dir"},
		{"empty dir", Flags{NodeName: "n1", StateDir: ""}, "--state-dir is empty"},
		{"empty node name", Flags{NodeName: "", StateDir: tmp}, "--node-name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "relative made absolute" {
				t.Chdir(tmp)
			}
			cfg, err := newConfig(tc.flags)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, want an error mentioning %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !filepath.IsAbs(cfg.StateDir) {
				t.Errorf("state dir %q is not absolute", cfg.StateDir)
			}
			if st, err := os.Stat(cfg.StateDir); err != nil || !st.IsDir() {
				t.Errorf("state dir %q not created: %v", cfg.StateDir, err)
			}
			entries, _ := os.ReadDir(cfg.StateDir)
			for _, e := range entries {
				if strings.HasPrefix(e.Name(), ".write-probe") {
					t.Errorf("write probe %s left behind", e.Name())
				}
			}
		})
	}
}
