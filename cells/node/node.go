// Package node provides the configuration of the node the agent runs on: its
// name and its state directory.
package node

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
)

// Cell provides the node's own configuration (Config) and checks it
// before anything starts: the state directory must be writable.
var Cell = cell.Module(
	"node",
	"The node the agent runs on",

	cell.Config(defaultFlags()),
	cell.Provide(newConfig),
	// Checked even when no feature uses the state directory yet, so that a
	// bad flag is an error at start rather than at the first checkpoint.
	cell.Invoke(func(Config) {}),
)

// Flags are the node's command-line flags.
type Flags struct {
	// NodeName is the name of this node, as Kubernetes knows it.
	NodeName string
	// StateDir holds what must survive a restart (checkpoints, IPAM records).
	StateDir string
}

// DefaultStateDir is where state lives unless --state-dir says otherwise.
const DefaultStateDir = "/var/run/apiary"

func defaultFlags() Flags {
	name, _ := os.Hostname()
	return Flags{NodeName: name, StateDir: DefaultStateDir}
}

// Flags implements cell.Flagger.
func (def Flags) Flags(fs *pflag.FlagSet) {
	fs.String("node-name", def.NodeName, "Name of this node as Kubernetes knows it (selects the node's pods)")
	fs.String("state-dir", def.StateDir, "Directory for state that survives a restart (identity and DNS checkpoints, IPAM records)")
}

// Config is the validated node configuration.
type Config struct {
	NodeName string
	// StateDir is an absolute path to an existing, writable directory.
	StateDir string
}

func newConfig(f Flags) (Config, error) {
	if f.NodeName == "" {
		return Config{}, errors.New("--node-name is empty and the hostname is unknown: set --node-name")
	}
	dir, err := PrepareStateDir(f.StateDir)
	if err != nil {
		return Config{}, err
	}
	return Config{NodeName: f.NodeName, StateDir: dir}, nil
}

// PrepareStateDir makes dir absolute, creates it and checks that files can be
// written in it.
func PrepareStateDir(dir string) (string, error) {
	if dir == "" {
		return "", errors.New("--state-dir is empty")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", fmt.Errorf("--state-dir %s: %w", dir, err)
	}
	if err := os.MkdirAll(abs, 0o750); err != nil {
		return "", fmt.Errorf("--state-dir %s: %w", abs, err)
	}
	probe, err := os.CreateTemp(abs, ".write-probe-*")
	if err != nil {
		return "", fmt.Errorf("--state-dir %s is not writable: %w", abs, err)
	}
	probe.Close()
	os.Remove(probe.Name())
	return abs, nil
}
