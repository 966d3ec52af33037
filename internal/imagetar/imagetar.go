// Package imagetar writes a container image of a few files (a static
// binary, typically) as an image archive in the format of `docker save`,
// which `docker load` and `ctr images import` accept: no registry, no
// Docker daemon, no dependency beyond the standard library.
//
// The archive holds one layer with the files, the image configuration and
// manifest.json naming the image by its tags. The layer's file times are
// fixed, so the same files give the same image ID.
package imagetar

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"path"
	"regexp"
	"slices"
	"strings"
	"time"
)

// File is a regular file of the image, or a symbolic link when Link is
// set.
type File struct {
	// Path is where the file is in the image, absolute ("/usr/bin/apiary").
	Path string
	// Data is its content.
	Data []byte
	// Mode is its permission bits (0o755 for a program).
	Mode int64
	// Link, when set, makes the file a symbolic link to Link (Data is
	// then ignored): busybox's applets are links to the one binary.
	Link string
}

// Image is what an archive holds.
type Image struct {
	// Tags name the image, each a full reference with a tag
	// ("ghcr.io/apiary-net/apiary:latest").
	Tags []string
	// Files are the layer's files; their parent directories are added.
	Files []File
	// Entrypoint and Cmd are the image's default command.
	Entrypoint, Cmd []string
	// Env is the image's environment; empty gets a PATH.
	Env []string
	// Architecture is a GOARCH value ("amd64").
	Architecture string
}

// epoch is every file's and the image's time: the same files, the same
// image.
var epoch = time.Unix(0, 0).UTC()

// tagRE is a reference with a tag, as Docker accepts it (lowercase
// repository path, optional registry host and port).
var tagRE = regexp.MustCompile(`^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)

// Write writes img as an image archive to w and returns the image ID (the
// digest of its configuration).
func Write(w io.Writer, img Image) (string, error) {
	if len(img.Tags) == 0 {
		return "", fmt.Errorf("image has no tag")
	}
	for _, t := range img.Tags {
		if !tagRE.MatchString(t) {
			return "", fmt.Errorf("image tag %q: want REPOSITORY:TAG (lowercase repository, tag of letters, digits, '.', '_', '-')", t)
		}
	}
	layer, err := layerTar(img.Files)
	if err != nil {
		return "", err
	}
	layerDigest := digest(layer)
	env := img.Env
	if len(env) == 0 {
		env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	}
	config, err := json.Marshal(imageConfig{
		Architecture: img.Architecture,
		OS:           "linux",
		Created:      epoch,
		Config:       runConfig{Env: env, Entrypoint: img.Entrypoint, Cmd: img.Cmd},
		RootFS:       rootFS{Type: "layers", DiffIDs: []string{"sha256:" + layerDigest}},
	})
	if err != nil {
		return "", err
	}
	configDigest := digest(config)
	manifest, err := json.Marshal([]manifestEntry{{
		Config:   "blobs/sha256/" + configDigest,
		RepoTags: img.Tags,
		Layers:   []string{"blobs/sha256/" + layerDigest},
	}})
	if err != nil {
		return "", err
	}
	tw := tar.NewWriter(w)
	for _, dir := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir, Mode: 0o755, ModTime: epoch}); err != nil {
			return "", err
		}
	}
	for _, f := range []struct {
		name string
		data []byte
	}{
		{"blobs/sha256/" + layerDigest, layer},
		{"blobs/sha256/" + configDigest, config},
		{"manifest.json", manifest},
	} {
		if err := writeFile(tw, f.name, f.data, 0o644); err != nil {
			return "", err
		}
	}
	if err := tw.Close(); err != nil {
		return "", err
	}
	return "sha256:" + configDigest, nil
}

// layerTar is the uncompressed layer of files, with their parent
// directories.
func layerTar(files []File) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	sorted := slices.Clone(files)
	slices.SortFunc(sorted, func(a, b File) int { return strings.Compare(a.Path, b.Path) })
	for _, f := range sorted {
		if !path.IsAbs(f.Path) || path.Clean(f.Path) != f.Path || f.Path == "/" {
			return nil, fmt.Errorf("image file %q: want a clean absolute path", f.Path)
		}
		name := strings.TrimPrefix(f.Path, "/")
		var parents []string
		for d := path.Dir(name); d != "."; d = path.Dir(d) {
			parents = append(parents, d)
		}
		slices.Reverse(parents)
		for _, d := range parents {
			if dirs[d] {
				continue
			}
			dirs[d] = true
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, ModTime: epoch}); err != nil {
				return nil, err
			}
		}
		if f.Link != "" {
			hdr := &tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: f.Link, Mode: 0o777, ModTime: epoch}
			if err := tw.WriteHeader(hdr); err != nil {
				return nil, fmt.Errorf("write %s: %w", name, err)
			}
			continue
		}
		if err := writeFile(tw, name, f.Data, f.Mode); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func writeFile(tw *tar.Writer, name string, data []byte, mode int64) error {
	hdr := &tar.Header{Typeflag: tar.TypeReg, Name: name, Size: int64(len(data)), Mode: mode, ModTime: epoch}
	if err := tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if _, err := tw.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	return nil
}

func digest(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

// manifestEntry is an image in manifest.json, as `docker save` writes it.
type manifestEntry struct {
	Config   string
	RepoTags []string
	Layers   []string
}

// imageConfig is the image configuration (OCI image spec, "config").
type imageConfig struct {
	Architecture string    `json:"architecture"`
	OS           string    `json:"os"`
	Created      time.Time `json:"created"`
	Config       runConfig `json:"config"`
	RootFS       rootFS    `json:"rootfs"`
}

type runConfig struct {
	Env        []string `json:"Env,omitempty"`
	Entrypoint []string `json:"Entrypoint,omitempty"`
	Cmd        []string `json:"Cmd,omitempty"`
}

type rootFS struct {
	Type    string   `json:"type"`
	DiffIDs []string `json:"diff_ids"`
}
