// Package tablefile keeps a file in step with a statedb table, so that what
// the table holds survives a restart: the file is rewritten when the table
// changes, at most once per interval, and once more when the agent stops.
package tablefile

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/cilium/hive/cell"

	"github.com/apiary-net/apiary/internal/atomicfile"
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
}

// Run writes the checkpoint whenever the table changed and the contents
// differ from the file's, until ctx ends; then it writes once more. A
// failed write degrades h and is retried at the next change or interval.
func (w Writer) Run(ctx context.Context, h cell.Health, log *slog.Logger) error {
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
		if err := atomicfile.Write(w.Path, data, 0o600); err != nil {
			return fmt.Errorf("write %s checkpoint %s: %w", w.What, w.Path, err)
		}
		last = data
		return nil
	}
	for {
		watch := w.Watch()
		if err := write(); err != nil {
			h.Degraded(w.What+" checkpoint not written", err)
			log.Warn("Checkpoint not written", "checkpoint", w.What, "error", err)
		} else {
			h.OK("Checkpoint up to date")
		}
		select {
		case <-ctx.Done():
			return write()
		case <-watch:
		}
		select {
		case <-ctx.Done():
			return write()
		case <-time.After(w.Interval):
		}
	}
}
