package policy

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"

	"github.com/apiary-net/apiary/bpf/podiface"
)

// publish pins the interface programs under podiface.ProgramsDir, once
// the socket-level programs (whose maps they share) are attached, so that
// apiary-cni can attach them to a pod's interface the moment it is made,
// while this agent is away or before it has found the pod. Each run of the
// agent pins its own programs over the last run's.
func (o *ifaceOps) publish(ctx context.Context, health cell.Health) error {
	select {
	case <-o.a.attached:
	case <-ctx.Done():
		return nil
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	err := o.load()
	if err == nil {
		err = pinPrograms(o.pinDir, o.progs)
	}
	if err != nil {
		health.Degraded("Pinning the interface programs for apiary-cni failed; retrying", err)
		return fmt.Errorf("pin the interface programs: %w", err)
	}
	dir := filepath.Join(o.pinDir, podiface.ProgramsDir)
	health.OK("Interface programs pinned in " + dir + " for apiary-cni")
	o.log.Info("Pinned the interface programs for apiary-cni", "dir", dir)
	return nil
}

// pinPrograms pins each interface program as NAME_new and renames it over
// NAME, so that the plugin always finds a whole program at NAME.
func pinPrograms(pinDir string, progs map[string]*ebpf.Program) error {
	if err := os.MkdirAll(filepath.Join(pinDir, podiface.ProgramsDir), 0o750); err != nil {
		return fmt.Errorf("programs directory: %w", err)
	}
	for _, name := range podiface.Programs {
		prog, ok := progs[name]
		if !ok {
			return fmt.Errorf("no program %s", name)
		}
		// A clone, whose pin path the rename makes stale, not the
		// program the links get.
		clone, err := prog.Clone()
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		pin := podiface.ProgramPin(pinDir, name)
		tmp := pin + "_new"
		_ = os.Remove(tmp)
		err = clone.Pin(tmp)
		clone.Close()
		if err != nil {
			return fmt.Errorf("pin %s: %w", tmp, err)
		}
		if err := os.Rename(tmp, pin); err != nil {
			os.Remove(tmp)
			return fmt.Errorf("rename %s to %s: %w", tmp, pin, err)
		}
	}
	return nil
}

// unpinPrograms removes the pins of the interface programs: without them
// apiary-cni refuses new pods (unless its netconf says failOpen).
func unpinPrograms(pinDir string) error {
	var errs []error
	for _, name := range podiface.Programs {
		pin := podiface.ProgramPin(pinDir, name)
		for _, p := range []string{pin, pin + "_new"} {
			if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	if err := os.Remove(filepath.Join(pinDir, podiface.ProgramsDir)); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
