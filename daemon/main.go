// Command apiary is the node agent for eBPF networking and its command-line
// client: `apiary agent` runs the daemon, `apiary db` reads its tables over
// the HTTP API, `apiary version` says what was built.
package main

import (
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"
)

func main() {
	if err := newRootCmd(os.Stdout, os.Stderr).Execute(); err != nil {
		fmt.Fprintf(os.Stderr, "apiary: %s\n", err)
		os.Exit(1)
	}
}

// newRootCmd builds the whole command tree; tests run it in-process.
func newRootCmd(stdout, stderr io.Writer) *cobra.Command {
	root := &cobra.Command{
		Use:           "apiary",
		Short:         "apiary: a node agent for eBPF networking",
		Long:          "apiary converges load balancing, identities and policy state into pinned eBPF maps.\nRun `apiary agent` on each node; inspect it with `apiary db`, its maps with `apiary bpf`,\nand the policy verdicts it makes, live, with `apiary monitor`.",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.AddCommand(
		newAgentCmd(),
		newOperatorCmd(),
		newDBCmd(),
		newMonitorCmd(),
		newBPFCmd(),
		newCleanupCmd(),
		newCNICmd(),
		newInitNodeCmd(),
		newVersionCmd(),
	)
	return root
}
