package cnichain

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const bridgeList = `{
  "cniVersion": "1.0.0",
  "name": "pods",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local", "subnet": "10.1.0.0/24"}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`

const bridgeConf = `{"cniVersion": "0.4.0", "name": "pods", "type": "ptp", "ipam": {"type": "host-local", "subnet": "10.2.0.0/24"}}
`

// types returns the plugin types of the conflist at path.
func types(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var l struct {
		Plugins []struct {
			Type      string `json:"type"`
			BPFPinDir string `json:"bpfPinDir"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(data, &l); err != nil {
		t.Fatalf("%s: %v\n%s", path, err, data)
	}
	var out []string
	for _, p := range l.Plugins {
		s := p.Type
		if p.BPFPinDir != "" {
			s += "@" + p.BPFPinDir
		}
		out = append(out, s)
	}
	return out
}

func names(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

func TestInstallUninstall(t *testing.T) {
	chainedList := strings.Replace(bridgeList, `"capabilities": {"portMappings": true}}`,
		`"capabilities": {"portMappings": true}},
    {"type": "apiary-cni", "bpfPinDir": "/pins"}`, 1)
	for _, tt := range []struct {
		name  string
		files map[string]string
		file  string // --cni-conf-name
		// after Install
		wantState State
		wantFile  string
		wantTypes []string
		wantFiles []string
		wantErr   string
		// after Uninstall
		wantUnState State
		wantUnFiles []string
		// the primary's content after Uninstall, if not the original's
		wantUnTypes []string
	}{{
		name:      "conflist",
		files:     map[string]string{"10-pods.conflist": bridgeList, "99-other.conflist": bridgeList, "00-notes.txt": "x"},
		wantState: Chained, wantFile: "10-pods.conflist",
		wantTypes:   []string{"bridge", "portmap", "apiary-cni@/pins"},
		wantFiles:   []string{"00-notes.txt", "10-pods.conflist", "10-pods.conflist.apiary-orig", "99-other.conflist"},
		wantUnState: Unchained,
		wantUnFiles: []string{"00-notes.txt", "10-pods.conflist", "99-other.conflist"},
	}, {
		name:      "named file, not the primary",
		files:     map[string]string{"10-pods.conflist": bridgeList, "99-other.conflist": bridgeList},
		file:      "99-other.conflist",
		wantState: Chained, wantFile: "99-other.conflist",
		wantTypes:   []string{"bridge", "portmap", "apiary-cni@/pins"},
		wantFiles:   []string{"10-pods.conflist", "99-other.conflist", "99-other.conflist.apiary-orig"},
		wantUnState: Unchained,
		wantUnFiles: []string{"10-pods.conflist", "99-other.conflist"},
	}, {
		name:      "single .conf becomes a conflist",
		files:     map[string]string{"10-pods.conf": bridgeConf, "20-later.conflist": bridgeList},
		wantState: Chained, wantFile: "10-pods.conflist",
		wantTypes:   []string{"ptp", "apiary-cni@/pins"},
		wantFiles:   []string{"10-pods.conf.apiary-orig", "10-pods.conflist", "20-later.conflist"},
		wantUnState: Unchained,
		wantUnFiles: []string{"10-pods.conf", "20-later.conflist"},
	}, {
		name:      "already chained",
		files:     map[string]string{"10-pods.conflist": chainedList},
		wantState: AlreadyChained, wantFile: "10-pods.conflist",
		wantTypes: []string{"bridge", "portmap", "apiary-cni@/pins"},
		wantFiles: []string{"10-pods.conflist"},
		// No copy of the original: apiary's entry alone is removed.
		wantUnState: Unchained,
		wantUnFiles: []string{"10-pods.conflist"},
		wantUnTypes: []string{"bridge", "portmap"},
	}, {
		name: "chained elsewhere, other pin directory: moved to the end, updated",
		files: map[string]string{"10-pods.conflist": strings.Replace(bridgeList, `{"type": "portmap"`,
			`{"type": "apiary-cni", "bpfPinDir": "/old"}, {"type": "portmap"`, 1)},
		wantState: Chained, wantFile: "10-pods.conflist",
		wantTypes:   []string{"bridge", "portmap", "apiary-cni@/pins"},
		wantFiles:   []string{"10-pods.conflist"},
		wantUnState: Unchained,
		wantUnFiles: []string{"10-pods.conflist"},
		wantUnTypes: []string{"bridge", "portmap"},
	}, {
		name:        "empty directory",
		files:       map[string]string{"README": "x"},
		wantState:   NoConfig,
		wantFiles:   []string{"README"},
		wantUnState: NoConfig,
		wantUnFiles: []string{"README"},
	}, {
		name:      "malformed JSON",
		files:     map[string]string{"10-pods.conflist": bridgeList[:40]},
		wantErr:   "parse ",
		wantFiles: []string{"10-pods.conflist"},
	}, {
		name:      "no plugins",
		files:     map[string]string{"10-pods.conflist": `{"cniVersion": "1.0.0", "name": "x", "plugins": []}`},
		wantErr:   `empty "plugins" list`,
		wantFiles: []string{"10-pods.conflist"},
	}, {
		name:      "plugin without a type",
		files:     map[string]string{"10-pods.conflist": `{"cniVersion": "1.0.0", "name": "x", "plugins": [{"bridge": "x"}]}`},
		wantErr:   `plugin 0: no "type"`,
		wantFiles: []string{"10-pods.conflist"},
	}, {
		name:      "malformed single .conf",
		files:     map[string]string{"10-pods.conf": "{nope"},
		wantErr:   "parse ",
		wantFiles: []string{"10-pods.conf"},
	}, {
		name:      "a .conf beside a foreign .conflist of its name",
		files:     map[string]string{"10-pods.conf": bridgeConf, "10-pods.conflist": bridgeList},
		wantErr:   "exists beside it",
		wantFiles: []string{"10-pods.conf", "10-pods.conflist"},
	}, {
		name:      "a path for a name",
		files:     map[string]string{"10-pods.conflist": bridgeList},
		file:      "../10-pods.conflist",
		wantErr:   "no path",
		wantFiles: []string{"10-pods.conflist"},
	}} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			for name, data := range tt.files {
				if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			res, err := Install(dir, tt.file, Entry("/pins", "auto"))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Install: %v, want an error with %q", err, tt.wantErr)
				}
				// Untouched.
				for name, data := range tt.files {
					got, _ := os.ReadFile(filepath.Join(dir, name))
					if string(got) != data {
						t.Errorf("%s changed:\n%s", name, got)
					}
				}
				if got := names(t, dir); !slices.Equal(got, tt.wantFiles) {
					t.Errorf("files %v, want %v", got, tt.wantFiles)
				}
				return
			}
			if err != nil {
				t.Fatalf("Install: %v", err)
			}
			wantFile := ""
			if tt.wantFile != "" {
				wantFile = filepath.Join(dir, tt.wantFile)
			}
			if res.State != tt.wantState || res.File != wantFile {
				t.Errorf("Install: %+v, want %s %s", res, tt.wantState, wantFile)
			}
			if got := names(t, dir); !slices.Equal(got, tt.wantFiles) {
				t.Errorf("files %v, want %v", got, tt.wantFiles)
			}
			if tt.wantTypes != nil {
				if got := types(t, res.File); !slices.Equal(got, tt.wantTypes) {
					t.Errorf("plugins %v, want %v", got, tt.wantTypes)
				}
				if p, _ := Primary(dir); tt.file == "" && p != res.File {
					t.Errorf("primary %s, want the chained %s", p, res.File)
				}
			}
			// Idempotent: a second Install writes nothing.
			before := snapshot(t, dir)
			res2, err := Install(dir, tt.file, Entry("/pins", ""))
			if err != nil {
				t.Fatalf("second Install: %v", err)
			}
			if want := map[State]State{NoConfig: NoConfig}[tt.wantState]; want == "" && res2.State != AlreadyChained {
				t.Errorf("second Install: %+v, want %s", res2, AlreadyChained)
			}
			if after := snapshot(t, dir); !equalSnap(before, after) {
				t.Errorf("second Install wrote: %v -> %v", before, after)
			}

			unFile := tt.file
			if tt.file != "" && res.File != "" {
				unFile = filepath.Base(res.File)
			}
			ures, err := Uninstall(dir, unFile)
			if err != nil {
				t.Fatalf("Uninstall: %v", err)
			}
			if ures.State != tt.wantUnState {
				t.Errorf("Uninstall: %+v, want %s", ures, tt.wantUnState)
			}
			if got := names(t, dir); !slices.Equal(got, tt.wantUnFiles) {
				t.Errorf("files after Uninstall %v, want %v", got, tt.wantUnFiles)
			}
			if tt.wantUnTypes != nil {
				if got := types(t, ures.File); !slices.Equal(got, tt.wantUnTypes) {
					t.Errorf("plugins after Uninstall %v, want %v", got, tt.wantUnTypes)
				}
			} else {
				// The original, byte for byte.
				for name, data := range tt.files {
					got, _ := os.ReadFile(filepath.Join(dir, name))
					if string(got) != data {
						t.Errorf("%s after Uninstall:\n%s\nwant\n%s", name, got, data)
					}
				}
			}
			// Idempotent.
			if ures, err := Uninstall(dir, unFile); err != nil || (ures.State != NotChained && ures.State != NoConfig) {
				t.Errorf("second Uninstall: %+v %v", ures, err)
			}
		})
	}
}

// The owner of the configuration rewrites it after apiary chained itself:
// Install chains again; and a change the owner made while chained survives
// Uninstall.
func TestOwnerRewrites(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "10-pods.conflist")
	if err := os.WriteFile(path, []byte(bridgeList), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Install(dir, "", Entry("/pins", "")); err != nil {
		t.Fatal(err)
	}
	changed := strings.Replace(bridgeList, "cni0", "cni1", 1)
	if err := os.WriteFile(path, []byte(changed), 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := Install(dir, "", Entry("/pins", ""))
	if err != nil || res.State != Chained {
		t.Fatalf("Install after a rewrite: %+v %v", res, err)
	}
	// The owner edits the chained file (keeping apiary's entry).
	data, _ := os.ReadFile(path)
	if err := os.WriteFile(path, []byte(strings.Replace(string(data), "cni1", "cni2", 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	if res, err := Uninstall(dir, ""); err != nil || res.State != Unchained {
		t.Fatalf("Uninstall: %+v %v", res, err)
	}
	data, _ = os.ReadFile(path)
	if !strings.Contains(string(data), "cni2") || strings.Contains(string(data), PluginType) {
		t.Errorf("after Uninstall:\n%s\nwant the owner's cni2 and no %s", data, PluginType)
	}
	if got := names(t, dir); !slices.Equal(got, []string{"10-pods.conflist"}) {
		t.Errorf("files %v", got)
	}
	if info, _ := os.Stat(path); info.Mode().Perm() != 0o644 {
		t.Errorf("mode %v, want the original's 0644", info.Mode())
	}
}

func TestInstallBinary(t *testing.T) {
	src := filepath.Join(t.TempDir(), "apiary-cni")
	if err := os.WriteFile(src, []byte("v1"), 0o700); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "opt", "cni", "bin")
	for i, tt := range []struct {
		content   string
		wantWrote bool
	}{{"v1", true}, {"v1", false}, {"v2", true}} {
		if err := os.WriteFile(src, []byte(tt.content), 0o700); err != nil {
			t.Fatal(err)
		}
		wrote, err := InstallBinary(src, bin)
		if err != nil || wrote != tt.wantWrote {
			t.Errorf("step %d: wrote %v %v, want %v", i, wrote, err, tt.wantWrote)
		}
		dst := filepath.Join(bin, PluginType)
		got, _ := os.ReadFile(dst)
		info, _ := os.Stat(dst)
		if string(got) != tt.content || info.Mode().Perm() != 0o755 {
			t.Errorf("step %d: %s %q %v", i, dst, got, info.Mode())
		}
	}
	if _, err := InstallBinary(filepath.Join(t.TempDir(), "missing"), bin); err == nil || !strings.Contains(err.Error(), "apiary-cni binary") {
		t.Errorf("missing source: %v", err)
	}
}

func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, n := range names(t, dir) {
		data, _ := os.ReadFile(filepath.Join(dir, n))
		info, _ := os.Stat(filepath.Join(dir, n))
		out[n] = string(data) + info.ModTime().String()
	}
	return out
}

func equalSnap(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}
