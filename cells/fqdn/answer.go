package fqdn

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/miekg/dns"

	"github.com/apiary-net/apiary/cells/fqdn/pattern"
)

// answer is what the proxy learns from an upstream's reply.
type answer struct {
	// name is the question name, normalised (see pattern.Normalize).
	name string
	// ips are the addresses of the A and AAAA records of name and of the
	// names its CNAME chain leads to.
	ips []netip.Addr
	// ttl is the smallest TTL of those records and of the CNAMEs.
	ttl time.Duration
}

// errDrop marks an upstream reply the proxy drops: it is neither labelled
// nor passed on.
var errDrop = errors.New("upstream answer dropped")

// dropError is why a reply was dropped; reason is a metric label.
type dropError struct {
	reason string
	err    error
}

func (e *dropError) Error() string   { return fmt.Sprintf("%s: %s", e.reason, e.err) }
func (e *dropError) Unwrap() []error { return []error{errDrop, e.err} }

func drop(reason string, format string, args ...any) error {
	return &dropError{reason: reason, err: fmt.Errorf(format, args...)}
}

// maxCNAMEChain bounds how many CNAMEs are followed from the question name.
const maxCNAMEChain = 16

// parseAnswer unpacks wire, the upstream's reply to req, checks that it
// answers req, and returns it with the addresses it gives the question
// name. maxSize is the largest reply the proxy accepts (the UDP size it
// asked for, or 65535 over TCP); a larger one is dropped as oversized, an
// unparsable or mismatched one as malformed. It never panics on input.
func parseAnswer(req *dns.Msg, wire []byte, maxSize int) (*dns.Msg, answer, error) {
	if len(wire) > maxSize {
		return nil, answer{}, drop("oversized", "%d bytes, more than the %d asked for", len(wire), maxSize)
	}
	resp := new(dns.Msg)
	if err := resp.Unpack(wire); err != nil {
		return nil, answer{}, drop("malformed", "unpack: %w", err)
	}
	if !resp.Response {
		return nil, answer{}, drop("malformed", "not a response")
	}
	if resp.Id != req.Id {
		return nil, answer{}, drop("malformed", "ID %d does not match the request's %d", resp.Id, req.Id)
	}
	if len(req.Question) != 1 || len(resp.Question) != 1 {
		return nil, answer{}, drop("malformed", "%d questions in the reply, want 1", len(resp.Question))
	}
	q, rq := req.Question[0], resp.Question[0]
	if !strings.EqualFold(q.Name, rq.Name) || q.Qtype != rq.Qtype || q.Qclass != rq.Qclass {
		return nil, answer{}, drop("malformed", "question %s does not match the request's %s", rq.String(), q.String())
	}
	a := answer{name: pattern.Normalize(q.Name)}
	if resp.Rcode != dns.RcodeSuccess || q.Qclass != dns.ClassINET {
		return resp, a, nil
	}
	// The names whose addresses belong to the question: the question name
	// and the CNAME chain from it.
	names := map[string]bool{a.name: true}
	var minTTL uint32
	haveTTL := false
	see := func(ttl uint32) {
		if !haveTTL || ttl < minTTL {
			minTTL, haveTTL = ttl, true
		}
	}
	for range maxCNAMEChain {
		grew := false
		for _, rr := range resp.Answer {
			c, ok := rr.(*dns.CNAME)
			if !ok || !names[pattern.Normalize(c.Hdr.Name)] || names[pattern.Normalize(c.Target)] {
				continue
			}
			names[pattern.Normalize(c.Target)] = true
			see(c.Hdr.Ttl)
			grew = true
		}
		if !grew {
			break
		}
	}
	seen := map[netip.Addr]bool{}
	for _, rr := range resp.Answer {
		var ip netip.Addr
		switch r := rr.(type) {
		case *dns.A:
			ip, _ = netip.AddrFromSlice(r.A.To4())
		case *dns.AAAA:
			ip, _ = netip.AddrFromSlice(r.AAAA.To16())
		default:
			continue
		}
		if !names[pattern.Normalize(rr.Header().Name)] || !ip.IsValid() {
			continue
		}
		see(rr.Header().Ttl)
		ip = ip.Unmap()
		if !seen[ip] {
			seen[ip] = true
			a.ips = append(a.ips, ip)
		}
	}
	a.ttl = time.Duration(minTTL) * time.Second
	return resp, a, nil
}
