package main

import (
	"github.com/spf13/cobra"

	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/ct"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/reconcilers"
)

// newBPFCmd returns `apiary bpf`, which reads the agent's pinned BPF maps
// directly from bpffs: it works without the agent's API, and even when the
// agent is not running, since the maps outlive it.
func newBPFCmd() *cobra.Command {
	var pinDir string
	cmd := &cobra.Command{
		Use:   "bpf",
		Short: "Read the agent's pinned BPF maps",
		Long: "Read the BPF maps the agent pins under --bpf-pin-dir (or APIARY_BPF_PIN_DIR), read-only.\n" +
			"Needs root. Examples:\n  apiary bpf ct list\n  apiary bpf ct list ct_any4_global",
		PersistentPreRun: func(cmd *cobra.Command, _ []string) {
			applyEnv(cmd.Flags(), "bpf-pin-dir")
		},
	}
	cmd.PersistentFlags().StringVar(&pinDir, "bpf-pin-dir", bpffs.DefaultPinDir,
		"Directory on bpffs where the agent pins its BPF maps (the agent's --bpf-pin-dir)")

	ctCmd := &cobra.Command{
		Use:   "ct",
		Short: "Conntrack maps",
	}
	ctCmd.AddCommand(&cobra.Command{
		Use:   "list [MAP...]",
		Short: "Print the conntrack entries, one per line",
		Long: "Print every entry of the conntrack maps (ct4_global, ct_any4_global and, with IPv6,\n" +
			"ct6_global and ct_any6_global), or of the maps named, sorted, one per line:\n" +
			"protocol, direction, addresses and ports as the key stores them, remaining lifetime,\n" +
			"flags and counters.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return ct.WritePinned(cmd.OutOrStdout(), pinDir, args...)
		},
	})
	cmd.AddCommand(ctCmd)

	lbCmd := &cobra.Command{
		Use:   "lb",
		Short: "Load-balancing maps",
	}
	lbCmd.AddCommand(&cobra.Command{
		Use:   "list",
		Short: "Print the load-balancing entries, one per line",
		Long: "Print every entry of lb4_services (service entries by address, protocol and slot),\n" +
			"lb4_backends and lb4_reverse_nat (by ID), one per line, addresses and protocols in text.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return reconcilers.WritePinnedLB(cmd.OutOrStdout(), pinDir)
		},
	})
	cmd.AddCommand(lbCmd)

	ipcacheCmd := &cobra.Command{
		Use:   "ipcache",
		Short: "The ipcache map (prefix → security identity)",
	}
	ipcacheCmd.AddCommand(&cobra.Command{
		Use:   "list",
		Short: "Print the ipcache entries, one per line",
		Long: "Print every entry of the ipcache LPM trie, sorted by prefix, one per line:\n" +
			"  <prefix> identity=<id>\n" +
			"followed by tunnel=, key= and flags= when set. `apiary db show ipcache` shows the labels.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return ipcache.WritePinned(cmd.OutOrStdout(), pinDir)
		},
	})
	cmd.AddCommand(ipcacheCmd)
	return cmd
}
