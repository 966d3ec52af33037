package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/cilium/hive/script"

	"github.com/apiary-net/apiary/apiarytest"
)

// TestScript runs testdata/*.txtar at the top of the repository against the
// whole agent composition, with the CLI available as the `apiary` command.
func TestScript(t *testing.T) {
	apiarytest.Run(t, "../testdata/*.txtar", agentCells,
		apiarytest.WithCommand("apiary", cliCmd))
}

// cliCmd runs the apiary CLI in-process, pointed at the hive's API.
func cliCmd(apiURL func() (string, error)) script.Cmd {
	return script.Command(
		script.CmdUsage{Summary: "Run the apiary CLI against the agent under test", Args: "args..."},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			url, err := apiURL()
			if err != nil {
				return nil, err
			}
			if len(args) > 0 && args[0] == "db" {
				args = append([]string{"db", "--server", url}, args[1:]...)
			}
			var stdout, stderr bytes.Buffer
			root := newRootCmd(&stdout, &stderr)
			root.SetArgs(args)
			ctx, cancel := context.WithCancel(s.Context())
			defer cancel()
			err = root.ExecuteContext(ctx)
			return func(*script.State) (string, string, error) {
				if err != nil {
					stderr.WriteString("apiary: " + err.Error() + "\n")
				}
				return stdout.String(), stderr.String(), err
			}, nil
		})
}
