package bpffs

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

func TestPrepare(t *testing.T) {
	base := testenv.BPFPinDir(t)
	for _, tc := range []struct {
		name    string
		dir     string
		wantErr string
	}{
		{"existing dir on bpffs", base, ""},
		{"nested dir created", filepath.Join(base, "a", "b"), ""},
		{"not on bpffs", t.TempDir(), "is not on a bpffs mount"},
		{"empty", "", "--bpf-pin-dir is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Prepare(tc.dir)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, want an error mentioning %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.dir {
				t.Errorf("got %q, want %q", got, tc.dir)
			}
		})
	}
}
