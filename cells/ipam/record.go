package ipam

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/internal/atomicfile"
)

// record is what the agent remembers about an IP it holds, in
// <state-dir>/ipam/<kind>.json. It exists only while the plugin holds the
// lease it describes: it is written after the ADD that took the lease and
// removed before anything (DEL or ADD) changes the container ID's leases.
type record struct {
	Kind        string          `json:"kind"`
	ContainerID string          `json:"containerID"`
	IP          netip.Addr      `json:"ip"`
	IPv6        netip.Addr      `json:"ipv6,omitzero"`
	Delegate    delegate        `json:"delegate"`
	Result      json.RawMessage `json:"result"`
	Allocated   time.Time       `json:"allocated"`
}

// records stores one record per kind in a directory.
type records struct {
	dir string
}

// recordsDirName is the subdirectory of --state-dir holding the records.
const recordsDirName = "ipam"

func newRecords(stateDir string) (*records, error) {
	dir := filepath.Join(stateDir, recordsDirName)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("IPAM records: %w", err)
	}
	return &records{dir: dir}, nil
}

func (r *records) path(kind string) string { return filepath.Join(r.dir, kind+".json") }

// exists reports whether the kind has a record file, usable or not.
func (r *records) exists(kind string) bool {
	_, err := os.Lstat(r.path(kind))
	return !errors.Is(err, os.ErrNotExist)
}

// load returns the kind's record, nil if there is none. A record that cannot
// be decoded is an error: the caller decides what to do without it.
func (r *records) load(kind string) (*record, error) {
	data, err := os.ReadFile(r.path(kind))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read IPAM record: %w", err)
	}
	rec, err := decodeRecord(data)
	if err != nil {
		return nil, fmt.Errorf("IPAM record %s: %w", r.path(kind), err)
	}
	if rec.Kind != kind {
		return nil, fmt.Errorf("IPAM record %s: kind %q, want %q", r.path(kind), rec.Kind, kind)
	}
	return rec, nil
}

func decodeRecord(data []byte) (*record, error) {
	var rec record
	if err := json.Unmarshal(data, &rec); err != nil {
		return nil, err
	}
	if !rec.IP.IsValid() || rec.Delegate.Plugin == "" || rec.ContainerID == "" {
		return nil, errors.New("incomplete (no ip, plugin or container ID)")
	}
	return &rec, nil
}

// store writes the record durably: a temporary file, fsync, rename over the
// old one, fsync of the directory. A crash leaves the old record or the new
// one, never a torn one.
func (r *records) store(rec *record) error {
	data, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	if err := atomicfile.Write(r.path(rec.Kind), append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("IPAM record: %w", err)
	}
	return nil
}

// remove deletes the kind's record durably.
func (r *records) remove(kind string) error {
	if err := os.Remove(r.path(kind)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove IPAM record: %w", err)
	}
	return r.syncDir()
}

func (r *records) syncDir() error {
	if err := atomicfile.SyncDir(r.dir); err != nil {
		return fmt.Errorf("IPAM records: %w", err)
	}
	return nil
}

// lockFileName is the flock'ed file that makes one agent at a time (and its
// plugins, which inherit it) work on the leases.
const lockFileName = ".lock"

// tryLock opens and locks the records' lock file without blocking; it
// returns (nil, nil) when someone else holds it.
func (r *records) tryLock() (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(r.dir, lockFileName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("IPAM lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, nil
		}
		return nil, fmt.Errorf("IPAM lock: %w", err)
	}
	return f, nil
}
