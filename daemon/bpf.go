package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/ct"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/policy"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
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
		Long: "Print every entry of lb4_services and lb6_services (service entries by address,\n" +
			"protocol and slot), lb4_backends, lb6_backends, lb4_reverse_nat and lb6_reverse_nat\n" +
			"(by ID) and lb_affinity_match (by service and backend ID), one per line, addresses\n" +
			"and protocols in text.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return reconcilers.WritePinnedLB(cmd.OutOrStdout(), pinDir)
		},
	})
	cmd.AddCommand(lbCmd)
	cmd.AddCommand(newNodePortCmd(&pinDir))

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
	prefixesCmd := &cobra.Command{
		Use:   "policy-prefixes",
		Short: "The policy prefixes map (policy prefix → CIDR identity)",
	}
	prefixesCmd.AddCommand(&cobra.Command{
		Use:   "list",
		Short: "Print the policy prefixes entries, one per line",
		Long: "Print every entry of the policy prefixes LPM trie, sorted by prefix, one per line:\n" +
			"  <prefix> identity=<id>\n" +
			"It holds the prefixes policies name, each with the identity an address outside the\n" +
			"cluster inside it has; the datapath looks a pod's address up in it for the entries\n" +
			"of NetworkPolicy ipBlocks. `apiary db show policy-prefixes` shows the labels.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return ipcache.WritePinnedMap(cmd.OutOrStdout(), pinDir, bpf.PolicyPrefixesMap)
		},
	})
	cmd.AddCommand(prefixesCmd)
	cmd.AddCommand(newBPFPolicyCmd(&pinDir))
	return cmd
}

// newBPFPolicyCmd returns `apiary bpf policy`.
func newBPFPolicyCmd(pinDir *string) *cobra.Command {
	policyCmd := &cobra.Command{
		Use:   "policy",
		Short: "The policy maps (per-endpoint policy entries, endpoints by cgroup)",
	}
	var endpoint string
	db := &dbClient{http: &http.Client{}}
	list := &cobra.Command{
		Use:   "list",
		Short: "Print the policy entries of every endpoint, or of one",
		Long: "Print policy_endpoints and the policy LPM trie, grouped by endpoint: a line per endpoint\n" +
			"(ID, cgroup ID, enforced directions), then its entries, one per line:\n" +
			"  <direction> identity=<id|any> <protocol/port or range|ANY> <allow|deny>\n" +
			"(\"allow pod-addrs\": a NetworkPolicy ipBlock's allow, which matches pods' addresses too).\n" +
			"--endpoint takes an endpoint ID, or a name (namespace/pod) that the running agent\n" +
			"translates (found like `apiary db`: --server, APIARY_SERVER, APIARY_API_ADDR).\n" +
			"`apiary db show policy-entries` shows the policies behind each entry.",
		Args: cobra.NoArgs,
		PreRun: func(cmd *cobra.Command, _ []string) {
			applyEnv(cmd.Flags(), "server")
			db.server = serverFromEnv(cmd.Flags().Lookup("server"), db.server)
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			id, err := db.endpointID(cmd.Context(), endpoint)
			if err != nil {
				return err
			}
			eps, entries, err := policy.ReadPinned(*pinDir)
			if err != nil {
				return err
			}
			return policy.WriteEntries(cmd.OutOrStdout(), eps, entries, id)
		},
	}
	list.Flags().StringVar(&endpoint, "endpoint", "", "Only this endpoint: its ID, or its name (namespace/pod)")
	list.Flags().StringVar(&db.server, "server", defaultServer, "URL of the agent's HTTP API, to translate an endpoint name")
	policyCmd.AddCommand(list)
	return policyCmd
}

// endpointID returns the ID of an endpoint given by ID or by name (asked
// of the agent); 0 for "".
func (c *dbClient) endpointID(ctx context.Context, endpoint string) (uint32, error) {
	if endpoint == "" {
		return 0, nil
	}
	if id, err := strconv.ParseUint(endpoint, 10, 32); err == nil && id > 0 {
		return uint32(id), nil
	}
	resp, err := c.get(ctx, "/statedb/dump/"+tables.EndpointPolicyTableName)
	if err != nil {
		return 0, fmt.Errorf("--endpoint %s: %w", endpoint, err)
	}
	defer resp.Body.Close()
	var dump map[string][]tables.EndpointPolicy
	if err := json.NewDecoder(resp.Body).Decode(&dump); err != nil {
		return 0, fmt.Errorf("--endpoint %s: decode %s: %w", endpoint, tables.EndpointPolicyTableName, err)
	}
	for _, ep := range dump[tables.EndpointPolicyTableName] {
		if ep.Name == endpoint {
			if ep.ID == 0 {
				return 0, fmt.Errorf("--endpoint %s: the endpoint has no ID yet (its cgroup has not been found)", endpoint)
			}
			return ep.ID, nil
		}
	}
	return 0, fmt.Errorf("--endpoint %s: no such endpoint on this node (see apiary db show %s)", endpoint, tables.EndpointPolicyTableName)
}
