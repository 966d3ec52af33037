// Package dirlock makes sure that one agent at a time uses a directory: two
// agents on the same --state-dir or --bpf-pin-dir would overwrite each
// other's checkpoints and prune each other's map entries.
//
// A lock is an exclusive flock(2), taken without waiting and held until
// Release or until the process dies: the kernel drops it with the last
// descriptor of the open file, so a kill -9 never leaves a stale lock
// behind, and there is nothing to clean up. The descriptors are close-on-exec,
// so programs the agent runs (CNI plugins) do not inherit the lock.
package dirlock

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// HeldError says that another process holds the lock.
type HeldError struct {
	// Path is the locked file or directory.
	Path string
	// PID is the holder's process ID, 0 when it cannot be found out.
	PID int
}

func (e *HeldError) Error() string {
	if e.PID == 0 {
		return fmt.Sprintf("another apiary agent (pid unknown) holds %s", e.Path)
	}
	return fmt.Sprintf("another apiary agent (pid %d) holds %s", e.PID, e.Path)
}

// Lock is a held lock.
type Lock struct {
	f *os.File
}

// Release drops the lock. A released or nil Lock does nothing.
func (l *Lock) Release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close() // closing the only descriptor drops the flock
	l.f = nil
	return err
}

// File locks the file at path, creating it if missing, and writes this
// process's ID in it for people and for the error another agent gets. The
// file is never removed: removing a lock file lets two processes lock two
// different files of the same name.
func File(path string) (*Lock, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	if err := lock(f); err != nil {
		pid := holder(f)
		if pid == 0 {
			pid = pidIn(f)
		}
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, &HeldError{Path: path, PID: pid}
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	pid := []byte(strconv.Itoa(os.Getpid()) + "\n")
	if err := f.Truncate(0); err != nil {
		f.Close()
		return nil, fmt.Errorf("write pid to %s: %w", path, err)
	}
	if _, err := f.WriteAt(pid, 0); err != nil {
		f.Close()
		return nil, fmt.Errorf("write pid to %s: %w", path, err)
	}
	return &Lock{f: f}, nil
}

// Dir locks the directory at path itself, for directories that cannot hold
// a lock file, such as a pin directory on bpffs (which only takes pins and
// directories). The holder's ID is found in /proc/locks.
func Dir(path string) (*Lock, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, err
	}
	if err := lock(f); err != nil {
		pid := holder(f)
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, &HeldError{Path: path, PID: pid}
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return &Lock{f: f}, nil
}

func lock(f *os.File) error {
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// pidIn returns the process ID written in the lock file f, or 0.
func pidIn(f *os.File) int {
	buf := make([]byte, 32)
	n, _ := f.ReadAt(buf, 0)
	pid, err := strconv.Atoi(string(bytes.TrimSpace(buf[:n])))
	if err != nil || pid <= 0 {
		return 0
	}
	return pid
}

// holder returns the ID of the process holding a flock on f's file, as
// /proc/locks shows it (in this process's PID namespace), or 0.
func holder(f *os.File) int {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0
	}
	locks, err := os.Open("/proc/locks")
	if err != nil {
		return 0
	}
	defer locks.Close()
	return holderIn(locks, unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
}

// holderIn finds the holder of a FLOCK on the inode ino of device
// major:minor in the text of /proc/locks, whose lines read
//
//	1: FLOCK  ADVISORY  WRITE 1234 00:1f:5678 0 EOF
//
// and whose waiters' lines carry a "->" before the type.
func holderIn(locks io.Reader, major, minor uint32, ino uint64) int {
	want := fmt.Sprintf("%02x:%02x:%d", major, minor, ino)
	sc := bufio.NewScanner(locks)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 || fields[1] != "FLOCK" || fields[5] != want {
			continue
		}
		if pid, err := strconv.Atoi(fields[4]); err == nil && pid > 0 {
			return pid
		}
	}
	return 0
}
