package fqdn

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// Values of QueryVerdict.Unlabelled.
const (
	// unlabelledUntrusted: an answer from a resolver the node does not
	// trust, to a query of no endpoint, labelled nothing.
	unlabelledUntrusted = "untrusted resolver"
	// unlabelledEndpointOnly: an answer from a resolver the node does not
	// trust labelled its addresses for the endpoint that asked alone.
	unlabelledEndpointOnly = "untrusted resolver: for this endpoint only"
	// unlabelledPodLimit: the endpoint that asked brought
	// --tofqdns-max-ips-per-pod addresses already; some of the answer's
	// were not labelled.
	unlabelledPodLimit = "pod address limit"
)

// trust tells the resolvers whose answers label addresses for every pod's
// toFQDNs selectors: the proxy's own upstream (--dns-upstream), those of
// --dns-trusted-resolvers, and the cluster DNS Service
// (--dns-cluster-service): its frontends and its backends (a pod's query
// to the Service reaches the proxy with the backend the socket load
// balancer chose). An answer from any other resolver — one a pod chose,
// which may be a host it controls — labels its addresses for the pod that
// asked alone: otherwise that pod could point another pod's allowed name
// at any address.
type trust struct {
	upstream  string
	prefixes  []netip.Prefix
	addrPorts []netip.AddrPort
	service   tables.ServiceName // zero: none

	db        *statedb.DB // nil without the load balancer's tables
	frontends statedb.Table[*tables.Frontend]
	backends  statedb.Table[*tables.Backend]
}

// parseTrusted parses --dns-trusted-resolvers: IP addresses, prefixes
// (any port) and IP:port pairs.
func parseTrusted(list []string) (prefixes []netip.Prefix, addrPorts []netip.AddrPort, err error) {
	for _, s := range list {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if ap, err := netip.ParseAddrPort(s); err == nil {
			addrPorts = append(addrPorts, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()))
			continue
		}
		if a, err := netip.ParseAddr(s); err == nil {
			prefixes = append(prefixes, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, nil, fmt.Errorf("--dns-trusted-resolvers: %q is neither an IP, a prefix nor IP:port", s)
		}
		prefixes = append(prefixes, p.Masked())
	}
	return prefixes, addrPorts, nil
}

// trusted tells whether answers from resolver (IP:port, as the proxy
// forwarded to it) label addresses cluster-wide.
func (t *trust) trusted(resolver string) bool {
	if t == nil {
		return false
	}
	if resolver == t.upstream {
		return true
	}
	ap, err := netip.ParseAddrPort(resolver)
	if err != nil {
		return false
	}
	ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	for _, p := range t.prefixes {
		if p.Contains(ap.Addr()) {
			return true
		}
	}
	for _, a := range t.addrPorts {
		if a == ap {
			return true
		}
	}
	return t.ofClusterService(ap)
}

// ofClusterService tells whether ap is a frontend or a backend of the
// cluster DNS Service, over UDP or TCP.
func (t *trust) ofClusterService(ap netip.AddrPort) bool {
	if t.db == nil || t.service == (tables.ServiceName{}) {
		return false
	}
	rtxn := t.db.ReadTxn()
	for _, proto := range []tables.Proto{tables.UDP, tables.TCP} {
		key := tables.L4Addr{Addr: ap.Addr(), Port: ap.Port(), Proto: proto}
		if t.frontends != nil {
			if f, _, ok := t.frontends.Get(rtxn, tables.FrontendAddressIndex.Query(key)); ok && f.Service == t.service {
				return true
			}
		}
		if t.backends != nil {
			if b, _, ok := t.backends.Get(rtxn, tables.BackendAddressIndex.Query(key)); ok {
				for _, inst := range b.Services {
					if inst.Service == t.service {
						return true
					}
				}
			}
		}
	}
	return false
}

// scope tells for whom ans, upstream's answer to a query of endpoint (""
// for none), labels its addresses: every pod (rowEndpoint empty) when the
// node trusts upstream; endpoint alone (rowEndpoint is endpoint) when it
// does not; nobody (ok false) for an untrusted answer to no endpoint.
// unlabelled is the verdict's reason. An answer from an untrusted
// resolver for a name FQDN selectors match is counted and warned about
// (at most once a second).
func (p *Proxy) scope(upstream, endpoint string, ans answer) (rowEndpoint, unlabelled string, ok bool) {
	if p.trust.trusted(upstream) {
		return "", "", true
	}
	unlabelled = unlabelledUntrusted
	if endpoint != "" {
		unlabelled = unlabelledEndpointOnly
	}
	if p.names.selected(ans.name) {
		p.metrics.untrusted.Inc()
		p.warnings.warn(p.log, "untrusted", "DNS proxy: an answer from a resolver the node does not trust labels its addresses for the pod that asked only",
			"name", ans.name, "resolver", upstream, "endpoint", endpoint)
	}
	return endpoint, unlabelled, endpoint != ""
}

// selected tells whether FQDN selectors match name; true when the lock is
// taken (the proxy's loop never waits for it).
func (m *nameManager) selected(name string) bool {
	if m == nil {
		return false
	}
	if !m.mu.TryLock() {
		return true
	}
	defer m.mu.Unlock()
	return len(m.matching(name)) > 0
}
