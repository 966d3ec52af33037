package fqdn

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apiary-net/apiary/internal/atomicfile"
	"github.com/apiary-net/apiary/tables"
)

func TestCheckpointRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), CheckpointFile)
	exp := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	rows := []*tables.FQDNName{{
		Name:      "www.cilium.io",
		IPs:       []tables.FQDNIP{{IP: netip.MustParseAddr("192.0.2.1"), Expires: exp, Seen: exp}, {IP: netip.MustParseAddr("2001:db8::1"), Expires: exp, Unlabelled: true}},
		Selectors: tables.NewLabels("fqdn:www.cilium.io", "fqdn:*.cilium.io"),
	}}
	data, err := encodeCheckpoint(rows)
	if err != nil {
		t.Fatal(err)
	}
	if err := atomicfile.Write(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := readCheckpoint(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Name != rows[0].Name || !got[0].Selectors.Equal(rows[0].Selectors) ||
		len(got[0].IPs) != 2 || got[0].IPs[1] != rows[0].IPs[1] || !got[0].IPs[0].Expires.Equal(exp) {
		t.Fatalf("read back %+v, want %+v", got[0], rows[0])
	}
}

func TestCheckpointErrors(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]string{
		"truncated": `{"version":1,"names":[{"name":"a`,
		"version":   `{"version":7,"names":[]}`,
	} {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := readCheckpoint(path); err == nil || !strings.Contains(err.Error(), path) {
			t.Errorf("%s: error %v, want one naming the file", name, err)
		}
	}
	// Rows without a name are skipped, the rest kept.
	path := filepath.Join(dir, "partial")
	os.WriteFile(path, []byte(`{"version":1,"names":[{"name":""},{"name":"a.com","ips":[],"selectors":["fqdn:a.com"]}]}`), 0o600)
	rows, err := readCheckpoint(path)
	if err != nil || len(rows) != 1 || rows[0].Name != "a.com" {
		t.Fatalf("rows %v, err %v", rows, err)
	}
}
