package cnichain

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/cells/policy"
)

// A mode the agent cannot honour stops it with one line naming the flag,
// before anything runs.
func TestRegisterRejects(t *testing.T) {
	src := filepath.Join(t.TempDir(), "apiary-cni")
	if err := os.WriteFile(src, []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	on := policy.Config{EnablePolicy: policy.ModeDefault, PolicyPodInterfaces: true}
	for _, tt := range []struct {
		name    string
		cfg     Config
		policy  policy.Config
		wantErr string
	}{
		{"unknown mode", Config{CNIChainingMode: "sometimes"}, on, "--cni-chaining-mode=\"sometimes\""},
		{"no interface programs", Config{CNIChainingMode: ModeChain, CNIPluginSource: src},
			policy.Config{EnablePolicy: policy.ModeDefault}, "--policy-pod-interfaces=true"},
		{"policy never", Config{CNIChainingMode: ModeChain, CNIPluginSource: src},
			policy.Config{EnablePolicy: policy.ModeNever, PolicyPodInterfaces: true}, "--enable-policy not never"},
		{"no plugin binary", Config{CNIChainingMode: ModeChain, CNIPluginSource: src + ".missing"}, on, "--cni-plugin-source"},
		{"none does nothing", Config{CNIChainingMode: ModeNone, CNIPluginSource: src + ".missing"}, policy.Config{EnablePolicy: policy.ModeNever}, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := register(params{Config: tt.cfg, PolicyConfig: tt.policy})
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("register: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("register: %v, want an error with %q", err, tt.wantErr)
			}
		})
	}
}
