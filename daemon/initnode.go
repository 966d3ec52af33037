package main

import (
	"fmt"
	"io"
	"path/filepath"
	"runtime"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
)

func newInitNodeCmd() *cobra.Command {
	hostProc := ""
	bpffsDir := bpf.DefaultFSRoot
	cmd := &cobra.Command{
		Use:   "init-node",
		Short: "Mount bpffs on the node when it is missing (a DaemonSet's init step)",
		Long: "Make sure the node has bpffs at --bpffs (default /sys/fs/bpf), mounting it when missing.\n" +
			"With --host-proc (the host's /proc mounted in the pod) the check and the mount happen in\n" +
			"the mount namespace of the host's PID 1, so that the agent's pins live on the host and\n" +
			"outlive the agent's pod, whether or not the host's mounts propagate into pods.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return initNode(cmd.OutOrStdout(), hostProc, bpffsDir)
		},
	}
	cmd.Flags().StringVar(&hostProc, "host-proc", hostProc, "The host's /proc as mounted in this container; empty: work in this process's mount namespace")
	cmd.Flags().StringVar(&bpffsDir, "bpffs", bpffsDir, "Where bpffs must be mounted")
	return cmd
}

// initNode mounts bpffs at dir unless it is there, in the mount namespace
// of PID 1 under hostProc (or in its own, when hostProc is empty). EnsureFS
// checks again there: the host may have it where this process does not.
func initNode(out io.Writer, hostProc, dir string) error {
	// The pod sees the host's directory (a hostPath volume): when it is on
	// bpffs, so is the host's, and there is nothing to do.
	if ok, err := bpf.IsBPFFS(dir); err == nil && ok {
		fmt.Fprintf(out, "bpffs is mounted at %s\n", dir)
		return nil
	}
	if hostProc != "" {
		// Only this thread enters the host's mount namespace: setns(2)
		// refuses a thread that shares its file system attributes, as Go's
		// threads do, so it first gets its own. Locked and never unlocked,
		// the thread ends with the process.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			return fmt.Errorf("unshare file system attributes: %w", err)
		}
		ns := filepath.Join(hostProc, "1/ns/mnt")
		fd, err := unix.Open(ns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open the host's mount namespace %s: %w", ns, err)
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("enter the host's mount namespace %s: %w", ns, err)
		}
	}
	if err := bpf.EnsureFS(dir); err != nil {
		return err
	}
	fmt.Fprintf(out, "Mounted bpffs at %s\n", dir)
	return nil
}
