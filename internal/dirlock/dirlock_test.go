package dirlock

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// A flock belongs to an open file description, so a second open in the same
// process conflicts like another process would.

func TestFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "apiary.lock")
	l, err := File(path)
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil || strings.TrimSpace(string(data)) != strconv.Itoa(os.Getpid()) {
		t.Errorf("lock file holds %q (%v), want this process's pid %d", data, err, os.Getpid())
	}

	_, err = File(path)
	var held *HeldError
	if !errors.As(err, &held) {
		t.Fatalf("second lock: got %v, want a HeldError", err)
	}
	if held.PID != os.Getpid() || held.Path != path {
		t.Errorf("got %+v, want pid %d and path %s", held, os.Getpid(), path)
	}
	want := "another apiary agent (pid " + strconv.Itoa(os.Getpid()) + ") holds " + path
	if err.Error() != want {
		t.Errorf("got %q, want %q", err, want)
	}

	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	l2, err := File(path)
	if err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	l2.Release()
	if _, err := os.Stat(path); err != nil {
		t.Errorf("the lock file must stay: %v", err)
	}
}

func TestFileOldPIDReplaced(t *testing.T) {
	path := filepath.Join(t.TempDir(), "apiary.lock")
	if err := os.WriteFile(path, []byte("99999999 and more\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	l, err := File(path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	data, _ := os.ReadFile(path)
	if string(data) != strconv.Itoa(os.Getpid())+"\n" {
		t.Errorf("lock file holds %q", data)
	}
}

func TestDirOnBPFFS(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	l, err := Dir(dir)
	if err != nil {
		t.Fatal(err)
	}
	_, err = Dir(dir)
	var held *HeldError
	if !errors.As(err, &held) {
		t.Fatalf("second lock: got %v, want a HeldError", err)
	}
	// No file on bpffs: the pid comes from /proc/locks.
	if held.PID != os.Getpid() {
		t.Errorf("holder pid %d, want %d", held.PID, os.Getpid())
	}
	l.Release()
	l, err = Dir(dir)
	if err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	l.Release()
}

func TestHolderIn(t *testing.T) {
	locks := `1: POSIX  ADVISORY  WRITE 700 00:1f:42 0 EOF
2: FLOCK  ADVISORY  WRITE 812 00:1f:4242 0 EOF
2: -> FLOCK  ADVISORY  WRITE 900 00:1f:42 0 EOF
3: FLOCK  ADVISORY  WRITE 1234 00:1f:42 0 EOF
4: FLOCK  ADVISORY  WRITE 77 103:02:42 0 EOF
`
	for _, tc := range []struct {
		major, minor uint32
		ino          uint64
		want         int
	}{
		{0, 0x1f, 42, 1234},
		{0x103, 2, 42, 77},
		{0, 0x1f, 7, 0},
	} {
		if got := holderIn(strings.NewReader(locks), tc.major, tc.minor, tc.ino); got != tc.want {
			t.Errorf("holder of %x:%x:%d = %d, want %d", tc.major, tc.minor, tc.ino, got, tc.want)
		}
	}
}
