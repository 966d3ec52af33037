package main

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/spf13/cobra"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/iflink"
	"github.com/apiary-net/apiary/cells/bpffs"
)

func newCleanupCmd() *cobra.Command {
	pinDir := bpffs.DefaultPinDir
	cmd := &cobra.Command{
		Use:   "cleanup",
		Short: "Detach every program the agent attached and remove its pins (uninstall)",
		Long: "Remove everything the agent pinned under --bpf-pin-dir: its links, which detaches their\n" +
			"programs (socket LB, policy) from the cgroups and interfaces they were attached to, and its\n" +
			"maps; and the tc filters of its interface programs in tc mode, which no pin holds. Run it on a node once the agent is stopped (deleting the agent's DaemonSet does not\n" +
			"detach anything, by design: enforcement holds while the agent restarts); it refuses while\n" +
			"an agent runs on the directory. --state-dir (identity checkpoint, IPAM records) is left.\n" +
			"--bpf-pin-dir is also read from APIARY_BPF_PIN_DIR.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			applyEnv(cmd.Flags(), "bpf-pin-dir")
			maps, err := cleanup(cmd.OutOrStdout(), pinDir)
			if err != nil {
				return err
			}
			if err := detachTC(cmd.OutOrStdout(), maps); err != nil {
				return err
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&pinDir, "bpf-pin-dir", pinDir, "The agent's pin directory, removed with everything in it")
	return cmd
}

// cleanup removes the pin directory dir and every pin in it, detaching
// the programs of the links among them, and says what it removed. A
// missing directory is already clean. It returns the IDs of the maps that
// were pinned there, by which the agent's unpinned attachments (tc
// filters) are known.
func cleanup(out io.Writer, dir string) (map[ebpf.MapID]bool, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("--bpf-pin-dir %s: %w", dir, err)
	}
	if _, err := os.Stat(abs); errors.Is(err, fs.ErrNotExist) {
		fmt.Fprintf(out, "Nothing to clean up: %s does not exist\n", abs)
		return nil, nil
	}
	if ok, err := bpf.IsBPFFS(abs); err != nil || !ok {
		return nil, fmt.Errorf("--bpf-pin-dir %s is not on bpffs (%v): refusing to remove it", abs, err)
	}
	// A running agent holds the lock and its links: removing its pins
	// under it would detach nothing until it exits, and it would pin
	// them again.
	lock, err := bpffs.Lock(abs)
	if err != nil {
		return nil, err
	}
	defer lock.Release()

	var links, maps []string
	mapIDs := map[ebpf.MapID]bool{}
	var errs []error
	err = filepath.WalkDir(abs, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			errs = append(errs, err)
			return nil
		}
		if d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(abs, path)
		// Unpinned and closed, a link has no reference left (unless
		// another process holds it) and the kernel detaches it.
		if l, err := link.LoadPinnedLink(path, nil); err == nil {
			if err := errors.Join(l.Unpin(), l.Close()); err != nil {
				errs = append(errs, fmt.Errorf("remove link %s: %w", path, err))
				return nil
			}
			links = append(links, rel)
			return nil
		}
		if m, err := ebpf.LoadPinnedMap(path, nil); err == nil {
			if info, err := m.Info(); err == nil {
				if id, ok := info.ID(); ok {
					mapIDs[id] = true
				}
			}
			m.Close()
		}
		if err := os.Remove(path); err != nil {
			errs = append(errs, err)
			return nil
		}
		maps = append(maps, rel)
		return nil
	})
	if err != nil {
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		if err := os.RemoveAll(abs); err != nil {
			errs = append(errs, err)
		}
	}
	slices.Sort(links)
	slices.Sort(maps)
	for _, l := range links {
		fmt.Fprintf(out, "detached %s\n", l)
	}
	fmt.Fprintf(out, "Removed %d links and %d other pins from %s\n", len(links), len(maps), abs)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("clean up %s: %w", abs, err)
	}
	return mapIDs, nil
}

// detachTC removes the tc filters the agent put on interfaces in tc mode
// (--policy-interface-attach=tc, or auto without tcx): no pin holds them;
// theirs are the programs that use the maps that were pinned (maps).
func detachTC(out io.Writer, maps map[ebpf.MapID]bool) error {
	if len(maps) == 0 {
		return nil
	}
	hooks, err := iflink.DetachAllTC(func(p *ebpf.Program) bool {
		info, err := p.Info()
		if err != nil {
			return false
		}
		ids, _ := info.MapIDs()
		return slices.ContainsFunc(ids, func(id ebpf.MapID) bool { return maps[id] })
	})
	for _, h := range hooks {
		dir := "ingress"
		if h.Egress {
			dir = "egress"
		}
		fmt.Fprintf(out, "detached the tc filter of interface %d (%s)\n", h.Ifindex, dir)
	}
	if err != nil {
		return fmt.Errorf("remove tc filters: %w", err)
	}
	return nil
}
