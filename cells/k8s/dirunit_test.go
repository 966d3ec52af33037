package k8s

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

func TestConfigFileMaxSizeFlag(t *testing.T) {
	tests := []struct {
		value   string
		want    int64
		wantErr string
	}{
		{value: "4Mi", want: 4 << 20},
		{value: "500k", want: 500000},
		{value: "1048576", want: 1 << 20},
		{value: "0", wantErr: "--config-file-max-size=0 must be positive"},
		{value: "-1Ki", wantErr: "--config-file-max-size=-1Ki must be positive"},
		{value: "", wantErr: "--config-file-max-size=: want bytes or a quantity such as 4Mi"},
		{value: "4 MB", wantErr: "--config-file-max-size=4 MB: want bytes or a quantity such as 4Mi"},
	}
	for _, tt := range tests {
		t.Run(tt.value, func(t *testing.T) {
			d, err := newDirSource(dirSourceParams{
				Config: SourcesConfig{ConfigDir: t.TempDir(), ConfigFileMaxSize: tt.value},
				Log:    hivetest.Logger(t),
				Kinds:  NewKinds(),
			})
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, d.maxSize)
		})
	}
}

func TestReadConfigFile(t *testing.T) {
	dir := t.TempDir()
	path := func(name string) string { return filepath.Join(dir, name) }
	require.NoError(t, os.WriteFile(path("ok.yaml"), []byte("12345678"), 0o644))
	require.NoError(t, os.Symlink("ok.yaml", path("link.yaml")))
	require.NoError(t, os.Mkdir(path("sub"), 0o755))
	require.NoError(t, syscall.Mkfifo(path("fifo"), 0o644))

	tests := []struct {
		path    string
		limit   int64
		want    string
		wantErr error
		errText string
	}{
		{path: path("ok.yaml"), limit: 8, want: "12345678"},
		{path: path("link.yaml"), limit: 8, want: "12345678"},
		{path: path("ok.yaml"), limit: 7, errText: "8 bytes, more than --config-file-max-size=7 (7 bytes)"},
		{path: path("missing"), wantErr: errFileGone},
		{path: path("sub"), wantErr: errIsDir},
		{path: path("fifo"), errText: "not a regular file (a named pipe)"},
		{path: "/dev/null", errText: "not a regular file (a character device)"},
		// Both a FIFO and endless: bounded, and in reads of a multiple of
		// 8 bytes, which pagemap insists on.
		{path: "/proc/self/pagemap", limit: 1000, errText: "more than --config-file-max-size=1000 (1000 bytes) to read, though its size says 0"},
	}
	for _, tt := range tests {
		t.Run(filepath.Base(tt.path), func(t *testing.T) {
			data, err := readConfigFile(context.Background(), tt.path, max(tt.limit, 1), fmt.Sprint(max(tt.limit, 1)))
			switch {
			case tt.wantErr != nil:
				require.ErrorIs(t, err, tt.wantErr)
			case tt.errText != "":
				require.EqualError(t, err, tt.errText)
			default:
				require.NoError(t, err)
				require.Equal(t, tt.want, string(data))
			}
		})
	}

	// A cancelled context stops a read at once.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := readConfigFile(ctx, "/proc/self/pagemap", 1<<30, "1Gi")
	require.ErrorIs(t, err, context.Canceled)
}

// A read that would block returns at once instead.
func TestFDReaderWouldBlock(t *testing.T) {
	var p [2]int
	require.NoError(t, syscall.Pipe2(p[:], syscall.O_NONBLOCK|syscall.O_CLOEXEC))
	defer syscall.Close(p[0])
	defer syscall.Close(p[1])
	done := make(chan error, 1)
	go func() {
		_, err := (&fdReader{ctx: context.Background(), fd: p[0]}).Read(make([]byte, 10))
		done <- err
	}()
	select {
	case err := <-done:
		require.ErrorIs(t, err, errWouldBlock)
	case <-time.After(timeout):
		t.Fatal("read blocked")
	}
}

func TestProblemList(t *testing.T) {
	var errs []error
	for i := range 25 {
		errs = append(errs, fmt.Errorf("f.yaml:%d: bad", i+1))
	}
	// Nested joins and multi-line errors count one problem a line.
	l := newProblemList("f.yaml", errors.Join(errors.Join(errs[:20]...), errors.New(strings.Join([]string{"f.yaml:21: a", "f.yaml:22: b"}, "\n"))))
	require.Equal(t, 22, l.total)
	want := "f.yaml:1: bad\nf.yaml:2: bad\nf.yaml:3: bad\nf.yaml:4: bad\nf.yaml:5: bad\n" +
		"f.yaml:6: bad\nf.yaml:7: bad\nf.yaml:8: bad\nf.yaml:9: bad\nf.yaml:10: bad\n" +
		"f.yaml: … and 12 more problems (22 in all)"
	require.Equal(t, want, l.Error())

	// Few problems: just them.
	require.Equal(t, "f.yaml:1: bad\nf.yaml:2: bad", newProblemList("f.yaml", errors.Join(errs[:2]...)).Error())

	// A long problem is cut.
	long := newProblemList("f.yaml", errors.New("f.yaml:1: "+strings.Repeat("é", 1000)))
	require.LessOrEqual(t, len(long.first[0]), maxProblemLen+len("… (9999 more bytes)"))
	require.Contains(t, long.Error(), "… (1498 more bytes)")

	// Across files, each bad file shows its first problems.
	a := newProblemList("a.yaml", errors.Join(errs...))
	b := newProblemList("b.yaml", errors.New("b.yaml:1: bad"))
	c := newProblemList("c.yaml", errors.Join(errs[:3]...))
	all := summarize(errors.New("dir problem"), []fileProblem{{file: "a.yaml", problems: a}, {file: "b.yaml", problems: b}, {file: "c.yaml", problems: c}})
	require.Equal(t, 1+25+1+3, all.total)
	require.Equal(t, []string{"dir problem",
		"f.yaml:1: bad", "f.yaml:2: bad", "f.yaml:3: bad", "f.yaml:4: bad", "f.yaml:5: bad",
		"b.yaml:1: bad",
		"f.yaml:1: bad", "f.yaml:2: bad", "f.yaml:3: bad"}, all.first)

	require.Equal(t, "a, b", nameList([]string{"a", "b"}, 2))
	require.Equal(t, "a, b and 2 more", nameList([]string{"a", "b", "c", "d"}, 2))
}

func TestDecodeFileCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := decodeFile(ctx, "f.yaml", []byte(svcYAML("default", "a", "1")), NewKinds())
	require.ErrorIs(t, err, context.Canceled)
	// A List checks between items too.
	list := "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: a}\n"
	_, err = decodeDocument(ctx, "f.yaml", mustNode(t, list), NewKinds())
	require.ErrorIs(t, err, context.Canceled)
}

func mustNode(t *testing.T, s string) *yaml.Node {
	t.Helper()
	var doc yaml.Node
	require.NoError(t, yaml.Unmarshal([]byte(s), &doc))
	return doc.Content[0]
}
