package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/cilium/statedb"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/tables"
)

// defaultServer is where `apiary db` finds the agent: its default --api-addr.
const defaultServer = "http://127.0.0.1:9234"

// rowDecoders maps the agent's tables to their Go types, so the CLI prints
// each object's own TableHeader/TableRow. Tables not listed (say, from a
// newer agent) are printed with their JSON fields as columns.
func rowDecoders() map[string]func([]byte) (statedb.TableWritable, error) {
	return map[string]func([]byte) (statedb.TableWritable, error){
		tables.HealthTableName:         decodeRow[tables.HealthStatus],
		tables.CTMapsTableName:         decodeRow[tables.CTMap],
		tables.AgentIPsTableName:       decodeRow[tables.AgentIP],
		tables.ServicesTableName:       decodeRow[tables.Service],
		tables.FrontendsTableName:      decodeRow[tables.Frontend],
		tables.BackendsTableName:       decodeRow[tables.Backend],
		tables.IdentitiesTableName:     decodeRow[tables.Identity],
		tables.PrefixesTableName:       decodeRow[tables.PrefixLabels],
		tables.IPCacheTableName:        decodeRow[tables.IPCacheEntry],
		tables.PolicyPrefixesTableName: decodeRow[tables.IPCacheEntry],
		tables.PoliciesTableName:       decodeRow[tables.Policy],
		tables.SelectorsTableName:      decodeRow[tables.Selector],
		tables.EndpointsTableName:      decodeRow[tables.Endpoint],
		tables.FQDNNamesTableName:      decodeRow[tables.FQDNName],
		tables.PolicyEntriesTableName:  decodeRow[tables.PolicyEntry],
		tables.EndpointPolicyTableName: decodeRow[tables.EndpointPolicy],
		tables.PodInterfacesTableName:  decodeRow[tables.PodInterface],
	}
}

func decodeRow[T any, PT interface {
	*T
	statedb.TableWritable
}](data []byte) (statedb.TableWritable, error) {
	obj := PT(new(T))
	if err := json.Unmarshal(data, obj); err != nil {
		return nil, err
	}
	return obj, nil
}

// serverFromEnv returns the agent's URL from APIARY_API_ADDR when the
// --server flag was neither given nor set by APIARY_SERVER, so that the CLI
// finds an agent started with APIARY_API_ADDR without being told twice.
func serverFromEnv(flag *pflag.Flag, server string) string {
	if _, set := os.LookupEnv(core.EnvPrefix + "SERVER"); flag.Changed || set {
		return server
	}
	addr, ok := os.LookupEnv(core.EnvPrefix + "API_ADDR")
	if !ok || addr == "" {
		return server
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "http://" + addr // get reports it as a bad URL, naming it
	}
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1" // the agent listens on every address, loopback among them
	}
	return "http://" + net.JoinHostPort(host, port)
}

type dbClient struct {
	server string
	http   *http.Client
}

func newDBCmd() *cobra.Command {
	c := &dbClient{http: &http.Client{}}
	cmd := &cobra.Command{
		Use:   "db",
		Short: "Read the agent's tables over its HTTP API",
		Long: "Read the agent's statedb tables over its HTTP API: --server, else APIARY_SERVER, else\n" +
			"http://$APIARY_API_ADDR (the agent's own variable), else " + defaultServer + ".\n" +
			"Examples:\n  apiary db tables\n  apiary db show health\n  apiary db show frontends -o yaml\n  apiary db watch backends",
	}
	cmd.PersistentFlags().StringVar(&c.server, "server", defaultServer, "URL of the agent's HTTP API (its --api-addr)")
	cmd.PersistentPreRun = func(cmd *cobra.Command, _ []string) {
		applyEnv(cmd.Flags(), "server")
		c.server = serverFromEnv(cmd.Flags().Lookup("server"), c.server)
	}

	var output string
	show := &cobra.Command{
		Use:   "show TABLE",
		Short: "Print every object of a table",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.show(cmd.Context(), cmd.OutOrStdout(), args[0], output)
		},
	}
	show.Flags().StringVarP(&output, "output", "o", "table", "Output format: table, json or yaml")

	cmd.AddCommand(
		&cobra.Command{
			Use:   "tables",
			Short: "List the tables with their object counts",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				return c.tables(cmd.Context(), cmd.OutOrStdout())
			},
		},
		show,
		&cobra.Command{
			Use:   "watch TABLE",
			Short: "Print a table's objects, then every change until interrupted",
			Args:  cobra.ExactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
				defer stop()
				return c.watch(ctx, cmd.OutOrStdout(), args[0])
			},
		},
	)
	return cmd
}

// get fetches path from the agent. Any failure, including a non-200 answer
// carrying the API's JSON error, comes back as one readable error.
func (c *dbClient) get(ctx context.Context, path string) (*http.Response, error) {
	return c.request(ctx, path, nil)
}

// apiError is a non-200 answer of the agent: its status and the API's
// JSON error, when it sent one.
type apiError struct {
	status int
	msg    string // the API's {"error": ...}; empty when there was none
	what   string // "GET /path: 404 Not Found", for an answer without one
}

func (e *apiError) Error() string {
	if e.msg != "" {
		return e.msg
	}
	return e.what
}

// request GETs path with the query q from the agent. A non-200 answer is
// an *apiError; any other failure a readable error naming the server.
func (c *dbClient) request(ctx context.Context, path string, q url.Values) (*http.Response, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	base, err := url.Parse(c.server)
	if err != nil || base.Scheme == "" || base.Host == "" {
		return nil, fmt.Errorf("--server %q: want a URL such as %s", c.server, defaultServer)
	}
	u := base.JoinPath(path)
	u.RawQuery = q.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err
		}
		return nil, fmt.Errorf("cannot reach the agent at %s: %w (is `apiary agent` running? see --server)", c.server, err)
	}
	if resp.StatusCode != http.StatusOK {
		defer resp.Body.Close()
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		var apiErr struct {
			Error string `json:"error"`
		}
		e := &apiError{status: resp.StatusCode, what: fmt.Sprintf("%s %s: %s", req.Method, req.URL.Path, resp.Status)}
		if json.Unmarshal(body, &apiErr) == nil {
			e.msg = apiErr.Error
		}
		return nil, e
	}
	return resp, nil
}

// tableInfo is one entry of GET /statedb/tables.
type tableInfo struct {
	Name        string   `json:"name"`
	Objects     int      `json:"objects"`
	Revision    uint64   `json:"revision"`
	Indexes     []string `json:"indexes"`
	Initialized bool     `json:"initialized"`
}

func (c *dbClient) tables(ctx context.Context, w io.Writer) error {
	resp, err := c.get(ctx, "/statedb/tables")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var infos []tableInfo
	if err := json.NewDecoder(resp.Body).Decode(&infos); err != nil {
		return fmt.Errorf("decode table list: %w", err)
	}
	tw := tabwriter.NewWriter(w, 5, 0, 3, ' ', 0)
	fmt.Fprintln(tw, "Name\tObjects\tRevision\tInitialized\tIndexes")
	for _, t := range infos {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%t\t%s\n", t.Name, t.Objects, t.Revision, t.Initialized, strings.Join(t.Indexes, ", "))
	}
	return tw.Flush()
}

func (c *dbClient) show(ctx context.Context, w io.Writer, table, output string) error {
	if !slices.Contains([]string{"table", "json", "yaml"}, output) {
		return fmt.Errorf("-o %q: want table, json or yaml", output)
	}
	resp, err := c.get(ctx, "/statedb/dump/"+url.PathEscape(table))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var dump map[string][]json.RawMessage
	if err := json.NewDecoder(resp.Body).Decode(&dump); err != nil {
		return fmt.Errorf("decode table %s: %w", table, err)
	}
	objs, ok := dump[table]
	if !ok {
		return fmt.Errorf("table %q not found", table)
	}
	switch output {
	case "json":
		out, err := json.MarshalIndent(objs, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", out)
		return err
	case "yaml":
		js, err := json.Marshal(objs)
		if err != nil {
			return err
		}
		out, err := yaml.JSONToYAML(js)
		if err != nil {
			return err
		}
		_, err = w.Write(out)
		return err
	}
	rows, err := newRowPrinter(table, objs)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(w, 5, 0, 3, ' ', 0)
	fmt.Fprintln(tw, strings.Join(rows.header, "\t"))
	for _, obj := range objs {
		row, err := rows.row(obj)
		if err != nil {
			return fmt.Errorf("decode object of table %s: %w", table, err)
		}
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	return tw.Flush()
}

// watch prints the table's rows, then each change, from /statedb/changes.
func (c *dbClient) watch(ctx context.Context, w io.Writer, table string) error {
	resp, err := c.get(ctx, "/statedb/changes/"+url.PathEscape(table))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var rows *rowPrinter
	scanner := bufio.NewScanner(resp.Body)
	scanner.Buffer(make([]byte, 64<<10), 16<<20)
	for scanner.Scan() {
		var change struct {
			Object  json.RawMessage `json:"obj"`
			Rev     uint64          `json:"rev"`
			Deleted bool            `json:"deleted"`
		}
		if err := json.Unmarshal(scanner.Bytes(), &change); err != nil {
			return fmt.Errorf("broken change stream from %s: %w", c.server, err)
		}
		if len(change.Object) == 0 || string(change.Object) == "null" {
			continue // keep-alive
		}
		if rows == nil {
			if rows, err = newRowPrinter(table, []json.RawMessage{change.Object}); err != nil {
				return err
			}
			fmt.Fprintf(w, "%-8s %-8s %s\n", "Rev", "Change", strings.Join(rows.header, "   "))
		}
		row, err := rows.row(change.Object)
		if err != nil {
			return fmt.Errorf("decode object of table %s: %w", table, err)
		}
		kind := "upsert"
		if change.Deleted {
			kind = "delete"
		}
		fmt.Fprintf(w, "%-8d %-8s %s\n", change.Rev, kind, strings.Join(row, "   "))
	}
	if ctx.Err() != nil {
		return nil // interrupted by the user
	}
	if err := scanner.Err(); err != nil {
		return fmt.Errorf("change stream from %s broke: %w", c.server, err)
	}
	return fmt.Errorf("change stream from %s ended (agent stopped?)", c.server)
}

// rowPrinter turns a table's JSON objects into table rows.
type rowPrinter struct {
	header []string
	row    func(json.RawMessage) ([]string, error)
}

func newRowPrinter(table string, sample []json.RawMessage) (*rowPrinter, error) {
	if decode, ok := rowDecoders()[table]; ok {
		var zero statedb.TableWritable
		if len(sample) > 0 {
			obj, err := decode(sample[0])
			if err != nil {
				return nil, fmt.Errorf("decode object of table %s: %w", table, err)
			}
			zero = obj
		} else if obj, err := decode([]byte("{}")); err == nil {
			zero = obj
		}
		if zero != nil {
			return &rowPrinter{
				header: zero.TableHeader(),
				row: func(data json.RawMessage) ([]string, error) {
					obj, err := decode(data)
					if err != nil {
						return nil, err
					}
					return obj.TableRow(), nil
				},
			}, nil
		}
	}
	return genericRowPrinter(sample)
}

// genericRowPrinter prints the top-level JSON fields of the first object as
// columns, for tables the CLI has no type for.
func genericRowPrinter(sample []json.RawMessage) (*rowPrinter, error) {
	var header []string
	if len(sample) > 0 {
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(sample[0], &fields); err == nil {
			for k := range fields {
				header = append(header, k)
			}
			slices.Sort(header)
		}
	}
	if header == nil {
		header = []string{"Object"}
	}
	return &rowPrinter{
		header: header,
		row: func(data json.RawMessage) ([]string, error) {
			var fields map[string]json.RawMessage
			if err := json.Unmarshal(data, &fields); err != nil {
				return []string{string(data)}, nil
			}
			row := make([]string, len(header))
			for i, k := range header {
				v := fields[k]
				var s string
				if json.Unmarshal(v, &s) == nil {
					row[i] = s
				} else {
					row[i] = string(v)
				}
			}
			return row, nil
		},
	}, nil
}
