package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/lmittmann/tint"
	"github.com/mattn/go-isatty"
)

// logOptions are the agent's logging flags. They are not hive config, as the
// logger must exist before the hive is populated.
type logOptions struct {
	Format string
	Level  string
}

// newLogger builds the agent's logger: tint text (coloured only on a
// terminal) or the standard JSON handler.
func newLogger(w io.Writer, o logOptions) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.Level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", o.Level)
	}
	switch o.Format {
	case "text":
		noColor := true
		if f, ok := w.(*os.File); ok {
			noColor = !isatty.IsTerminal(f.Fd())
		}
		return slog.New(tint.NewTextHandler(w, &tint.Options{
			Level:      level,
			TimeFormat: time.StampMilli,
			NoColor:    noColor,
		})), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level})), nil
	default:
		return nil, fmt.Errorf("--log-format %q: want text or json", o.Format)
	}
}

// withoutInvokeFailures drops hive's "Invoke failed" records: the agent
// prints the failing constructor's error itself, as one line, on exit.
func withoutInvokeFailures(log *slog.Logger) *slog.Logger {
	return slog.New(dropMessage{Handler: log.Handler(), msg: "Invoke failed"})
}

// dropMessage is a slog.Handler that drops records with one message.
type dropMessage struct {
	slog.Handler
	msg string
}

func (d dropMessage) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == d.msg {
		return nil
	}
	return d.Handler.Handle(ctx, r)
}

func (d dropMessage) WithAttrs(attrs []slog.Attr) slog.Handler {
	return dropMessage{Handler: d.Handler.WithAttrs(attrs), msg: d.msg}
}

func (d dropMessage) WithGroup(name string) slog.Handler {
	return dropMessage{Handler: d.Handler.WithGroup(name), msg: d.msg}
}
