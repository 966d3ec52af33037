package fqdn

import (
	"errors"
	"fmt"
	"github.com/spf13/pflag"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/miekg/dns"
)

// scriptCommands provides fqdn/query, which asks the DNS proxy as a
// workload would:
//
//	fqdn/query [--tcp] [--type A|AAAA] NAME
//
// It prints the answer's rcode and its A/AAAA records, one per line
// ("NAME A ADDR"), sorted, without TTLs.
func scriptCommands(p *Proxy) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"fqdn/query": script.Command(
			script.CmdUsage{
				Summary: "Query the DNS proxy and print the answer",
				Args:    "[--tcp] [--type A|AAAA] name",
				Flags: func(fs *pflag.FlagSet) {
					fs.Bool("tcp", false, "Query over TCP")
					fs.String("type", "A", "Query type")
				},
			},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				tcp, err := s.Flags.GetBool("tcp")
				if err != nil {
					return nil, err
				}
				qtype, err := s.Flags.GetString("type")
				if err != nil {
					return nil, err
				}
				t, ok := dns.StringToType[strings.ToUpper(qtype)]
				if !ok {
					return nil, fmt.Errorf("unknown query type %q", qtype)
				}
				addr := p.Addr()
				if addr == "" {
					return nil, errors.New("the DNS proxy is not running (--dns-proxy-addr)")
				}
				resp, err := Query(addr, args[0], t, tcp, 5*time.Second)
				if err != nil {
					return nil, err
				}
				s.Logf("%s", FormatAnswer(resp))
				return func(*script.State) (string, string, error) {
					return FormatAnswer(resp), "", nil
				}, nil
			}),
	})
}

// Query asks the DNS server at addr for name, over TCP or UDP.
func Query(addr, name string, qtype uint16, tcp bool, timeout time.Duration) (*dns.Msg, error) {
	c := &dns.Client{Timeout: timeout}
	if tcp {
		c.Net = "tcp"
	}
	req := new(dns.Msg).SetQuestion(dns.Fqdn(name), qtype)
	resp, _, err := c.Exchange(req, addr)
	if err != nil {
		return nil, fmt.Errorf("query %s for %s: %w", addr, name, err)
	}
	return resp, nil
}

// FormatAnswer prints the rcode and the A/AAAA records of resp.
func FormatAnswer(resp *dns.Msg) string {
	var lines []string
	for _, rr := range resp.Answer {
		switch r := rr.(type) {
		case *dns.A:
			lines = append(lines, fmt.Sprintf("%s A %s", r.Hdr.Name, r.A))
		case *dns.AAAA:
			lines = append(lines, fmt.Sprintf("%s AAAA %s", r.Hdr.Name, r.AAAA))
		}
	}
	slices.Sort(lines)
	return dns.RcodeToString[resp.Rcode] + "\n" + strings.Join(append(lines, ""), "\n")
}
