package health

import (
	"fmt"
	"regexp"
	"time"

	"github.com/cilium/hive/script"

	"github.com/apiary-net/apiary/tables"
)

// statusLine is how the `health` command prints a scope, and what its
// pattern is matched against.
func statusLine(s *tables.HealthStatus) string {
	return fmt.Sprintf("%s: level=%s message=%s error=%s", s.Scope, s.Level, s.Message, s.Error)
}

// healthCmd prints every scope, or with a regexp argument waits until a scope
// line matches it (until the script's context ends).
func healthCmd(r *Registry) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Show health, or wait until a scope matches a pattern",
			Args:    "[pattern]",
			Detail: []string{
				"Without a pattern, prints one line per scope to stdout:",
				"  <scope>: level=<level> message=<message> error=<error>",
				"With a pattern, waits until some scope's line matches it.",
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) == 0 {
				return func(*script.State) (string, string, error) {
					var out []byte
					for _, st := range r.All() {
						out = fmt.Appendln(out, statusLine(st))
					}
					return string(out), "", nil
				}, nil
			}
			re, err := regexp.Compile(args[0])
			if err != nil {
				return nil, fmt.Errorf("bad pattern: %w", err)
			}
			for {
				for _, st := range r.All() {
					if line := statusLine(st); re.MatchString(line) {
						s.Logf("matched: %s\n", line)
						return nil, nil
					}
				}
				select {
				case <-s.Context().Done():
					return nil, fmt.Errorf("no health scope matched %q: %w", args[0], s.Context().Err())
				case <-time.After(10 * time.Millisecond):
				}
			}
		},
	)
}
