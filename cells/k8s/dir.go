package k8s

import (
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/fsnotify/fsnotify"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

const (
	defaultDebounce = 100 * time.Millisecond
	// pollInterval is how often the directory is looked for when it can't
	// be watched (its parent doesn't exist, or inotify is unavailable).
	pollInterval = time.Second
)

// DirOptions tunes the directory source beyond its flag. Provide it (it is an
// optional dependency) to change the defaults, e.g. a short debounce in tests.
type DirOptions struct {
	// Debounce is how long the source waits after a file system event for
	// more events before it rescans (default 100ms). Bursts of events are
	// rescanned at the latest after 10 times that.
	Debounce time.Duration
}

// DirSource is the --config-dir source: it reads the Kubernetes objects in the
// *.yaml, *.yml and *.json files directly in the directory and watches it for
// changes, feeding every Resource of the kinds it finds.
//
// A file is applied as a whole: a file with a bad document is reported (log
// and health, with file:line) and skipped, and the objects it contributed
// before stay. When two files define the same object, the file whose name
// sorts first wins and the other is reported. A directory that doesn't exist
// counts as an empty one: the source is synced with no objects (so that
// pruning isn't blocked forever by a typo), reports degraded, and watches the
// parent for the directory to appear; removing the directory deletes its
// objects. A directory that exists but can't be read (e.g. permissions) is
// reported and leaves the objects as they were.
//
// Files should be replaced atomically (written aside and renamed over, as
// editors and ConfigMap volumes do). A file written in place may be read
// half written despite the debounce, so that its objects briefly go or it is
// briefly reported, until the write's last event brings a rescan.
type DirSource struct {
	dir      string // absolute; empty when disabled
	debounce time.Duration
	log      *slog.Logger
	health   cell.Health
	kinds    *Kinds
	rescan   chan struct{}

	mu       sync.Mutex
	sinks    map[schema.GroupVersionKind][]dirSink
	files    map[string]*dirFile // by base name
	objects  map[objectID]dirObject
	synced   bool
	kindsGen uint64
	// logged is the problem last logged per file ("" for the directory), so
	// that each distinct problem is logged once, not on every rescan.
	logged map[string]string
}

// dirSink is what a Resource implements to receive the directory's objects of
// its kind.
type dirSink interface {
	dirGVK() schema.GroupVersionKind
	// dirApply applies a batch of changes; a change with a nil object is a
	// delete.
	dirApply([]dirChange)
	dirSynced()
}

type dirChange struct {
	key Key
	obj Object
}

type objectID struct {
	gvk schema.GroupVersionKind
	key Key
}

type dirFile struct {
	hash [sha256.Size]byte
	// objs are the objects of registered kinds from the last content that
	// decoded without error.
	objs []Decoded
	// err is the problem with the current content; nil when it is good.
	err error
}

type dirObject struct {
	obj  Object
	file string
}

type dirSourceParams struct {
	cell.In

	Config  SourcesConfig
	Options DirOptions `optional:"true"`
	Log     *slog.Logger
	Health  cell.Health
	Kinds   *Kinds
}

func newDirSource(p dirSourceParams) (*DirSource, error) {
	d := &DirSource{
		debounce: cmp.Or(p.Options.Debounce, defaultDebounce),
		log:      p.Log,
		health:   p.Health,
		kinds:    p.Kinds,
		rescan:   make(chan struct{}, 1),
		sinks:    map[schema.GroupVersionKind][]dirSink{},
		files:    map[string]*dirFile{},
		objects:  map[objectID]dirObject{},
		logged:   map[string]string{},
	}
	if p.Config.ConfigDir != "" {
		abs, err := filepath.Abs(p.Config.ConfigDir)
		if err != nil {
			return nil, fmt.Errorf("config dir %s: %w", p.Config.ConfigDir, err)
		}
		d.dir = abs
	}
	return d, nil
}

// Enabled reports whether --config-dir is set.
func (d *DirSource) Enabled() bool {
	return d != nil && d.dir != ""
}

// Dir returns the absolute path of the directory, or "" when disabled.
func (d *DirSource) Dir() string {
	if d == nil {
		return ""
	}
	return d.dir
}

func (d *DirSource) subscribe(s dirSink) {
	d.mu.Lock()
	defer d.mu.Unlock()
	gvk := s.dirGVK()
	d.sinks[gvk] = append(d.sinks[gvk], s)
	if !d.synced {
		return
	}
	// A resource created after the first scan (not the usual case: they are
	// created during populate) catches up now. Its kind may be new, so files
	// are decoded again in case they hold documents that were skipped.
	var changes []dirChange
	for id, o := range d.objects {
		if id.gvk == gvk {
			changes = append(changes, dirChange{key: id.key, obj: o.obj})
		}
	}
	slices.SortFunc(changes, func(a, b dirChange) int { return compareKeys(a.key, b.key) })
	s.dirApply(changes)
	s.dirSynced()
	select {
	case d.rescan <- struct{}{}:
	default:
	}
}

// wantFile reports whether name is a file the source reads: YAML or JSON,
// not hidden (editors' swap files, Kubernetes ConfigMap volumes' ..data),
// not a backup.
func wantFile(name string) bool {
	if strings.HasPrefix(name, ".") || strings.HasSuffix(name, "~") {
		return false
	}
	switch strings.ToLower(filepath.Ext(name)) {
	case ".yaml", ".yml", ".json":
		return true
	}
	return false
}

// run watches the directory until ctx ends. It is the source's job.
func (d *DirSource) run(ctx context.Context, _ cell.Health) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		// Without inotify (e.g. out of instances) the directory is polled.
		d.log.Warn("Cannot watch config dir, polling it instead", "dir", d.dir, "error", err)
		w = nil
	} else {
		defer w.Close()
	}
	var (
		events     <-chan fsnotify.Event
		errs       <-chan error
		parent     = filepath.Dir(d.dir)
		dirWatched bool
		parWatched bool
	)
	if w != nil {
		events, errs = w.Events, w.Errors
	}
	// ensure watches the parent (to see the directory come and go) and the
	// directory (to see its files change). It reports whether the directory
	// watch was just added.
	ensure := func() bool {
		if w == nil {
			return false
		}
		if !parWatched && parent != d.dir {
			parWatched = w.Add(parent) == nil
		}
		if !dirWatched {
			if err := w.Add(d.dir); err == nil {
				dirWatched = true
				return true
			} else if !errors.Is(err, fs.ErrNotExist) {
				d.log.Debug("Cannot watch config dir", "dir", d.dir, "error", err)
			}
		}
		return false
	}

	// Watch first, then scan, so that no change falls in between.
	ensure()
	d.scan()

	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var deadline time.Time // when a burst of events is rescanned at the latest
	schedule := func() {
		now := time.Now()
		if deadline.IsZero() {
			deadline = now.Add(10 * d.debounce)
		}
		timer.Reset(min(d.debounce, deadline.Sub(now)))
	}
	ticker := time.NewTicker(pollInterval)
	defer ticker.Stop()

	for {
		select {
		case <-ctx.Done():
			return nil

		case ev, ok := <-events:
			if !ok {
				return nil
			}
			switch {
			case ev.Name == d.dir:
				// The directory itself was created, removed or renamed (seen
				// through the parent's or its own watch).
				if ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename) {
					if dirWatched {
						_ = w.Remove(d.dir) // a renamed directory is watched under its old name otherwise
						dirWatched = false
					}
				}
				ensure()
				schedule()
			case filepath.Dir(ev.Name) == d.dir:
				// Any change in the directory, including hidden names: a
				// ConfigMap volume updates its files by swapping the ..data
				// symlink.
				schedule()
			}

		case err, ok := <-errs:
			if !ok {
				return nil
			}
			// Most likely an event queue overflow: events were lost, so look
			// at everything again.
			d.log.Warn("Watching config dir failed, rescanning", "dir", d.dir, "error", err)
			schedule()

		case <-timer.C:
			deadline = time.Time{}
			d.scan()

		case <-d.rescan:
			d.scan()

		case <-ticker.C:
			if w != nil && dirWatched && (parWatched || parent == d.dir) {
				continue
			}
			ensure()
			d.scan()
		}
	}
}

// scan reads the directory, applies what changed and reports problems.
func (d *DirSource) scan() {
	d.mu.Lock()
	defer d.mu.Unlock()

	if g := d.kinds.gen(); g != d.kindsGen {
		// New kinds were registered: documents skipped so far may decode now.
		d.kindsGen = g
		for _, f := range d.files {
			f.hash = [sha256.Size]byte{}
		}
	}

	var dirProblem error
	entries, err := os.ReadDir(d.dir)
	switch {
	case err == nil:
	case errors.Is(err, fs.ErrNotExist):
		// A missing directory is an empty one: its objects are gone.
		dirProblem = fmt.Errorf("config dir %s does not exist", d.dir)
	default:
		// E.g. no permission. That may be passing, so keep what we have
		// rather than delete every object.
		d.report(fmt.Errorf("read config dir %s: %w", d.dir, err))
		d.markSynced()
		return
	}

	present := map[string]bool{}
	for _, e := range entries {
		name := e.Name()
		if !wantFile(name) {
			continue
		}
		path := filepath.Join(d.dir, name)
		info, err := os.Stat(path) // follows symlinks, as ConfigMap volumes use them
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed since ReadDir, or a dangling symlink
		}
		f := d.files[name]
		if f == nil {
			f = &dirFile{}
			d.files[name] = f
		}
		present[name] = true
		if err != nil {
			f.err, f.hash = fmt.Errorf("%s: %w", name, err), [sha256.Size]byte{}
			continue
		}
		if !info.Mode().IsRegular() {
			delete(present, name)
			continue
		}
		data, err := os.ReadFile(path)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				delete(present, name)
				continue
			}
			f.err, f.hash = fmt.Errorf("read %s: %w", name, err), [sha256.Size]byte{}
			continue
		}
		hash := sha256.Sum256(data)
		if hash == f.hash {
			continue // unchanged, and so is its error if it had one
		}
		f.hash = hash
		decoded, err := DecodeFile(name, data, d.kinds)
		if err != nil {
			f.err = err // keep f.objs: bad input loses nothing
			continue
		}
		f.err = nil
		f.objs = f.objs[:0:0]
		for _, o := range decoded {
			if o.Object == nil {
				d.log.Debug("Skipping object of unknown kind", "file", name, "line", o.Line, "gvk", o.GVK, "key", o.Key)
				continue
			}
			f.objs = append(f.objs, o)
		}
	}
	for name := range d.files {
		if !present[name] {
			delete(d.files, name)
		}
	}

	// Merge the files in name order: the first file to define an object
	// wins.
	next := map[objectID]dirObject{}
	conflicts := map[string][]error{}
	for _, name := range slices.Sorted(maps.Keys(d.files)) {
		for _, o := range d.files[name].objs {
			id := objectID{o.GVK, o.Key}
			if prev, ok := next[id]; ok {
				conflicts[name] = append(conflicts[name], fmt.Errorf("%s:%d: %s %s is already defined in %s",
					name, o.Line, o.GVK.Kind, o.Key, prev.file))
				continue
			}
			next[id] = dirObject{obj: o.Object, file: name}
		}
	}

	// Tell the resources what really changed. An object that decodes the
	// same as before keeps its old pointer, which is how resources and
	// subscribers know it didn't change.
	changes := map[schema.GroupVersionKind][]dirChange{}
	for id, o := range next {
		if old, ok := d.objects[id]; ok && equality.Semantic.DeepEqual(old.obj, o.obj) {
			next[id] = dirObject{obj: old.obj, file: o.file}
			continue
		}
		changes[id.gvk] = append(changes[id.gvk], dirChange{key: id.key, obj: o.obj})
	}
	for id := range d.objects {
		if _, ok := next[id]; !ok {
			changes[id.gvk] = append(changes[id.gvk], dirChange{key: id.key})
		}
	}
	d.objects = next
	for gvk, cs := range changes {
		slices.SortFunc(cs, func(a, b dirChange) int { return compareKeys(a.key, b.key) })
		for _, s := range d.sinks[gvk] {
			s.dirApply(cs)
		}
	}
	d.markSynced()

	var problems []error
	if dirProblem != nil {
		problems = append(problems, dirProblem)
	}
	for _, name := range slices.Sorted(maps.Keys(d.files)) {
		if err := errors.Join(append([]error{d.files[name].err}, conflicts[name]...)...); err != nil {
			problems = append(problems, fileProblem{name, err})
		}
	}
	d.report(problems...)
}

// fileProblem is what is wrong with one file.
type fileProblem struct {
	file string
	err  error
}

func (p fileProblem) Error() string { return p.err.Error() }
func (p fileProblem) Unwrap() error { return p.err }

// markSynced tells the resources that the first scan is done. Called with
// d.mu held.
func (d *DirSource) markSynced() {
	if d.synced {
		return
	}
	d.synced = true
	for _, ss := range d.sinks {
		for _, s := range ss {
			s.dirSynced()
		}
	}
}

// report logs problems that are new and sets health. Called with d.mu held.
func (d *DirSource) report(problems ...error) {
	logged := map[string]string{}
	var badFiles []string
	for _, p := range problems {
		file := ""
		if fp, ok := p.(fileProblem); ok {
			file = fp.file
			badFiles = append(badFiles, file)
		}
		msg := p.Error()
		logged[file] = msg
		if d.logged[file] == msg {
			continue
		}
		if file == "" {
			d.log.Warn("Config dir problem", "dir", d.dir, "error", p)
		} else {
			d.log.Warn("Skipping bad config file", "dir", d.dir, "file", file, "error", p)
		}
	}
	for file := range d.logged {
		if _, ok := logged[file]; !ok && file != "" {
			d.log.Info("Config file problem cleared", "dir", d.dir, "file", file)
		}
	}
	d.logged = logged

	switch {
	case len(problems) == 0:
		d.health.OK(fmt.Sprintf("%d objects from %d files", len(d.objects), len(d.files)))
	case len(badFiles) == 0:
		d.health.Degraded(problems[0].Error(), errors.Join(problems...))
	case len(badFiles) < len(problems):
		d.health.Degraded(fmt.Sprintf("%s; bad files: %s", problems[0].Error(), strings.Join(badFiles, ", ")), errors.Join(problems...))
	default:
		d.health.Degraded("bad files: "+strings.Join(badFiles, ", "), errors.Join(problems...))
	}
}
