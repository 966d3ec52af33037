package k8s

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

var (
	// errFileGone: the name went away between listing the directory and
	// reading it. The next scan (its removal is an event) sees it gone.
	errFileGone = errors.New("file is gone")
	// errIsDir: the name is a directory (or a symlink to one).
	errIsDir = errors.New("is a directory")
	// errWouldBlock: a read returned EAGAIN, which no plain file does.
	errWouldBlock = errors.New("reading it would block (not a plain file)")
)

// readChunk is the size of one read(2); ctx is checked between them.
const readChunk = 64 << 10

// readConfigFile reads the file at path for the directory source, refusing
// anything that is not a regular file of at most limit bytes. It never blocks
// on a FIFO or a device (it checks the type before opening, opens with
// O_NONBLOCK, and checks again on the open file in case the name was
// replaced), never reads more than limit+1 bytes (files in /proc say size 0
// and may be endless), and gives up as soon as ctx ends.
//
// Symlinks are followed (ConfigMap volumes are made of them). The errors
// are short, without the path, for the caller to prefix with the file's
// name; errFileGone and errIsDir are for the caller to act on.
func readConfigFile(ctx context.Context, path string, limit int64, limitFlag string) ([]byte, error) {
	info, err := os.Stat(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if target, lerr := os.Readlink(path); lerr == nil {
				return nil, fmt.Errorf("dangling symlink to %s", target)
			}
			return nil, errFileGone
		}
		return nil, withLink(path, unwrapPath(err))
	}
	if info.IsDir() {
		return nil, errIsDir
	}
	if !info.Mode().IsRegular() {
		return nil, withLink(path, fmt.Errorf("not a regular file (%s)", fileType(info.Mode())))
	}
	if info.Size() > limit {
		return nil, withLink(path, tooBig(info.Size(), limit, limitFlag))
	}

	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, errFileGone
		}
		return nil, withLink(path, fmt.Errorf("open: %w", err))
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, withLink(path, fmt.Errorf("fstat: %w", err))
	}
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFDIR:
		return nil, errIsDir
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		return nil, withLink(path, fmt.Errorf("not a regular file (%s)", fileTypeBits(st.Mode)))
	case st.Size > limit:
		return nil, withLink(path, tooBig(st.Size, limit, limitFlag))
	}

	data, err := io.ReadAll(io.LimitReader(&fdReader{ctx: ctx, fd: fd}, limit+1))
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, withLink(path, fmt.Errorf("read: %w", err))
	}
	if int64(len(data)) > limit {
		// A file whose size stat doesn't tell, such as /proc/self/pagemap.
		return nil, withLink(path, fmt.Errorf("more than --config-file-max-size=%s (%d bytes) to read, though its size says %d",
			limitFlag, limit, st.Size))
	}
	return data, nil
}

func tooBig(size, limit int64, limitFlag string) error {
	return fmt.Errorf("%d bytes, more than --config-file-max-size=%s (%d bytes)", size, limitFlag, limit)
}

// withLink adds where a symlink points to err, as the name alone may not say
// what was read.
func withLink(path string, err error) error {
	if target, lerr := os.Readlink(path); lerr == nil {
		return fmt.Errorf("%w (symlink to %s)", err, target)
	}
	return err
}

func unwrapPath(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

func fileType(m fs.FileMode) string {
	switch {
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeCharDevice != 0:
		return "a character device"
	case m&fs.ModeDevice != 0:
		return "a block device"
	}
	return "type " + m.Type().String()
}

func fileTypeBits(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFIFO:
		return "a named pipe"
	case unix.S_IFSOCK:
		return "a socket"
	case unix.S_IFCHR:
		return "a character device"
	case unix.S_IFBLK:
		return "a block device"
	case unix.S_IFLNK:
		return "a symlink"
	}
	return fmt.Sprintf("mode %#o", mode&unix.S_IFMT)
}

// fdReader reads a file descriptor with plain read(2) calls, bypassing Go's
// poller, so that a descriptor opened O_NONBLOCK returns EAGAIN (as
// errWouldBlock) instead of parking the reader until data comes. It reads
// readChunk bytes at a time into its own buffer whatever the caller asks
// for, as some /proc files (pagemap) take only reads of a multiple of 8 bytes
// and io.LimitReader asks for odd amounts; and it stops with ctx's error once
// ctx ends.
type fdReader struct {
	ctx  context.Context
	fd   int
	buf  []byte
	r, w int // buf[r:w] is read but not returned yet
}

func (f *fdReader) Read(p []byte) (int, error) {
	if err := f.ctx.Err(); err != nil {
		return 0, err
	}
	if f.r == f.w {
		if f.buf == nil {
			f.buf = make([]byte, readChunk)
		}
		n, err := f.fill()
		if err != nil {
			return 0, err
		}
		f.r, f.w = 0, n
	}
	n := copy(p, f.buf[f.r:f.w])
	f.r += n
	return n, nil
}

func (f *fdReader) fill() (int, error) {
	for {
		n, err := unix.Read(f.fd, f.buf)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EAGAIN):
			return 0, errWouldBlock
		case err != nil:
			return 0, err
		case n == 0:
			return 0, io.EOF
		}
		return n, nil
	}
}
