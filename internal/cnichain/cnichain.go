// Package cnichain chains the apiary-cni plugin into a node's CNI
// configuration and takes it out again: it finds the configuration the
// container runtime uses (the file with the lowest name among *.conf,
// *.conflist and *.json in the configuration directory, as libcni lists
// them for the kubelet's runtime), adds apiary-cni at the end of its plugin
// chain and copies the plugin's binary into the CNI binary directory.
//
// Every write is atomic (a temporary file renamed over the target), so the
// runtime never reads half a configuration, and a malformed configuration
// is reported and left as it is. The configuration as it was before apiary
// chained itself is kept beside it (<file>.apiary-orig, an extension libcni
// does not load) and put back by Uninstall. A single-plugin .conf, which
// cannot hold a chain, becomes a .conflist of the same base name holding
// the original plugin and apiary-cni; Uninstall puts the .conf back.
package cnichain

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"

	"github.com/apiary-net/apiary/internal/atomicfile"
)

// PluginType is the CNI type (binary name) of apiary's chained plugin.
const PluginType = "apiary-cni"

// BackupSuffix is appended to a configuration's name for the copy of it
// as it was before apiary-cni was chained.
const BackupSuffix = ".apiary-orig"

// State says what Install or Uninstall found or did.
type State string

// States of a configuration.
const (
	// Chained: apiary-cni was added (or its entry updated) just now.
	Chained State = "chained"
	// AlreadyChained: the configuration ends with apiary-cni's entry as
	// wanted; nothing was written.
	AlreadyChained State = "already chained"
	// Unchained: apiary-cni was taken out just now.
	Unchained State = "unchained"
	// NotChained: the configuration has no apiary-cni; nothing written.
	NotChained State = "not chained"
	// NoConfig: the directory holds no CNI configuration (yet).
	NoConfig State = "no configuration"
)

// Result is the outcome of Install or Uninstall on one file.
type Result struct {
	// File is the configuration's path (after Install of a .conf: the
	// .conflist that replaced it).
	File  string
	State State
}

// confExts are the extensions libcni loads, as the kubelet's runtimes ask.
var confExts = []string{".conf", ".conflist", ".json"}

// Primary returns the path of the configuration the runtime uses in dir:
// the lowest name with a CNI configuration's extension, or "" when there
// is none.
func Primary(dir string) (string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", nil
		}
		return "", fmt.Errorf("CNI configuration directory: %w", err)
	}
	var names []string
	for _, e := range entries {
		if e.IsDir() || !slices.Contains(confExts, filepath.Ext(e.Name())) {
			continue
		}
		names = append(names, e.Name())
	}
	if len(names) == 0 {
		return "", nil
	}
	slices.Sort(names)
	return filepath.Join(dir, names[0]), nil
}

// Entry is apiary-cni's entry in a chain: the agent's pin directory and
// its attach mode ("" or "auto" is left out, the plugin's default).
func Entry(pinDir, attach string) map[string]any {
	e := map[string]any{"type": PluginType, "bpfPinDir": pinDir}
	if attach != "" && attach != "auto" {
		e["attach"] = attach
	}
	return e
}

// target is file, or the primary configuration of dir when file is "".
func target(dir, file string) (string, error) {
	if file != "" {
		if filepath.Base(file) != file {
			return "", fmt.Errorf("CNI configuration name %q: a file name in the directory, no path", file)
		}
		return filepath.Join(dir, file), nil
	}
	return Primary(dir)
}

// list is a parsed conflist: its top-level fields as they were, and its
// plugins.
type list struct {
	top     map[string]json.RawMessage
	plugins []json.RawMessage
}

func parseList(path string, data []byte) (*list, error) {
	l := &list{}
	if err := json.Unmarshal(data, &l.top); err != nil {
		return nil, fmt.Errorf("parse %s: %w", path, err)
	}
	raw, ok := l.top["plugins"]
	if !ok {
		return nil, fmt.Errorf("parse %s: no \"plugins\" list", path)
	}
	if err := json.Unmarshal(raw, &l.plugins); err != nil {
		return nil, fmt.Errorf("parse %s: plugins: %w", path, err)
	}
	if len(l.plugins) == 0 {
		return nil, fmt.Errorf("parse %s: empty \"plugins\" list", path)
	}
	for i, p := range l.plugins {
		if _, err := pluginType(p); err != nil {
			return nil, fmt.Errorf("parse %s: plugin %d: %w", path, i, err)
		}
	}
	return l, nil
}

// pluginType is the "type" of a plugin's configuration.
func pluginType(p json.RawMessage) (string, error) {
	var h struct {
		Type *string `json:"type"`
	}
	if err := json.Unmarshal(p, &h); err != nil {
		return "", err
	}
	if h.Type == nil || *h.Type == "" {
		return "", errors.New("no \"type\"")
	}
	return *h.Type, nil
}

// ours are the indexes of apiary-cni's entries.
func (l *list) ours() []int {
	var out []int
	for i, p := range l.plugins {
		if t, _ := pluginType(p); t == PluginType {
			out = append(out, i)
		}
	}
	return out
}

// without returns the plugins other than apiary-cni's.
func (l *list) without() []json.RawMessage {
	var out []json.RawMessage
	for _, p := range l.plugins {
		if t, _ := pluginType(p); t != PluginType {
			out = append(out, p)
		}
	}
	return out
}

func (l *list) marshal(plugins []json.RawMessage) ([]byte, error) {
	top := make(map[string]json.RawMessage, len(l.top))
	for k, v := range l.top {
		top[k] = v
	}
	p, err := json.Marshal(plugins)
	if err != nil {
		return nil, err
	}
	top["plugins"] = p
	out, err := json.MarshalIndent(top, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(out, '\n'), nil
}

// sameJSON reports whether a and b hold the same JSON value.
func sameJSON(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	return reflect.DeepEqual(x, y)
}

// Install chains entry (see Entry) at the end of the configuration named
// file in dir, or of the primary one when file is "". It writes nothing
// when the configuration already ends with an equal entry; a different or
// misplaced apiary-cni entry is replaced. A malformed configuration is an
// error and is left untouched.
func Install(dir, file string, entry map[string]any) (Result, error) {
	path, err := target(dir, file)
	if err != nil || path == "" {
		return Result{State: NoConfig}, err
	}
	want, err := json.Marshal(entry)
	if err != nil {
		return Result{File: path}, fmt.Errorf("apiary-cni entry: %w", err)
	}
	data, info, err := read(path)
	if err != nil {
		return Result{File: path}, err
	}
	if filepath.Ext(path) != ".conflist" {
		return installSingle(path, data, info.Mode().Perm(), want)
	}
	l, err := parseList(path, data)
	if err != nil {
		return Result{File: path}, err
	}
	ours := l.ours()
	if len(ours) == 1 && ours[0] == len(l.plugins)-1 && sameJSON(l.plugins[ours[0]], want) {
		return Result{File: path, State: AlreadyChained}, nil
	}
	if len(ours) == 0 {
		// The configuration as its owner wrote it, for Uninstall.
		if err := atomicfile.Write(path+BackupSuffix, data, info.Mode().Perm()); err != nil {
			return Result{File: path}, err
		}
	}
	out, err := l.marshal(append(l.without(), want))
	if err != nil {
		return Result{File: path}, fmt.Errorf("chain into %s: %w", path, err)
	}
	if err := atomicfile.Write(path, out, info.Mode().Perm()); err != nil {
		return Result{File: path}, err
	}
	return Result{File: path, State: Chained}, nil
}

// installSingle turns the single-plugin configuration at path into a
// conflist of the same base name ending with want, and moves path aside
// (to path+BackupSuffix), so that the conflist is the primary one.
func installSingle(path string, data []byte, perm os.FileMode, want []byte) (Result, error) {
	if _, err := pluginType(data); err != nil {
		return Result{File: path}, fmt.Errorf("parse %s: %w", path, err)
	}
	var conf map[string]json.RawMessage
	if err := json.Unmarshal(data, &conf); err != nil {
		return Result{File: path}, fmt.Errorf("parse %s: %w", path, err)
	}
	if _, ok := conf["plugins"]; ok {
		return Result{File: path}, fmt.Errorf("parse %s: a plugin list in a %s file (libcni reads it as one plugin); name it .conflist", path, filepath.Ext(path))
	}
	conflist := strings.TrimSuffix(path, filepath.Ext(path)) + ".conflist"
	// A conflist of that name is overwritten only when it is apiary's
	// own (a conversion that was interrupted, or redone after the owner
	// of the .conf wrote it again).
	if existing, _, err := read(conflist); err == nil {
		l, perr := parseList(conflist, existing)
		_, backupErr := os.Stat(path + BackupSuffix)
		if (perr != nil || len(l.ours()) == 0) && backupErr != nil {
			return Result{File: path}, fmt.Errorf("chain into %s: %s exists beside it; remove one of them", path, conflist)
		}
	}
	top := map[string]json.RawMessage{"plugins": nil}
	for _, k := range []string{"cniVersion", "name"} {
		if v, ok := conf[k]; ok {
			top[k] = v
		}
	}
	l := &list{top: top}
	out, err := l.marshal([]json.RawMessage{json.RawMessage(bytes.TrimSpace(data)), want})
	if err != nil {
		return Result{File: path}, fmt.Errorf("chain into %s: %w", path, err)
	}
	// The conflist first: until the .conf is moved aside it still wins
	// (it sorts first), so the runtime sees one whole configuration or
	// the other at every moment.
	if err := atomicfile.Write(conflist, out, perm); err != nil {
		return Result{File: path}, err
	}
	if err := os.Rename(path, path+BackupSuffix); err != nil {
		return Result{File: path}, fmt.Errorf("move %s aside: %w", path, err)
	}
	if err := atomicfile.SyncDir(filepath.Dir(path)); err != nil {
		return Result{File: conflist}, err
	}
	return Result{File: conflist, State: Chained}, nil
}

// Uninstall takes apiary-cni out of the configuration named file in dir,
// or the primary one when file is "": it puts back the configuration as it
// was before Install when nothing else changed in it since, and otherwise
// removes apiary-cni's entries only.
func Uninstall(dir, file string) (Result, error) {
	path, err := target(dir, file)
	if err != nil || path == "" {
		return Result{State: NoConfig}, err
	}
	data, info, err := read(path)
	if err != nil {
		return Result{File: path}, err
	}
	if filepath.Ext(path) != ".conflist" {
		return Result{File: path, State: NotChained}, nil
	}
	l, err := parseList(path, data)
	if err != nil {
		return Result{File: path}, err
	}
	if len(l.ours()) == 0 {
		return Result{File: path, State: NotChained}, nil
	}
	rest := l.without()
	base := strings.TrimSuffix(path, ".conflist")
	for _, ext := range []string{".conf", ".json"} {
		single := base + ext
		orig, _, err := read(single + BackupSuffix)
		if err != nil {
			continue
		}
		if len(rest) != 1 || !sameJSON(rest[0], orig) {
			continue
		}
		// The .conf first: it sorts before the .conflist and takes over.
		if err := os.Rename(single+BackupSuffix, single); err != nil {
			return Result{File: path}, fmt.Errorf("put %s back: %w", single, err)
		}
		if err := os.Remove(path); err != nil {
			return Result{File: single}, fmt.Errorf("remove %s: %w", path, err)
		}
		return Result{File: single, State: Unchained}, atomicfile.SyncDir(filepath.Dir(path))
	}
	out, err := l.marshal(rest)
	if err != nil {
		return Result{File: path}, fmt.Errorf("unchain from %s: %w", path, err)
	}
	backup := path + BackupSuffix
	if orig, _, err := read(backup); err == nil && sameJSON(out, orig) {
		// Nothing else changed: the owner's file as it was, byte for byte.
		if err := os.Rename(backup, path); err != nil {
			return Result{File: path}, fmt.Errorf("put %s back: %w", path, err)
		}
		return Result{File: path, State: Unchained}, atomicfile.SyncDir(filepath.Dir(path))
	}
	if err := atomicfile.Write(path, out, info.Mode().Perm()); err != nil {
		return Result{File: path}, err
	}
	// A copy older than the owner's last change is no use any more.
	if err := os.Remove(backup); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return Result{File: path, State: Unchained}, fmt.Errorf("remove %s: %w", backup, err)
	}
	return Result{File: path, State: Unchained}, nil
}

// maxConfSize bounds what is read of a configuration file.
const maxConfSize = 1 << 20

func read(path string) ([]byte, fs.FileInfo, error) {
	info, err := os.Stat(path)
	if err != nil {
		return nil, nil, fmt.Errorf("CNI configuration: %w", err)
	}
	if !info.Mode().IsRegular() {
		return nil, nil, fmt.Errorf("CNI configuration %s: not a regular file", path)
	}
	if info.Size() > maxConfSize {
		return nil, nil, fmt.Errorf("CNI configuration %s: %d bytes, more than %d", path, info.Size(), maxConfSize)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("CNI configuration: %w", err)
	}
	return data, info, nil
}

// InstallBinary copies the plugin binary src into binDir as PluginType,
// atomically, unless an identical copy is already there. It reports
// whether it wrote.
func InstallBinary(src, binDir string) (bool, error) {
	data, err := os.ReadFile(src)
	if err != nil {
		return false, fmt.Errorf("apiary-cni binary: %w", err)
	}
	dst := filepath.Join(binDir, PluginType)
	if cur, err := os.ReadFile(dst); err == nil && bytes.Equal(cur, data) {
		return false, nil
	}
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		return false, fmt.Errorf("CNI binary directory: %w", err)
	}
	if err := atomicfile.Write(dst, data, 0o755); err != nil {
		return false, err
	}
	return true, nil
}
