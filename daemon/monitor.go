package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/apiary-net/apiary/cells/policy"
)

// monitorClient is `apiary monitor`: it reads the agent's verdict stream
// and prints it.
type monitorClient struct {
	server   string
	http     *http.Client
	output   string
	verdicts []string
	endpoint string
	policy   string
	typ      string
}

func newMonitorCmd() *cobra.Command {
	c := &monitorClient{http: &http.Client{}}
	cmd := &cobra.Command{
		Use:   "monitor",
		Short: "Print the policy and DNS verdicts of the agent's endpoints as they happen",
		Long: "Print a line for each connection or flow the policy programs decide, until interrupted:\n" +
			"  TIME ENDPOINT DIRECTION SRC -> DST PROTO identity=ID [LABELS] VERDICT by POLICY | (REASON)\n" +
			"where REASON is \"default deny\" (the endpoint is enforced and no entry matched) or\n" +
			"\"no policy\" (the endpoint is not enforced in that direction), and one for each query the\n" +
			"DNS proxy answers:\n" +
			"  TIME ENDPOINT dns CLIENT -> RESOLVER PROTO NAME TYPE VERDICT by POLICY | (REASON) RCODE [ANSWERS] LATENCY\n" +
			"--verdict, --endpoint, --policy and --type (policy or dns) filter on the agent. -o json\n" +
			"prints the agent's lines as they come: verdict objects, {\"dropped\": N} and {\"lost\": N}.\n" +
			"\n" +
			"The agent keeps 1024 verdicts for a client that reads slowly; what does not fit is dropped\n" +
			"and the total said on stderr (\"N verdicts dropped\", counted before filtering), as are the\n" +
			"events the datapath lost since the command started (\"N verdicts lost\").\n" +
			"\n" +
			"The agent is found like `apiary db` finds it: --server, else APIARY_SERVER, else\n" +
			"http://$APIARY_API_ADDR, else " + defaultServer + ".\n" +
			"\n" +
			"Why was this connection refused?\n" +
			"  apiary monitor --verdict denied [--endpoint NAMESPACE/POD]\n" +
			"      the refused connection: endpoint, peer and its identity, port, and the policy that\n" +
			"      denied it, or \"default deny\" when no entry allowed it\n" +
			"  apiary db show policy-entries\n" +
			"      the endpoint's entries for that identity and port, and the policies behind them",
		Example: "  apiary monitor\n" +
			"  apiary monitor --verdict denied --endpoint default/web\n" +
			"  apiary monitor --policy cnp/default/deny-web -o json\n" +
			"  apiary monitor --type dns --verdict denied",
		Args: cobra.NoArgs,
		PreRun: func(cmd *cobra.Command, _ []string) {
			applyEnv(cmd.Flags(), "server")
			c.server = serverFromEnv(cmd.Flags().Lookup("server"), c.server)
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return c.run(ctx, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&c.server, "server", defaultServer, "URL of the agent's HTTP API (its --api-addr)")
	fs.StringVarP(&c.output, "output", "o", "text", "Output format: text (a line per verdict) or json (the agent's JSON lines)")
	fs.StringSliceVar(&c.verdicts, "verdict", nil, "Only these verdicts: allowed, denied or audited (repeatable, or comma-separated)")
	fs.StringVar(&c.endpoint, "endpoint", "", "Only the verdicts of this endpoint (namespace/pod)")
	fs.StringVar(&c.policy, "policy", "", "Only the verdicts this policy decided (cnp/NAMESPACE/NAME or ccnp/NAME)")
	fs.StringVar(&c.typ, "type", "", "Only verdicts of this type: policy (connections and flows) or dns (the DNS proxy's queries)")
	return cmd
}

// query returns the filters as the query of policy.VerdictsPath, or an
// error naming the flag that is wrong.
func (c *monitorClient) query() (url.Values, error) {
	q := url.Values{}
	for _, v := range c.verdicts {
		switch v := strings.ToLower(strings.TrimSpace(v)); v {
		case policy.VerdictAllowed, policy.VerdictDenied, policy.VerdictAudited:
			q.Add(policy.VerdictsParamVerdict, v)
		default:
			return nil, fmt.Errorf("--verdict %q: want %s, %s or %s", v, policy.VerdictAllowed, policy.VerdictDenied, policy.VerdictAudited)
		}
	}
	if c.endpoint != "" {
		q.Set(policy.VerdictsParamEndpoint, c.endpoint)
	}
	if c.policy != "" {
		q.Set(policy.VerdictsParamPolicy, c.policy)
	}
	switch c.typ {
	case "":
	case policy.VerdictTypePolicy, policy.VerdictTypeDNS:
		q.Set(policy.VerdictsParamType, c.typ)
	default:
		return nil, fmt.Errorf("--type %q: want %s or %s", c.typ, policy.VerdictTypePolicy, policy.VerdictTypeDNS)
	}
	return q, nil
}

// run streams the verdicts to stdout until ctx ends (Ctrl-C), which is
// not an error, or the stream does, which is.
func (c *monitorClient) run(ctx context.Context, stdout, stderr io.Writer) error {
	if c.output != "text" && c.output != "json" {
		return fmt.Errorf("-o %q: want text or json", c.output)
	}
	q, err := c.query()
	if err != nil {
		return err
	}
	resp, err := c.open(ctx, q)
	if err != nil {
		if ctx.Err() != nil {
			return nil // interrupted before the agent answered
		}
		return err
	}
	defer resp.Body.Close()

	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		if err := c.printLine(stdout, stderr, sc.Bytes()); err != nil {
			return err
		}
	}
	if ctx.Err() != nil {
		return nil // interrupted by the user
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("verdict stream from %s broke: %w", c.server, err)
	}
	return fmt.Errorf("verdict stream from %s ended (agent stopped?)", c.server)
}

// open requests the verdict stream. Any failure, including an error the
// agent answers, comes back as one readable error.
func (c *monitorClient) open(ctx context.Context, q url.Values) (*http.Response, error) {
	resp, err := (&dbClient{server: c.server, http: c.http}).request(ctx, policy.VerdictsPath, q)
	var apiErr *apiError
	switch {
	case err == nil:
		return resp, nil
	case !errors.As(err, &apiErr):
		return nil, err
	case apiErr.status == http.StatusNotFound:
		return nil, fmt.Errorf("the agent at %s does not serve %s (an agent without policy verdicts?)", c.server, policy.VerdictsPath)
	case apiErr.msg != "":
		return nil, fmt.Errorf("the agent refused the verdict stream: %s", apiErr.msg)
	}
	return nil, err
}

// monitorLine is any line of the verdict stream: a verdict, or a count of
// dropped or lost verdicts.
type monitorLine struct {
	policy.Verdict
	Dropped *uint64 `json:"dropped"`
	Lost    *uint64 `json:"lost"`
}

// printLine prints one line of the stream: in json as it came, in text
// the verdicts to stdout and the counts to stderr.
func (c *monitorClient) printLine(stdout, stderr io.Writer, data []byte) error {
	var l monitorLine
	if err := json.Unmarshal(data, &l); err != nil {
		return fmt.Errorf("broken verdict stream from %s: %w", c.server, err)
	}
	if c.output == "json" {
		_, err := fmt.Fprintf(stdout, "%s\n", data)
		return err
	}
	switch {
	case l.Dropped != nil:
		fmt.Fprintf(stderr, "monitor: %d verdicts dropped: this client read too slowly\n", *l.Dropped)
	case l.Lost != nil:
		fmt.Fprintf(stderr, "monitor: %d verdicts lost by the datapath since monitoring started (its event buffer was full)\n", *l.Lost)
	case l.Verdict.Verdict == "":
		// A kind of line this client does not know (a newer agent).
	default:
		_, err := fmt.Fprintln(stdout, formatVerdict(&l.Verdict))
		return err
	}
	return nil
}

// monitorTimeFormat is how a text line shows a verdict's time, in UTC to
// the millisecond.
const monitorTimeFormat = "2006-01-02T15:04:05.000Z07:00"

// maxLabelsLen is how long the labels of a verdict's line may be before
// they are cut short.
const maxLabelsLen = 60

// formatVerdict is the text line of a verdict:
//
//	2026-11-24T21:03:04.123Z default/web egress 10.0.0.5:43210 -> 192.0.2.10:443 TCP identity=16777217 [k8s:app=api] DENIED by cnp/default/deny-web
//
// ending in "by POLICY" when a policy's entry decided, else "(default deny)"
// or "(no policy)", then "at interface" for a drop on the host side of a
// pod's interface (packet level).
//
// A DNS verdict's line names the query and the answer instead of the
// identity:
//
//	2026-11-24T21:03:04.123Z default/web dns 10.0.0.5:40000 -> 10.0.0.10:53 UDP www.example.com. A ALLOWED by cnp/default/web NOERROR [192.0.2.1] 1.2ms
func formatVerdict(v *policy.Verdict) string {
	var b strings.Builder
	ts := "-"
	if !v.Time.IsZero() {
		ts = v.Time.UTC().Format(monitorTimeFormat)
	}
	if v.DNS != nil {
		fmt.Fprintf(&b, "%s %s dns %s -> %s %s %s %s %s", ts, orDash(v.Endpoint), orDash(v.Src), orDash(v.Dst),
			orDash(v.Proto), orDash(v.DNS.Query), orDash(v.DNS.QType), strings.ToUpper(orDash(v.Verdict)))
		if v.Policy != "" {
			b.WriteString(" by " + v.Policy)
		} else {
			b.WriteString(" (" + orDash(v.Reason) + ")")
		}
		fmt.Fprintf(&b, " %s [%s] %.1fms", orDash(v.DNS.RCode), strings.Join(v.DNS.Answers, ","), v.DNS.LatencyMs)
		return b.String()
	}
	fmt.Fprintf(&b, "%s %s %s %s -> %s %s identity=%d",
		ts, orDash(v.Endpoint), orDash(v.Direction), orDash(v.Src), orDash(v.Dst), orDash(v.Proto), v.RemoteIdentity)
	if labels := shortLabels(v.RemoteLabels); labels != "" {
		b.WriteString(" [" + labels + "]")
	}
	b.WriteString(" " + strings.ToUpper(orDash(v.Verdict)))
	switch {
	case v.Policy != "":
		b.WriteString(" by " + v.Policy)
		if v.Reason != "" && v.Reason != policy.ReasonPolicy {
			b.WriteString(" (" + v.Reason + ")")
		}
	case v.Reason != "" && v.Reason != policy.ReasonPolicy:
		b.WriteString(" (" + v.Reason + ")")
	default:
		// An entry decided but its policy is not known, or nothing says.
		b.WriteString(" (" + cmp.Or(v.Reason, policy.ReasonNoPolicy) + ")")
	}
	if v.Layer == policy.LayerInterface {
		b.WriteString(" at interface")
	}
	return b.String()
}

// shortLabels joins labels with commas, leaving out those past
// maxLabelsLen characters with a count of them ("…+3").
func shortLabels(labels []string) string {
	var b strings.Builder
	for i, l := range labels {
		if b.Len() > 0 && b.Len()+1+len(l) > maxLabelsLen {
			return b.String() + ",…+" + strconv.Itoa(len(labels)-i)
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(l)
	}
	return b.String()
}

// orDash stands in for an empty field, so that a line keeps its columns.
func orDash(s string) string { return cmp.Or(s, "-") }
