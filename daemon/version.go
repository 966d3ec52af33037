package main

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/spf13/cobra"
)

// Set at link time by the Makefile (-ldflags "-X main.version=... -X main.gitCommit=...").
var (
	version   = "dev"
	gitCommit = ""
)

// buildCommit returns the git commit the binary was built from: the linker's
// value, else the one the Go toolchain stamped, else "unknown".
func buildCommit() string {
	if gitCommit != "" {
		return gitCommit
	}
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, s := range info.Settings {
			if s.Key == "vcs.revision" {
				return s.Value
			}
		}
	}
	return "unknown"
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version, git commit and Go version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, err := fmt.Fprintf(cmd.OutOrStdout(), "apiary %s\ngit commit: %s\ngo: %s %s/%s\n",
				version, buildCommit(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
			return err
		},
	}
}
