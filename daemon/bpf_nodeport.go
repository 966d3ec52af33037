package main

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/spf13/cobra"

	"github.com/apiary-net/apiary/bpf/nodeport"
)

// newNodePortCmd returns `apiary bpf nodeport`: the north-south NAT map
// and counters.
func newNodePortCmd(pinDir *string) *cobra.Command {
	cmd := &cobra.Command{Use: "nodeport", Short: "North-south load balancing (--enable-nodeport)"}
	open := func(name string) (*ebpf.Map, error) {
		m, err := ebpf.LoadPinnedMap(filepath.Join(*pinDir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return nil, fmt.Errorf("open %s (is --enable-nodeport on?): %w", name, err)
		}
		return m, nil
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "list",
		Short: "Print the translated flows, one per line",
		Long: "Print each flow of nodeport_nat4 and nodeport_nat6: protocol, client, frontend, backend and, for a\n" +
			"remote backend, the address and port it sees (\"via\").",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			m, err := open(nodeport.NAT4Map)
			if err != nil {
				return err
			}
			defer m.Close()
			flows, err := nodeport.Flows(m)
			if err != nil {
				return err
			}
			m6, err := open(nodeport.NAT6Map)
			if err != nil {
				return err
			}
			defer m6.Close()
			flows6, err := nodeport.Flows6(m6)
			if err != nil {
				return err
			}
			flows = append(flows, flows6...)
			lines := make([]string, 0, len(flows))
			for _, f := range flows {
				proto := map[uint8]string{6: "TCP", 17: "UDP"}[f.Proto]
				line := fmt.Sprintf("%s %s -> %s => %s", proto, f.Client, f.Frontend, f.Backend)
				if f.NAT.IsValid() {
					line += " via " + f.NAT.String()
				}
				lines = append(lines, line)
			}
			slices.Sort(lines)
			_, err = fmt.Fprint(cmd.OutOrStdout(), strings.Join(lines, "\n")+"\n")
			return err
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:   "stats",
		Short: "Print the programs' counters",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			m, err := open(nodeport.StatsMap)
			if err != nil {
				return err
			}
			defer m.Close()
			st, err := nodeport.Stats(m)
			if err != nil {
				return err
			}
			for _, name := range nodeport.StatNames {
				fmt.Fprintf(cmd.OutOrStdout(), "%s %d\n", name, st[name])
			}
			return nil
		},
	})
	return cmd
}
