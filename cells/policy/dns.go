package policy

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/bpf/policyprog"
	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/reconcilers"
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
	lost                 *ebpf.Map // dns_origin_lost
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
	for _, s := range []*ebpf.MapSpec{bpf.DNSOriginMapSpec(), bpf.DNSConfigMapSpec(), bpf.DNSOriginLostMapSpec()} {
		// No migration: what they hold is rebuilt by the next query
		// (or, for the origins' inner maps, by the endpoint-policy
		// reconciler, whose Prune after a replacement makes none: its
		// Update of each row does, retried until the map is there).
		pm, err := bpf.OpenPinnedMap(d.log, s, d.pinDir, nil)
		if err != nil {
			for _, m := range opened {
				m.Close()
			}
			return nil, nil, nil, err
		}
		opened = append(opened, pm.Map)
	}
	d.sock, d.origin, d.config, d.lost = opened[0], opened[1], opened[2], opened[3]
	return d.sock, d.origin, d.config, nil
}

// lostMap returns dns_origin_lost.
func (d *dnsMaps) lostMap() (*ebpf.Map, error) {
	if _, _, _, err := d.get(); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lost, nil
}

// lostOrigins returns how many origins the programs could not publish.
func (d *dnsMaps) lostOrigins() (uint64, error) {
	m, err := d.lostMap()
	if err != nil {
		return 0, err
	}
	var perCPU []uint64
	if err := m.Lookup(uint32(0), &perCPU); err != nil {
		return 0, fmt.Errorf("read %s: %w", bpf.DNSOriginLostMap, err)
	}
	var n uint64
	for _, v := range perCPU {
		n += v
	}
	return n, nil
}

func (d *dnsMaps) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, m := range []*ebpf.Map{d.sock, d.origin, d.config, d.lost} {
		if m != nil {
			m.Close()
		}
	}
	d.sock, d.origin, d.config, d.lost = nil, nil, nil, nil
}

// dnsOrigins implements reconcilers.EndpointMaps on dns_origin: an
// endpoint with DNS rules has a map of its own there, which only its
// sockets write. The endpoint-policy reconciler is its only writer.
type dnsOrigins struct {
	maps *dnsMaps
}

var _ reconcilers.EndpointMaps = (*dnsOrigins)(nil)

// Ensure implements reconcilers.EndpointMaps.
func (d *dnsOrigins) Ensure(e *tables.EndpointPolicy) error {
	if len(e.DNS) == 0 {
		return d.Remove(e.ID)
	}
	_, origin, _, err := d.maps.get()
	if err != nil {
		return err
	}
	var inner *ebpf.Map
	if err := origin.Lookup(e.ID, &inner); err == nil {
		inner.Close() // kept: its entries are still the endpoint's
		return nil
	}
	m, err := ebpf.NewMap(bpf.DNSOriginInnerSpec())
	if err != nil {
		return fmt.Errorf("create the %s map of endpoint ID %d: %w", bpf.DNSOriginMap, e.ID, err)
	}
	defer m.Close()
	if err := origin.Put(e.ID, m); err != nil {
		return fmt.Errorf("write %s[%d]: %w", bpf.DNSOriginMap, e.ID, err)
	}
	return nil
}

// Remove implements reconcilers.EndpointMaps.
func (d *dnsOrigins) Remove(id uint32) error {
	_, origin, _, err := d.maps.get()
	if err != nil {
		return err
	}
	if err := origin.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete %s[%d]: %w", bpf.DNSOriginMap, id, err)
	}
	return nil
}

// Prune implements reconcilers.EndpointMaps.
func (d *dnsOrigins) Prune(keep map[uint32]struct{}) error {
	_, origin, _, err := d.maps.get()
	if err != nil {
		return err
	}
	var stale []uint32
	var id, inner uint32
	it := origin.Iterate()
	for it.Next(&id, &inner) {
		if _, ok := keep[id]; !ok {
			stale = append(stale, id)
		}
	}
	errs := []error{it.Err()}
	for _, id := range stale {
		errs = append(errs, d.Remove(id))
	}
	return errors.Join(errs...)
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
	_, _, config, err := i.maps.get()
	if err != nil {
		return err
	}
	if err := config.Put(uint32(0), cfg); err != nil {
		return fmt.Errorf("write %s: %w", bpf.DNSConfigMap, err)
	}
	return nil
}

// Origin implements fqdn.Interceptor. The client's address gives the pod,
// and so the endpoint, in whose own map of dns_origin its socket published
// the resolver: no other pod's queries push that entry out or overwrite it
// (one bound to this pod's address with IP_FREEBIND or IP_TRANSPARENT
// writes into its own endpoint's map).
func (i *interceptor) Origin(protocol uint8, client netip.AddrPort) (fqdn.Origin, bool) {
	_, origin, _, err := i.maps.get()
	if err != nil {
		return fqdn.Origin{}, false
	}
	i.waitEndpoints()
	name, isPod := i.podOf(client.Addr())
	if !isPod {
		return i.originOfHostSource(origin, protocol, client)
	}
	rtxn := i.db.ReadTxn()
	row, _, found := i.endpoints.Get(rtxn, tables.EndpointPolicyNameIndex.Query(name))
	if !found || row.ID == 0 || row.PodTree {
		return i.originByAddr(client.Addr())
	}
	var inner *ebpf.Map
	if err := origin.Lookup(row.ID, &inner); err != nil {
		return i.originByAddr(client.Addr())
	}
	defer inner.Close()
	var v bpf.DNSOrigin
	if err := inner.Lookup(bpf.NewDNSOriginKey(protocol, client), &v); err != nil || v.EndpointID != row.ID {
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
func (i *interceptor) originOfHostSource(origin *ebpf.Map, protocol uint8, client netip.AddrPort) (fqdn.Origin, bool) {
	rtxn := i.db.ReadTxn()
	key := bpf.NewDNSOriginKey(protocol, client)
	var found fqdn.Origin
	n := 0
	for row := range i.endpoints.All(rtxn) {
		if row.ID == 0 || row.PodTree || len(row.DNS) == 0 || i.hasInterface(rtxn, row.Name) {
			continue
		}
		var inner *ebpf.Map
		if err := origin.Lookup(row.ID, &inner); err != nil {
			continue
		}
		var v bpf.DNSOrigin
		err := inner.Lookup(key, &v)
		inner.Close()
		if err == nil && v.EndpointID == row.ID {
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
