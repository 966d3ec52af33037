// Command mkimage writes a container image archive (the format of `docker
// save`, which `docker load` and `ctr images import` accept) of files on
// this machine, for `make image`:
//
//	go run ./scripts/mkimage -o bin/apiary-image.tar -tag ghcr.io/apiary-net/apiary:latest \
//		-entrypoint /usr/bin/apiary bin/image/apiary=/usr/bin/apiary
//
// Each argument is SRC=DEST: the file SRC of this machine at DEST in the
// image. A tag that is not a valid image reference (a `git describe`
// version with a '+', say) is an error, not rewritten.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/apiary-net/apiary/internal/imagetar"
)

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("mkimage", flag.ContinueOnError)
	out := fs.String("o", "", "the archive to write")
	arch := fs.String("arch", runtime.GOARCH, "the image's architecture (a GOARCH value)")
	entrypoint := fs.String("entrypoint", "", "the image's entrypoint (one program, no arguments)")
	var tags list
	fs.Var(&tags, "tag", "a name of the image, REPOSITORY:TAG (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *out == "" || fs.NArg() == 0 {
		return fmt.Errorf("usage: mkimage -o ARCHIVE -tag REPO:TAG [-entrypoint PATH] SRC=DEST...")
	}
	img := imagetar.Image{Tags: tags, Architecture: *arch}
	if *entrypoint != "" {
		img.Entrypoint = []string{*entrypoint}
	}
	for _, arg := range fs.Args() {
		src, dest, ok := strings.Cut(arg, "=")
		if !ok {
			return fmt.Errorf("%q: want SRC=DEST", arg)
		}
		data, err := os.ReadFile(src)
		if err != nil {
			return err
		}
		fi, err := os.Stat(src)
		if err != nil {
			return err
		}
		img.Files = append(img.Files, imagetar.File{Path: dest, Data: data, Mode: int64(fi.Mode().Perm())})
	}
	tmp, err := os.CreateTemp(filepath.Dir(*out), ".mkimage-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	id, err := imagetar.Write(tmp, img)
	if err == nil {
		err = tmp.Chmod(0o644)
	}
	if err == nil {
		err = tmp.Close()
	}
	if err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", *out, err)
	}
	if err := os.Rename(tmp.Name(), *out); err != nil {
		return err
	}
	fmt.Printf("%s: %s (%s)\n", *out, strings.Join(tags, ", "), id)
	return nil
}
