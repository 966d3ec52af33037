package imagetar

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"strings"
	"testing"
)

// readTar returns the regular files of a tar archive by name, and their
// modes.
func readTar(t *testing.T, data []byte) (map[string][]byte, map[string]int64) {
	t.Helper()
	files, modes := map[string][]byte{}, map[string]int64{}
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return files, modes
		}
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[hdr.Name], modes[hdr.Name] = body, hdr.Mode
		if hdr.Typeflag == tar.TypeDir {
			files[hdr.Name] = nil
		}
	}
}

func sum(data []byte) string {
	s := sha256.Sum256(data)
	return hex.EncodeToString(s[:])
}

// TestWrite reads an archive back as `docker load` would: manifest.json
// names the tags, the config and the layer, each blob's name is its
// digest, the config's diff ID is the layer's, and the layer holds the
// files with their parent directories.
func TestWrite(t *testing.T) {
	img := Image{
		Tags:         []string{"ghcr.io/apiary-net/apiary:v0.1.0-3-gabc", "ghcr.io/apiary-net/apiary:latest", "localhost:5000/x:1"},
		Files:        []File{{Path: "/usr/bin/apiary", Data: []byte("#!binary"), Mode: 0o755}, {Path: "/etc/motd", Data: []byte("hi"), Mode: 0o644}},
		Entrypoint:   []string{"/usr/bin/apiary"},
		Architecture: "amd64",
	}
	var buf bytes.Buffer
	id, err := Write(&buf, img)
	if err != nil {
		t.Fatal(err)
	}
	files, _ := readTar(t, buf.Bytes())
	var manifest []manifestEntry
	if err := json.Unmarshal(files["manifest.json"], &manifest); err != nil {
		t.Fatal(err)
	}
	if len(manifest) != 1 || strings.Join(manifest[0].RepoTags, " ") != strings.Join(img.Tags, " ") || len(manifest[0].Layers) != 1 {
		t.Fatalf("manifest.json: %+v", manifest)
	}
	for _, blob := range append([]string{manifest[0].Config}, manifest[0].Layers...) {
		data, ok := files[blob]
		if !ok || "blobs/sha256/"+sum(data) != blob {
			t.Errorf("blob %s: present %v, digest %s", blob, ok, sum(data))
		}
	}
	if id != "sha256:"+sum(files[manifest[0].Config]) {
		t.Errorf("image ID %s is not the config's digest", id)
	}
	var cfg imageConfig
	if err := json.Unmarshal(files[manifest[0].Config], &cfg); err != nil {
		t.Fatal(err)
	}
	layer := files[manifest[0].Layers[0]]
	if cfg.OS != "linux" || cfg.Architecture != "amd64" || len(cfg.RootFS.DiffIDs) != 1 || cfg.RootFS.DiffIDs[0] != "sha256:"+sum(layer) ||
		strings.Join(cfg.Config.Entrypoint, " ") != "/usr/bin/apiary" || !strings.HasPrefix(cfg.Config.Env[0], "PATH=") {
		t.Errorf("config: %+v", cfg)
	}
	lfiles, modes := readTar(t, layer)
	want := map[string]string{"etc/": "", "etc/motd": "hi", "usr/": "", "usr/bin/": "", "usr/bin/apiary": "#!binary"}
	if len(lfiles) != len(want) {
		t.Errorf("layer holds %d entries, want %d: %v", len(lfiles), len(want), lfiles)
	}
	for name, data := range want {
		if got, ok := lfiles[name]; !ok || string(got) != data {
			t.Errorf("layer %s = %q (present %v), want %q", name, got, ok, data)
		}
	}
	if modes["usr/bin/apiary"] != 0o755 {
		t.Errorf("mode of the binary: %o", modes["usr/bin/apiary"])
	}

	// The same files, the same bytes.
	var again bytes.Buffer
	if _, err := Write(&again, img); err != nil || !bytes.Equal(again.Bytes(), buf.Bytes()) {
		t.Errorf("a second write differs (%v)", err)
	}
}

func TestWriteRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		img  Image
		err  string
	}{
		{"no tag", Image{}, "image has no tag"},
		{"no tag part", Image{Tags: []string{"ghcr.io/apiary-net/apiary"}}, `image tag "ghcr.io/apiary-net/apiary"`},
		{"uppercase", Image{Tags: []string{"Apiary:v1"}}, `image tag "Apiary:v1"`},
		{"plus in tag", Image{Tags: []string{"apiary:v1+dirty"}}, `image tag "apiary:v1+dirty"`},
		{"relative file", Image{Tags: []string{"apiary:v1"}, Files: []File{{Path: "usr/bin/x"}}}, `image file "usr/bin/x"`},
		{"unclean file", Image{Tags: []string{"apiary:v1"}, Files: []File{{Path: "/usr/../x"}}}, `image file "/usr/../x"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Write(io.Discard, tc.img)
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("Write = %v, want an error containing %q", err, tc.err)
			}
		})
	}
}

// A file with Link set is a symbolic link in the layer, with its parent
// directories, and carries no data.
func TestWriteSymlink(t *testing.T) {
	img := Image{
		Tags:         []string{"x:1"},
		Files:        []File{{Path: "/bin/busybox", Data: []byte("bb"), Mode: 0o755}, {Path: "/bin/sh", Link: "busybox", Data: []byte("ignored")}},
		Architecture: "amd64",
	}
	var buf bytes.Buffer
	if _, err := Write(&buf, img); err != nil {
		t.Fatal(err)
	}
	files, _ := readTar(t, buf.Bytes())
	var manifest []manifestEntry
	if err := json.Unmarshal(files["manifest.json"], &manifest); err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(bytes.NewReader(files[manifest[0].Layers[0]]))
	links := map[string]string{}
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if hdr.Typeflag == tar.TypeSymlink {
			links[hdr.Name] = hdr.Linkname
			if hdr.Size != 0 {
				t.Errorf("link %s has %d bytes of data", hdr.Name, hdr.Size)
			}
		}
	}
	if len(links) != 1 || links["bin/sh"] != "busybox" {
		t.Errorf("links in the layer: %v, want bin/sh -> busybox", links)
	}
}
