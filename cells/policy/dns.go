package policy

import (
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/policyprog"
	"github.com/apiary-net/apiary/cells/bpffs"
	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// newDNSMaps returns the maps of DNS interception, opened on first use.
func newDNSMaps(log *slog.Logger, pinDir bpffs.PinDir, maps bpffs.Maps, lc cell.Lifecycle) *reconcilers.DNSMaps {
	d := reconcilers.NewDNSMaps(log, maps, string(pinDir), func() (*ebpf.MapSpec, error) {
		spec, err := policyprog.Spec()
		if err != nil {
			return nil, err
		}
		return bpf.DNSSockMapSpec(spec)
	})
	lc.Append(cell.Hook{OnStop: func(cell.HookContext) error { d.Close(); return nil }})
	return d
}

type interceptorParams struct {
	cell.In

	Config    Config
	DB        *statedb.DB
	Maps      *reconcilers.DNSMaps
	Endpoints statedb.RWTable[*tables.EndpointPolicy]
	Pods      statedb.Table[*tables.Endpoint]
	Ifaces    statedb.Table[*tables.PodInterface]
	Monitor   *Monitor
}

// newInterceptor returns the DNS proxy's side of DNS interception; none
// with --enable-policy=never, where no program runs.
func newInterceptor(p interceptorParams) fqdn.Interceptor {
	if p.Config.EnablePolicy == ModeNever {
		return nil
	}
	return &interceptor{maps: p.Maps, db: p.DB, endpoints: p.Endpoints, pods: p.Pods, ifaces: p.Ifaces, monitor: p.Monitor}
}

// interceptor implements fqdn.Interceptor on the DNS maps, the
// endpoint-policy table and the verdict monitor.
type interceptor struct {
	maps      *reconcilers.DNSMaps
	db        *statedb.DB
	endpoints statedb.Table[*tables.EndpointPolicy]
	monitor   *Monitor

	// pods gives the endpoints' addresses, for a query that reached the
	// proxy without passing the socket hooks.
	pods statedb.Table[*tables.Endpoint]
	// ifaces tells which pods have an interface of their own.
	ifaces statedb.Table[*tables.PodInterface]

	mu     sync.Mutex
	byAddr map[netip.Addr]string // endpoint names by address
	podsAt statedb.Revision
}

// SetProxy implements fqdn.Interceptor.
func (i *interceptor) SetProxy(proxy4, proxy6 netip.AddrPort, intercept bool) error {
	cfg, err := bpf.NewDNSConfig(proxy4, proxy6, intercept)
	if err != nil {
		return err
	}
	return i.maps.SetConfig(cfg)
}

// Origin implements fqdn.Interceptor. The client's address gives the pod,
// and so the endpoint, in whose own map of dns_origin its socket published
// the resolver: no other pod's queries push that entry out or overwrite it
// (one bound to this pod's address with IP_FREEBIND or IP_TRANSPARENT
// writes into its own endpoint's map).
func (i *interceptor) Origin(protocol uint8, client netip.AddrPort) (fqdn.Origin, bool) {
	if err := i.maps.Open(); err != nil {
		return fqdn.Origin{}, false
	}
	i.waitEndpoints()
	name, isPod := i.podOf(client.Addr())
	if !isPod {
		return i.originOfHostSource(protocol, client)
	}
	rtxn := i.db.ReadTxn()
	row, _, found := i.endpoints.Get(rtxn, tables.EndpointPolicyNameIndex.Query(name))
	if !found || row.ID == 0 || row.PodTree {
		return i.originByAddr(client.Addr())
	}
	v, ok := i.maps.Origin(row.ID, bpf.NewDNSOriginKey(protocol, client))
	if !ok {
		return i.originByAddr(client.Addr())
	}
	return fqdn.Origin{Resolver: v.ResolverAddr(), Endpoint: row.Name, Rules: row.DNS}, true
}

// originInitWait bounds how long a query waits for the first policy
// computation after a start.
const originInitWait = 5 * time.Second

// waitEndpoints waits, at most originInitWait, until the endpoint-policy
// table holds the first computation's rows. Just after a restart the
// programs a previous run pinned already send pods' queries to the proxy;
// without the rows, the origin they published cannot be found and the
// query would go to --dns-upstream instead of the resolver the pod asked.
func (i *interceptor) waitEndpoints() {
	ok, initialized := i.endpoints.Initialized(i.db.ReadTxn())
	if ok {
		return
	}
	t := time.NewTimer(originInitWait)
	defer t.Stop()
	select {
	case <-initialized:
	case <-t.C:
	}
}

// originOfHostSource is the origin of a query from an address of no pod:
// the node's, from a process of the node or of a pod without a network
// namespace of its own. Only the maps of endpoints without an interface
// of their own are searched (one with its own interface sends from the
// node's addresses only by binding one not its own, whose packets its
// interface drops), and an entry found in more than one is used in none.
func (i *interceptor) originOfHostSource(protocol uint8, client netip.AddrPort) (fqdn.Origin, bool) {
	rtxn := i.db.ReadTxn()
	key := bpf.NewDNSOriginKey(protocol, client)
	var found fqdn.Origin
	n := 0
	for row := range i.endpoints.All(rtxn) {
		if row.ID == 0 || row.PodTree || len(row.DNS) == 0 || i.hasInterface(rtxn, row.Name) {
			continue
		}
		if v, ok := i.maps.Origin(row.ID, key); ok {
			found = fqdn.Origin{Resolver: v.ResolverAddr(), Endpoint: row.Name, Rules: row.DNS}
			n++
		}
	}
	return found, n == 1
}

// hasInterface tells whether the pod of endpoint name has an interface of
// its own to the host.
func (i *interceptor) hasInterface(rtxn statedb.ReadTxn, name string) bool {
	if i.ifaces == nil {
		return false
	}
	row, _, ok := i.ifaces.Get(rtxn, tables.PodInterfaceNameIndex.Query(name))
	return ok && row.Ifindex != 0
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
