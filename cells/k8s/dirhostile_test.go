package k8s

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The config dir is writable by whoever writes config, and what is in it is
// read by a root agent: names that are not plain files must neither hang nor
// exhaust the agent, and must be reported by name without disturbing the
// other files.

// symlinkTo makes the file a symlink to target.
func symlinkTo(target string) func(t *testing.T, path string) {
	return func(t *testing.T, path string) {
		require.NoError(t, os.Symlink(target, path))
	}
}

func TestDirRejectedFiles(t *testing.T) {
	tests := []struct {
		name string
		file string // its name in the config dir
		make func(t *testing.T, path string)
		// want matches the health error: the file's name and why it is
		// not read.
		want string
	}{{
		// Regular by stat, size 0, and endless: 8 bytes per page of the
		// address space.
		name: "proc-pagemap",
		file: "pm.yaml",
		make: symlinkTo("/proc/self/pagemap"),
		want: `pm\.yaml: more than --config-file-max-size=4Mi \(4194304 bytes\) to read, though its size says 0 \(symlink to /proc/self/pagemap\)`,
	}, {
		name: "dev-zero",
		file: "zero.yaml",
		make: symlinkTo("/dev/zero"),
		want: `zero\.yaml: not a regular file \(a character device\) \(symlink to /dev/zero\)`,
	}, {
		// Opening a FIFO for reading blocks until a writer comes, and a
		// read blocks until it writes.
		name: "fifo",
		file: "fifo.yaml",
		make: func(t *testing.T, path string) { require.NoError(t, syscall.Mkfifo(path, 0o644)) },
		want: `fifo\.yaml: not a regular file \(a named pipe\)`,
	}, {
		name: "fifo-through-symlink",
		file: "linked-fifo.yaml",
		make: func(t *testing.T, path string) {
			fifo := filepath.Join(t.TempDir(), "fifo")
			require.NoError(t, syscall.Mkfifo(fifo, 0o644))
			require.NoError(t, os.Symlink(fifo, path))
		},
		want: `linked-fifo\.yaml: not a regular file \(a named pipe\) \(symlink to /.*/fifo\)`,
	}, {
		name: "socket",
		file: "sock.yaml",
		make: func(t *testing.T, path string) {
			l, err := net.Listen("unix", path)
			require.NoError(t, err)
			l.(*net.UnixListener).SetUnlinkOnClose(false)
			t.Cleanup(func() { l.Close() })
		},
		want: `sock\.yaml: not a regular file \(a socket\)`,
	}, {
		name: "dangling-symlink",
		file: "gone.yaml",
		make: symlinkTo("/nonexistent/services.yaml"),
		want: `gone\.yaml: dangling symlink to /nonexistent/services\.yaml`,
	}, {
		name: "symlink-loop",
		file: "loop.yaml",
		make: symlinkTo("loop.yaml"),
		want: `loop\.yaml: too many levels of symbolic links`,
	}, {
		// Valid YAML, one byte over the default limit: not even opened.
		name: "too-big",
		file: "big.yaml",
		make: func(t *testing.T, path string) {
			data := []byte(svcYAML("default", "big", "1"))
			data = append(data, '#')
			data = append(data, strings.Repeat("x", 4<<20+1-len(data)-1)...)
			data = append(data, '\n')
			require.NoError(t, os.WriteFile(path, data, 0o644))
		},
		want: `big\.yaml: 4194305 bytes, more than --config-file-max-size=4Mi \(4194304 bytes\)`,
	}}

	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			writeFile(t, dir, "good.yaml", svcYAML("default", "good", "1"))
			tt.make(t, filepath.Join(dir, tt.file))

			var before runtime.MemStats
			runtime.ReadMemStats(&before)
			th := newTestHive(t, hiveOpts{configDir: dir, noStart: true})
			stop := startStoppable(th)

			// The other file is read, and the source is synced.
			ev := subscribe(t, th.services)
			expect(t, ev, "Upsert default/good v=1", "Sync")
			// The file is reported by name, with why, in health and once in
			// the log.
			th.waitHealth(`level=Degraded message=bad files: ` + regexp.QuoteMeta(tt.file) + ` error=` + tt.want)
			require.Equal(t, 1, th.records.count("file="+tt.file), "logged once")

			// A new good file is still picked up, and the rescan it brings
			// reports the same problem without logging it again.
			writeFile(t, dir, "later.yaml", svcYAML("default", "later", "1"))
			expect(t, ev, "Upsert default/later v=1")
			th.waitHealth(`level=Degraded message=bad files: ` + regexp.QuoteMeta(tt.file) + ` error=` + tt.want)
			require.Equal(t, 1, th.records.count("file="+tt.file), "logged once")

			// Memory stays bounded: the reads above are at most the limit
			// (4 MiB) plus one byte, twice. Without the limit, pagemap alone
			// is read at tens of MB a second until the agent is killed.
			var after runtime.MemStats
			runtime.ReadMemStats(&after)
			require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(128<<20), "bytes allocated")

			// Stopping with the file still there returns, and in time.
			require.NoError(t, stop())
		})
	}
}

// startStoppable starts th and returns the function that stops it, which a
// test calls to check that stopping works; the cleanup stops the hive if the
// test did not get that far.
func startStoppable(th *testHive) (stop func() error) {
	th.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	require.NoError(th.t, th.h.Start(th.log, ctx), "start")
	stopped := false
	stop = func() error {
		stopped = true
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		return th.h.Stop(th.log, ctx)
	}
	th.t.Cleanup(func() {
		if !stopped {
			stop()
		}
	})
	return stop
}

// A file that is replaced by something that can't be read keeps its
// objects, like a file whose content turns bad, until it is removed.
func TestDirFileReplacedByFIFO(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.yaml", svcYAML("default", "a", "1"))
	th := newTestHive(t, hiveOpts{configDir: dir})
	ev := subscribe(t, th.services)
	expect(t, ev, "Upsert default/a v=1", "Sync")

	fifo := filepath.Join(dir, ".a.yaml.fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o644))
	require.NoError(t, os.Rename(fifo, filepath.Join(dir, "a.yaml")))
	th.waitHealth(`level=Degraded message=bad files: a\.yaml error=a\.yaml: not a regular file \(a named pipe\)`)
	// The object stayed: the next event is the marker's, not a delete.
	writeFile(t, dir, "marker.yaml", svcYAML("default", "marker", "1"))
	expect(t, ev, "Upsert default/marker v=1")

	// Removed: its objects go, health recovers.
	require.NoError(t, os.Remove(filepath.Join(dir, "a.yaml")))
	expect(t, ev, "Delete default/a")
	th.waitHealth(`level=OK message=1 objects from 1 files error=$`)
}

// Subdirectories are not read; they are mentioned in the health message
// (and logged once at Info), which stays OK.
func TestDirSubdirectories(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.yaml", svcYAML("default", "a", "1"))
	for _, sub := range []string{"archive", "sub.yaml", "..2026_01_01"} {
		require.NoError(t, os.Mkdir(filepath.Join(dir, sub), 0o755))
		writeFile(t, filepath.Join(dir, sub), "x.yaml", svcYAML("default", "nested", "1"))
	}
	require.NoError(t, os.Symlink("archive", filepath.Join(dir, "linked.yml")))
	th := newTestHive(t, hiveOpts{configDir: dir})
	ev := subscribe(t, th.services)
	expect(t, ev, "Upsert default/a v=1", "Sync")
	// Hidden ones (a ConfigMap volume's data directories) go unmentioned.
	th.waitHealth(`level=OK message=1 objects from 1 files; subdirectories not read: archive, linked\.yml, sub\.yaml error=$`)

	require.NoError(t, os.RemoveAll(filepath.Join(dir, "archive")))
	require.NoError(t, os.Remove(filepath.Join(dir, "linked.yml")))
	th.waitHealth(`level=OK message=1 objects from 1 files; subdirectories not read: sub\.yaml error=$`)
	require.Zero(t, th.records.count("sub.yaml"), "no warning")
}

// Limits can be set from the environment as every flag.
func TestDirMaxSizeFromEnv(t *testing.T) {
	t.Setenv("APIARY_CONFIG_FILE_MAX_SIZE", "1Ki")
	dir := t.TempDir()
	big := svcYAML("default", "big", "1") + "#" + strings.Repeat("x", 1024) + "\n"
	writeFile(t, dir, "big.yaml", big)
	th := newTestHive(t, hiveOpts{configDir: dir})
	ev := subscribe(t, th.services)
	expect(t, ev, "Sync")
	th.waitHealth(fmt.Sprintf(`level=Degraded message=bad files: big\.yaml error=big\.yaml: %d bytes, more than --config-file-max-size=1Ki \(1024 bytes\)$`, len(big)))

	// Small enough again: read.
	writeFile(t, dir, "big.yaml", svcYAML("default", "big", "2"))
	expect(t, ev, "Upsert default/big v=2")
	th.waitHealth(`level=OK message=1 objects from 1 files`)
}

// A file of thousands of bad documents, and thousands of duplicates: health
// and the log name the files, count the problems and list the first few.
func TestDirManyProblems(t *testing.T) {
	dir := t.TempDir()
	const bad = 20000
	writeFile(t, dir, "many.yaml", strings.Repeat("kind: Service\n---\n", bad))
	const dups = 1000
	var svcs []string
	for i := range dups {
		svcs = append(svcs, svcYAML("default", fmt.Sprintf("s%d", i), "1"))
	}
	writeFile(t, dir, "a.yaml", docs(svcs...))
	writeFile(t, dir, "b.yaml", docs(svcs...))
	th := newTestHive(t, hiveOpts{configDir: dir})
	// Reading 22,000 documents takes seconds under the race detector on
	// a busy machine.
	th.waitHealthWithin(time.Minute, fmt.Sprintf(`level=Degraded message=bad files: b\.yaml, many\.yaml error=(?s)b\.yaml:1: Service default/s0 ignored: a\.yaml:1 .*`+
		`many\.yaml:1: document needs apiVersion and kind.*\n… and %d more problems \(%d in all\)$`, bad+dups-10, bad+dups))

	st := th.sourcesHealth()
	require.Less(t, len(st.Error), 4096, "health error")
	require.Equal(t, 10, strings.Count(st.Error, "\n"), "ten problems and the count")
	require.Less(t, len(st.Message), 256, "health message")
	for _, f := range []string{"many.yaml", "b.yaml"} {
		rec := th.records.longest("file=" + f)
		require.NotEmpty(t, rec, "logged")
		require.Less(t, len(rec), 4096, "log record of %s", f)
	}
	require.Contains(t, th.records.longest("file=many.yaml"), fmt.Sprintf("problems=%d", bad))
	require.Contains(t, th.records.longest("file=b.yaml"), fmt.Sprintf("problems=%d", dups))
}

// sourcesHealth returns the k8s-sources module's health.
func (th *testHive) sourcesHealth() (st struct{ Message, Error string }) {
	th.t.Helper()
	for _, s := range th.health.All() {
		if s.Scope == "k8s-sources" || strings.HasSuffix(s.Scope, ".k8s-sources") {
			st.Message, st.Error = s.Message, s.Error
			return st
		}
	}
	th.t.Fatal("no k8s-sources health scope")
	return st
}

// longest returns the longest Warn record containing substr.
func (r *recorder) longest(substr string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out string
	for _, w := range r.warns {
		if strings.Contains(w, substr) && len(w) > len(out) {
			out = w
		}
	}
	return out
}

// A file just under the limit can take seconds to decode (4 MiB of small
// Services: 8 s on a 2-core machine): stopping does not wait for that.
func TestDirStopWhileDecoding(t *testing.T) {
	// Four times the default, so that the decoding certainly outlasts the
	// stop's timeout unless the stop interrupts it.
	t.Setenv("APIARY_CONFIG_FILE_MAX_SIZE", "16Mi")
	dir := t.TempDir()
	var b strings.Builder
	for i := 0; b.Len() < 16<<20-200; i++ {
		b.WriteString(svcYAML("default", fmt.Sprintf("s%d", i), "1"))
		b.WriteString("---\n")
	}
	writeFile(t, dir, "many.yaml", b.String())
	th := newTestHive(t, hiveOpts{configDir: dir, noStart: true})
	stop := startStoppable(th)
	// Reading the file takes milliseconds; give the source the time to
	// be decoding it when it is stopped. (A slower machine stops it
	// earlier, which is as good.)
	time.Sleep(500 * time.Millisecond)
	require.NoError(t, stop())
}
