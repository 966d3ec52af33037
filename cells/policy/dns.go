package policy

import (
	"fmt"
	"log/slog"
	"net/netip"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/policyprog"
	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/tables"
)

// dnsMaps are the pinned maps of DNS interception (bpf/c/dns_redirect.h),
// opened on first use by the attacher (for the programs) and by the
// interceptor (for the DNS proxy), and kept open until the agent stops.
type dnsMaps struct {
	log    *slog.Logger
	pinDir string

	mu                   sync.Mutex
	sock, origin, config *ebpf.Map
}

// get returns the maps, opening (or creating and pinning) them the first
// time.
func (d *dnsMaps) get() (sock, origin, config *ebpf.Map, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.sock != nil {
		return d.sock, d.origin, d.config, nil
	}
	spec, err := policyprog.Spec()
	if err != nil {
		return nil, nil, nil, err
	}
	sockSpec, err := bpf.DNSSockMapSpec(spec)
	if err != nil {
		return nil, nil, nil, err
	}
	sock, err = bpf.OpenDNSSockMap(d.log, sockSpec, d.pinDir)
	if err != nil {
		return nil, nil, nil, err
	}
	opened := []*ebpf.Map{sock}
	for _, s := range []*ebpf.MapSpec{bpf.DNSOriginMapSpec(), bpf.DNSConfigMapSpec()} {
		// No migration: what they hold is rebuilt by the next query.
		pm, err := bpf.OpenPinnedMap(d.log, s, d.pinDir, nil)
		if err != nil {
			for _, m := range opened {
				m.Close()
			}
			return nil, nil, nil, err
		}
		opened = append(opened, pm.Map)
	}
	d.sock, d.origin, d.config = opened[0], opened[1], opened[2]
	return d.sock, d.origin, d.config, nil
}

func (d *dnsMaps) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, m := range []*ebpf.Map{d.sock, d.origin, d.config} {
		if m != nil {
			m.Close()
		}
	}
	d.sock, d.origin, d.config = nil, nil, nil
}

// interceptor implements fqdn.Interceptor on the DNS maps, the
// endpoint-policy table and the verdict monitor.
type interceptor struct {
	maps      *dnsMaps
	db        *statedb.DB
	endpoints statedb.Table[*tables.EndpointPolicy]
	monitor   *Monitor

	// pods gives the endpoints' addresses, for a query that reached the
	// proxy without passing the socket hooks.
	pods statedb.Table[*tables.Endpoint]

	mu     sync.Mutex
	rows   map[uint32]*tables.EndpointPolicy // by ID
	rowsAt statedb.Revision
	byAddr map[netip.Addr]string // endpoint names by address
	podsAt statedb.Revision
}

// SetProxy implements fqdn.Interceptor.
func (i *interceptor) SetProxy(proxy4, proxy6 netip.AddrPort, intercept bool) error {
	cfg, err := bpf.NewDNSConfig(proxy4, proxy6, intercept)
	if err != nil {
		return err
	}
	_, _, config, err := i.maps.get()
	if err != nil {
		return err
	}
	if err := config.Put(uint32(0), cfg); err != nil {
		return fmt.Errorf("write %s: %w", bpf.DNSConfigMap, err)
	}
	return nil
}

// Origin implements fqdn.Interceptor.
func (i *interceptor) Origin(protocol uint8, client netip.AddrPort) (fqdn.Origin, bool) {
	_, origin, _, err := i.maps.get()
	if err != nil {
		return fqdn.Origin{}, false
	}
	var v bpf.DNSOrigin
	if err := origin.Lookup(bpf.NewDNSOriginKey(protocol, client), &v); err != nil {
		return i.originByAddr(client.Addr())
	}
	row := i.endpointRow(v.EndpointID)
	if owner, isPod := i.podOf(client.Addr()); isPod && (row == nil || row.Name != owner) {
		// Published by another endpoint than the pod whose address the
		// query comes from: a socket bound to an address not its own
		// (IP_FREEBIND, IP_TRANSPARENT), whose packet the pod's
		// interface drops but whose entry the socket's hook wrote. The
		// endpoint ID is the hook's (the cgroup's), which no pod forges.
		return i.originByAddr(client.Addr())
	}
	o := fqdn.Origin{Resolver: v.ResolverAddr()}
	if row != nil {
		o.Endpoint, o.Rules = row.Name, row.DNS
	}
	return o, true
}

// podOf returns the name of the endpoint whose pod has the address addr,
// if a pod has it.
func (i *interceptor) podOf(addr netip.Addr) (string, bool) {
	if i.pods == nil {
		return "", false
	}
	rtxn := i.db.ReadTxn()
	i.mu.Lock()
	defer i.mu.Unlock()
	i.refreshByAddrLocked(rtxn)
	name, ok := i.byAddr[addr.Unmap()]
	return name, ok
}

// refreshByAddrLocked rebuilds byAddr when the pods table changed.
func (i *interceptor) refreshByAddrLocked(rtxn statedb.ReadTxn) {
	if rev := i.pods.Revision(rtxn); rev != i.podsAt || i.byAddr == nil {
		i.podsAt = rev
		i.byAddr = map[netip.Addr]string{}
		for ep := range i.pods.All(rtxn) {
			for _, a := range ep.IPs {
				i.byAddr[a] = ep.Name
			}
		}
	}
}

// originByAddr is the origin of a query the socket hooks did not publish:
// one a pod made without a socket (a packet socket, which the programs on
// its interface let through to the proxy only), or whose entry was pushed
// out. A pod with DNS rules gets them, asked of the proxy's upstream: its
// DNS is never unfiltered.
func (i *interceptor) originByAddr(addr netip.Addr) (fqdn.Origin, bool) {
	if i.pods == nil {
		return fqdn.Origin{}, false
	}
	name, ok := i.podOf(addr)
	if !ok {
		return fqdn.Origin{}, false
	}
	rtxn := i.db.ReadTxn()
	row, _, found := i.endpoints.Get(rtxn, tables.EndpointPolicyNameIndex.Query(name))
	if !found || len(row.DNS) == 0 {
		return fqdn.Origin{}, false
	}
	return fqdn.Origin{Endpoint: row.Name, Rules: row.DNS}, true
}

// endpointRow returns the endpoint-policy row of an endpoint ID, nil for
// one the agent does not know.
func (i *interceptor) endpointRow(id uint32) *tables.EndpointPolicy {
	rtxn := i.db.ReadTxn()
	i.mu.Lock()
	defer i.mu.Unlock()
	if rev := i.endpoints.Revision(rtxn); rev != i.rowsAt || i.rows == nil {
		i.rowsAt = rev
		i.rows = map[uint32]*tables.EndpointPolicy{}
		for ep := range i.endpoints.All(rtxn) {
			if ep.ID != 0 && !ep.PodTree {
				i.rows[ep.ID] = ep
			}
		}
	}
	return i.rows[id]
}

// Report implements fqdn.Interceptor: the query becomes a verdict of type
// dns in the monitor.
func (i *interceptor) Report(q fqdn.QueryVerdict) {
	if i.monitor.Subscribers() == 0 {
		return // nobody watches: spare the proxy building the event
	}
	v := Verdict{
		Time: q.Time.UTC(), Type: VerdictTypeDNS, Endpoint: q.Endpoint, Direction: tables.DirEgress,
		Src: q.Client.String(), Dst: q.Resolver.String(), Proto: q.Protocol, RemoteLabels: []string{},
		Verdict: VerdictAllowed, Policy: q.Policy, Reason: ReasonDNSRule,
		DNS: &DNSVerdict{
			Query: q.Name, QType: q.Type, RCode: q.RCode, Answers: []string{}, Unlabelled: q.Unlabelled,
			LatencyMs: float64(q.Latency.Microseconds()) / 1000,
		},
	}
	for _, a := range q.Answers {
		v.DNS.Answers = append(v.DNS.Answers, a.String())
	}
	switch {
	case !q.Allowed:
		v.Verdict, v.Reason = VerdictDenied, ReasonNoDNSRule
	case q.Endpoint == "":
		// Sent to the proxy directly: no endpoint's rules apply.
		v.Reason = ReasonNotIntercepted
	}
	i.monitor.Publish(v)
}
