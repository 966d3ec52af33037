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
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/apiary-net/apiary/internal/textcut"
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
// Only regular files are read, through symlinks too (ConfigMap volumes are
// made of them), and only up to --config-file-max-size: a name that is a
// FIFO, socket or device, a dangling symlink, a file that is too big (or, as
// /proc files that say size 0, yields more than that) is reported by name
// (log at Warn and health) and not read. Reading never blocks (files are
// opened O_NONBLOCK) and stops when the source stops. Subdirectories are not
// read: each is logged once at Info and named in the health message, which
// stays OK.
//
// A file is applied as a whole: a file with a bad document, or one that is
// not read, is reported (log and health, with file:line) and skipped, and the
// objects it contributed before stay. When two files define the same object,
// the file whose name sorts first keeps it and each other one is reported for
// it, naming the file and line that keep it. Log records and health list the
// first few problems and count the rest. A directory that doesn't exist
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
	maxSize  int64  // --config-file-max-size in bytes
	maxFlag  string // and as given
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
	// subdirs are the subdirectories seen by the last scan, each logged
	// once when it appears.
	subdirs map[string]bool
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
	// err is the problem with the current content (bounded: the first few
	// and a count); nil when it is good.
	err *problemList
}

type dirObject struct {
	obj  Object
	file string
	line int
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
		subdirs:  map[string]bool{},
	}
	q, err := apiresource.ParseQuantity(p.Config.ConfigFileMaxSize)
	if err != nil {
		return nil, fmt.Errorf("--config-file-max-size=%s: want bytes or a quantity such as 4Mi: %w", p.Config.ConfigFileMaxSize, err)
	}
	d.maxSize, d.maxFlag = q.Value(), p.Config.ConfigFileMaxSize
	if d.maxSize <= 0 {
		return nil, fmt.Errorf("--config-file-max-size=%s must be positive", p.Config.ConfigFileMaxSize)
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
	d.scan(ctx)

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
			d.scan(ctx)

		case <-d.rescan:
			d.scan(ctx)

		case <-ticker.C:
			if w != nil && dirWatched && (parWatched || parent == d.dir) {
				continue
			}
			ensure()
			d.scan(ctx)
		}
	}
}

// scan reads the directory, applies what changed and reports problems. It
// gives up, applying nothing, as soon as ctx ends.
func (d *DirSource) scan(ctx context.Context) {
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
		d.report(fmt.Errorf("read config dir %s: %w", d.dir, err), nil)
		d.markSynced()
		return
	}

	present := map[string]bool{}
	subdirs := map[string]bool{}
	for _, e := range entries {
		name := e.Name()
		if !wantFile(name) {
			// Hidden ones are ConfigMap volumes' ..data and what it points
			// to, not worth a word.
			if e.IsDir() && !strings.HasPrefix(name, ".") {
				subdirs[name] = true
			}
			continue
		}
		// Symlinks are followed, as ConfigMap volumes use them, but only
		// to regular files, and only so many bytes are read.
		data, err := readConfigFile(ctx, filepath.Join(d.dir, name), d.maxSize, d.maxFlag)
		if ctx.Err() != nil {
			return // stopping
		}
		switch {
		case errors.Is(err, errFileGone):
			continue // removed since ReadDir
		case errors.Is(err, errIsDir):
			subdirs[name] = true
			continue
		}
		f := d.files[name]
		if f == nil {
			f = &dirFile{}
			d.files[name] = f
		}
		present[name] = true
		if err != nil {
			// Not read (not a regular file, too big, a dangling symlink,
			// unreadable): reported, and like bad content it loses nothing.
			f.err, f.hash = newProblemList(name, fmt.Errorf("%s: %w", name, err)), [sha256.Size]byte{}
			continue
		}
		hash := sha256.Sum256(data)
		if hash == f.hash {
			continue // unchanged, and so is its error if it had one
		}
		decoded, err := decodeFile(ctx, name, data, d.kinds)
		if ctx.Err() != nil {
			return // stopping
		}
		f.hash = hash
		if err != nil {
			f.err = newProblemList(name, err) // keep f.objs: bad input loses nothing
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
	for _, name := range slices.Sorted(maps.Keys(subdirs)) {
		if !d.subdirs[name] {
			d.log.Info("Not reading a subdirectory of the config dir: only files directly in it are read",
				"dir", d.dir, "subdir", name)
		}
	}
	d.subdirs = subdirs

	// Merge the files in name order: the first file to define an object
	// keeps it, and every later file that defines it too is reported for
	// it, naming the file that keeps it.
	next := map[objectID]dirObject{}
	conflicts := map[string]*problemList{}
	for _, name := range slices.Sorted(maps.Keys(d.files)) {
		for _, o := range d.files[name].objs {
			id := objectID{o.GVK, o.Key}
			if kept, ok := next[id]; ok {
				l := conflicts[name]
				if l == nil {
					l = &problemList{file: name}
					conflicts[name] = l
				}
				l.addf("%s:%d: %s %s ignored: %s:%d defines it too and is used, as it comes first by name",
					name, o.Line, o.GVK.Kind, o.Key, kept.file, kept.line)
				continue
			}
			next[id] = dirObject{obj: o.Object, file: name, line: o.Line}
		}
	}

	// Tell the resources what really changed. An object that decodes the
	// same as before keeps its old pointer, which is how resources and
	// subscribers know it didn't change.
	changes := map[schema.GroupVersionKind][]dirChange{}
	for id, o := range next {
		if old, ok := d.objects[id]; ok && equality.Semantic.DeepEqual(old.obj, o.obj) {
			next[id] = dirObject{obj: old.obj, file: o.file, line: o.line}
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

	var bad []fileProblem
	for _, name := range slices.Sorted(maps.Keys(d.files)) {
		own, dup := d.files[name].err, conflicts[name]
		if own.empty() && dup.empty() {
			continue
		}
		l := &problemList{file: name}
		l.merge(own)
		l.merge(dup)
		bad = append(bad, fileProblem{file: name, problems: l, skipped: !own.empty()})
	}
	d.report(dirProblem, bad)
}

// fileProblem is what is wrong with one file.
type fileProblem struct {
	file     string
	problems *problemList
	// skipped: the file's content was not applied (it is bad or could not
	// be read), as opposed to only some of its objects being ignored as
	// duplicates.
	skipped bool
}

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

// report logs the problems that are new and sets health. Log records and
// health list the first few problems and count the rest, so that they stay
// small whatever the files hold. Called with d.mu held.
func (d *DirSource) report(dirProblem error, bad []fileProblem) {
	logged := map[string]string{}
	if dirProblem != nil {
		msg := textcut.Cut(dirProblem.Error(), maxProblemLen)
		logged[""] = msg
		if d.logged[""] != msg {
			d.log.Warn("Config dir problem", "dir", d.dir, "error", msg)
		}
	}
	for _, p := range bad {
		msg := p.problems.Error()
		logged[p.file] = msg
		if d.logged[p.file] == msg {
			continue
		}
		what := "Skipping bad config file"
		if !p.skipped {
			what = "Ignoring objects that an earlier config file defines"
		}
		d.log.Warn(what, "dir", d.dir, "file", p.file, "problems", p.problems.total, "error", msg)
	}
	for file := range d.logged {
		if _, ok := logged[file]; !ok && file != "" {
			d.log.Info("Config file problem cleared", "dir", d.dir, "file", file)
		}
	}
	d.logged = logged

	// Subdirectories are not a problem, but say so, as someone may expect
	// their files to be read.
	subdirs := ""
	if len(d.subdirs) > 0 {
		subdirs = "; subdirectories not read: " + nameList(slices.Sorted(maps.Keys(d.subdirs)), maxListedFiles)
	}
	if dirProblem == nil && len(bad) == 0 {
		d.health.OK(fmt.Sprintf("%d objects from %d files%s", len(d.objects), len(d.files), subdirs))
		return
	}
	all := summarize(dirProblem, bad)
	names := make([]string, len(bad))
	for i, p := range bad {
		names[i] = p.file
	}
	var msg string
	switch {
	case len(bad) == 0:
		msg = all.first[0]
	case dirProblem != nil:
		msg = fmt.Sprintf("%s; bad files: %s", all.first[0], nameList(names, maxListedFiles))
	default:
		msg = "bad files: " + nameList(names, maxListedFiles)
	}
	d.health.Degraded(msg+subdirs, all)
}

// summarize puts the problems of the directory and of every bad file in one
// bounded list. The listed problems are shared out round robin, so that each
// bad file shows at least its first one (as long as there is room), and
// grouped by file.
func summarize(dirProblem error, bad []fileProblem) *problemList {
	all := &problemList{}
	all.add(dirProblem)
	quota := make([]int, len(bad))
	for room := maxListedProblems - len(all.first); room > 0; {
		progress := false
		for i, p := range bad {
			if room > 0 && quota[i] < len(p.problems.first) {
				quota[i]++
				room--
				progress = true
			}
		}
		if !progress {
			break
		}
	}
	for i, p := range bad {
		all.first = append(all.first, p.problems.first[:quota[i]]...)
		all.total += p.problems.total
	}
	return all
}
