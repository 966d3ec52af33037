package ipam

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"
)

// CNI arguments that are the same for every call. IPAM plugins key their
// leases on the container ID and the interface name; they do not enter the
// network namespace, but CNI requires one for ADD and CHECK. The plugin's own
// namespace is a harmless one to name.
const (
	cniIfName = "eth0"
	cniNetNS  = "/proc/self/ns/net"
)

// pluginTimeout bounds one plugin call. It is not cut short when the agent
// stops: a plugin killed in the middle of an ADD could leave a lease that no
// record and no container ID accounts for.
const pluginTimeout = 30 * time.Second

// plugins calls the IPAM plugins of one bin dir through the CNI library.
type plugins struct {
	log    *slog.Logger
	binDir string
	exec   *lockedExec
}

// call runs one CNI command for containerID against the plugin of d. For
// ADD it returns the plugin's result.
func (p *plugins) call(ctx context.Context, command, containerID string, d *delegate, prevResult json.RawMessage) (types.Result, error) {
	path, err := p.exec.FindInPath(d.Plugin, []string{p.binDir})
	if err != nil {
		return nil, fmt.Errorf("IPAM plugin %q not found in --%s %s", d.Plugin, CNIBinDirFlag, p.binDir)
	}
	stdin, err := d.stdin(prevResult)
	if err != nil {
		return nil, err
	}
	args := &invoke.Args{
		Command:     command,
		ContainerID: containerID,
		NetNS:       cniNetNS,
		IfName:      cniIfName,
		Path:        p.binDir,
	}
	if command == "DEL" {
		args.NetNS = "" // optional for DEL, and the namespace is long gone for a runtime
	}
	// Finish the call even if the agent is stopping (see pluginTimeout).
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pluginTimeout)
	defer cancel()
	start := time.Now()
	var res types.Result
	if command == "ADD" {
		res, err = invoke.ExecPluginWithResult(ctx, path, stdin, args, p.exec)
	} else {
		err = invoke.ExecPluginWithoutResult(ctx, path, stdin, args, p.exec)
	}
	p.log.Debug("IPAM plugin called", "command", command, "containerID", containerID,
		"plugin", path, "network", d.Network, "duration", time.Since(start), "error", err)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", d.Plugin, command, err)
	}
	return res, nil
}

// lockedExec is an invoke.Exec that hands every plugin the agent's IPAM lock
// (an flock'ed file) as an inherited file descriptor. The lock thus stays held
// until the last plugin the agent started has exited: if the agent is killed
// in the middle of an ADD, the next agent waits for that ADD to finish before
// it releases the container ID's leases, and cannot race with it.
type lockedExec struct {
	version.PluginDecoder
	lock *os.File
}

var _ invoke.Exec = (*lockedExec)(nil)

// ExecPlugin implements invoke.Exec.
func (e *lockedExec) ExecPlugin(ctx context.Context, pluginPath string, stdin []byte, environ []string) ([]byte, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, pluginPath)
	cmd.Env = environ
	cmd.Stdin = bytes.NewReader(stdin)
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if e.lock != nil {
		cmd.ExtraFiles = []*os.File{e.lock}
	}
	if err := cmd.Run(); err != nil {
		return nil, pluginError(err, stdout.Bytes(), stderr.Bytes())
	}
	return stdout.Bytes(), nil
}

// FindInPath implements invoke.Exec.
func (e *lockedExec) FindInPath(plugin string, paths []string) (string, error) {
	return invoke.FindInPath(plugin, paths)
}

// pluginError turns a failed plugin run into the CNI error it printed, or
// into one that says what the plugin wrote on stderr.
func pluginError(runErr error, stdout, stderr []byte) error {
	var cniErr types.Error
	if len(bytes.TrimSpace(stdout)) > 0 && json.Unmarshal(stdout, &cniErr) == nil && (cniErr.Msg != "" || cniErr.Code != 0) {
		return &cniErr
	}
	msg := strings.TrimSpace(string(stderr))
	if msg == "" {
		msg = strings.TrimSpace(string(stdout))
	}
	var exitErr *exec.ExitError
	if errors.As(runErr, &exitErr) && msg != "" {
		return fmt.Errorf("%s: %s", runErr, truncate(msg, 512))
	}
	return runErr
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
