package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/apiary-net/apiary/bpf/iflink"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/cnichain"
	"github.com/apiary-net/apiary/cells/ipam"
	"github.com/apiary-net/apiary/cells/policy"
	chain "github.com/apiary-net/apiary/internal/cnichain"
)

// newCNICmd is `apiary cni install|uninstall`: what the agent does under
// --cni-chaining-mode=chain|unchain, by hand (before the agent runs, or
// after it is gone).
func newCNICmd() *cobra.Command {
	var confDir, confName, binDir, source, pinDir, attach string
	cmd := &cobra.Command{
		Use:   "cni",
		Short: "Chain apiary-cni into the node's CNI configuration, or take it out",
	}
	flags := func(c *cobra.Command) {
		c.Flags().StringVar(&confDir, cnichain.ConfDirFlag, cnichain.DefaultConfDir, "The container runtime's CNI configuration directory")
		c.Flags().StringVar(&confName, cnichain.ConfNameFlag, "", "The configuration file; empty: the primary one (the lowest name, the one the runtime uses)")
	}
	envs := []string{cnichain.ConfDirFlag, cnichain.ConfNameFlag, ipam.CNIBinDirFlag, cnichain.PluginFlag, "bpf-pin-dir", policy.InterfaceAttachFlag}
	install := &cobra.Command{
		Use:   "install",
		Short: "Copy apiary-cni into --cni-bin-dir and chain it at the end of the primary CNI configuration",
		Long: "Copy the apiary-cni binary into --cni-bin-dir and add apiary-cni, on --bpf-pin-dir, at the end of\n" +
			"the plugin chain of the node's primary CNI configuration in --cni-conf-dir (the lowest name among\n" +
			"*.conf, *.conflist and *.json, the one the runtime uses; --cni-conf-name for another). Writes are\n" +
			"atomic; the original is kept as <file>.apiary-orig for `apiary cni uninstall`; a single .conf\n" +
			"becomes a .conflist of its name. Running it again changes nothing. Until the agent has pinned its\n" +
			"interface programs, apiary-cni fails new pods' ADD (fail closed): the agent's\n" +
			"--cni-chaining-mode=chain waits for them. Every flag is also read from APIARY_<FLAG>.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			applyEnv(cmd.Flags(), envs...)
			if _, err := iflink.ParseMode(attach); err != nil {
				return fmt.Errorf("--%s: %w", policy.InterfaceAttachFlag, err)
			}
			src, err := cnichain.PluginSource(source)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if err := cnichain.Pinned(pinDir); err != nil {
				fmt.Fprintf(out, "Warning: new pods fail to start until the agent runs: %v\n", err)
			}
			wrote, err := chain.InstallBinary(src, binDir)
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "%s/%s: %s\n", binDir, chain.PluginType, map[bool]string{true: "installed", false: "up to date"}[wrote])
			res, err := chain.Install(confDir, confName, chain.Entry(pinDir, attach))
			if err != nil {
				return err
			}
			if res.State == chain.NoConfig {
				return fmt.Errorf("no CNI configuration in %s to chain into", confDir)
			}
			fmt.Fprintf(out, "%s: %s\n", res.File, res.State)
			return nil
		},
	}
	flags(install)
	install.Flags().StringVar(&binDir, ipam.CNIBinDirFlag, ipam.DefaultCNIBinDir, "The container runtime's CNI plugin directory")
	install.Flags().StringVar(&source, cnichain.PluginFlag, "", "The apiary-cni binary to copy; empty: apiary-cni beside this executable")
	install.Flags().StringVar(&pinDir, "bpf-pin-dir", bpffs.DefaultPinDir, "The agent's --bpf-pin-dir, where apiary-cni finds its programs")
	install.Flags().StringVar(&attach, policy.InterfaceAttachFlag, string(iflink.ModeAuto), "The agent's --"+policy.InterfaceAttachFlag+": auto, tcx or tc")

	uninstall := &cobra.Command{
		Use:   "uninstall",
		Short: "Take apiary-cni out of the CNI configuration, putting the original back",
		Long: "Take apiary-cni out of the chain of the primary CNI configuration in --cni-conf-dir (or\n" +
			"--cni-conf-name): the original as `install` found it is put back when nothing else changed\n" +
			"since, and otherwise apiary-cni's entry alone is removed. The binary in the CNI plugin\n" +
			"directory is left, since pods made through it are deleted through it.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			applyEnv(cmd.Flags(), envs...)
			res, err := chain.Uninstall(confDir, confName)
			if err != nil {
				return err
			}
			if res.State == chain.NoConfig {
				fmt.Fprintf(cmd.OutOrStdout(), "%s: no CNI configuration\n", confDir)
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: %s\n", res.File, res.State)
			return nil
		},
	}
	flags(uninstall)
	cmd.AddCommand(install, uninstall)
	return cmd
}
