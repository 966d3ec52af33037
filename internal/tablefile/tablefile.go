// Package tablefile keeps a file in step with a statedb table, so that what
// the table holds survives a restart: the file is rewritten when the table
// changes, at most once per interval, and once more when the agent stops; a
// write that fails is retried with backoff until it succeeds.
package tablefile

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/cilium/hive/cell"

	"github.com/apiary-net/apiary/internal/atomicfile"
)

// Retry delays after a failed write: the first retry comes after
// retryMin, each next one after twice the last, at most retryMax.
const (
	retryMin = time.Second
	retryMax = 30 * time.Second
)

// Writer describes one checkpoint file.
type Writer struct {
	// What names the checkpoint in errors, logs and health, e.g. "identity".
	What string
	// Path is the file.
	Path string
	// Interval is the least time between two writes.
	Interval time.Duration
	// Watch returns a channel that closes when the table next changes.
	Watch func() <-chan struct{}
	// Encode returns the file's contents for what the table holds now.
	Encode func() ([]byte, error)

	// writeFile replaces the file; tests make it fail. Nil: atomicfile.Write.
	writeFile func(path string, data []byte, perm os.FileMode) error
	// retryMin and retryMax override the retry delays in tests.
	retryMin, retryMax time.Duration
}

// Run writes the checkpoint whenever the table changed and the contents
// differ from the file's, until ctx ends; then it writes once more.
//
// A failed write (a full or read-only state directory) degrades h and is
// retried on its own, after 1 s, then twice as long each time up to 30 s,
// and at the next change of the table, whichever comes first, until a write
// succeeds and h is OK again: a checkpoint recovers once space is back,
// without waiting for the table to change.
func (w Writer) Run(ctx context.Context, h cell.Health, log *slog.Logger) error {
	writeFile := w.writeFile
	if writeFile == nil {
		writeFile = atomicfile.Write
	}
	minDelay, maxDelay := cmp.Or(w.retryMin, retryMin), cmp.Or(w.retryMax, retryMax)

	// An unchanged table after a restart rewrites nothing.
	last, _ := os.ReadFile(w.Path)
	write := func() error {
		data, err := w.Encode()
		if err != nil {
			return fmt.Errorf("encode %s checkpoint: %w", w.What, err)
		}
		if bytes.Equal(data, last) {
			return nil
		}
		if err := writeFile(w.Path, data, 0o600); err != nil {
			return fmt.Errorf("write %s checkpoint %s: %w", w.What, w.Path, err)
		}
		last = data
		return nil
	}

	var (
		failing   error // the last write's error, nil when it succeeded
		delay     time.Duration
		retry     *time.Timer
		retryChan <-chan time.Time // nil unless a retry is due
	)
	defer func() {
		if retry != nil {
			retry.Stop()
		}
	}()
	for {
		watch := w.Watch()
		if err := write(); err != nil {
			if failing == nil {
				delay = minDelay
			} else {
				delay = min(2*delay, maxDelay)
			}
			h.Degraded(w.What+" checkpoint not written", err)
			// Every retry fails the same way while the disk stays full: say
			// so once, and again only when the reason changes.
			if failing == nil || failing.Error() != err.Error() {
				log.Warn("Checkpoint not written; retrying", "checkpoint", w.What, "error", err, "retryIn", delay)
			} else {
				log.Debug("Checkpoint still not written", "checkpoint", w.What, "error", err, "retryIn", delay)
			}
			failing = err
			if retry == nil {
				retry = time.NewTimer(delay)
			} else {
				retry.Reset(delay)
			}
			retryChan = retry.C
		} else {
			if failing != nil {
				log.Info("Checkpoint written again", "checkpoint", w.What)
				failing = nil
			}
			retryChan = nil
			h.OK("Checkpoint up to date")
		}
		select {
		case <-ctx.Done():
			return write()
		case <-retryChan:
			continue // the retry delay is the wait
		case <-watch:
		}
		select {
		case <-ctx.Done():
			return write()
		case <-time.After(w.Interval):
		}
	}
}
