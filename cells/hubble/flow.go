package hubble

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	flowpb "github.com/cilium/cilium/api/v1/flow"
	"github.com/cilium/statedb"
	"github.com/miekg/dns"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/apiary-net/apiary/cells/policy"
	"github.com/apiary-net/apiary/cells/socketlb"
	"github.com/apiary-net/apiary/tables"
)

// Cilium's monitor message types, which Hubble's flows carry as their
// event type (`hubble observe --type`).
const (
	eventTypeDrop          = 1
	eventTypePolicyVerdict = 5
	eventTypeTraceSock     = 7
	eventTypeAccessLog     = 129
)

// Hubble's policy match types (the "L3-L4" of a policy-verdict flow).
const (
	policyMatchNone = 0
	policyMatchL3L4 = 2
)

// namespaceLabel is the security label carrying a pod's namespace.
const namespaceLabel = "k8s:io.kubernetes.pod.namespace"

// converter turns the agent's verdicts into Hubble flows, naming the
// node's pods from the endpoints table.
type converter struct {
	nodeName  string
	db        *statedb.DB
	endpoints statedb.Table[*tables.Endpoint]
	fqdnNames statedb.Table[*tables.FQDNName]
	frontends statedb.Table[*tables.Frontend]
	backends  statedb.Table[*tables.Backend]
	// ipcache names the pods of other nodes by their addresses' owners;
	// nil names none.
	ipcache statedb.Table[*tables.IPCacheEntry]

	// Caches of the endpoints and fqdn-names tables, rebuilt when their
	// revision changes.
	rev      statedb.Revision
	byName   map[string]*tables.Endpoint
	byIP     map[netip.Addr]*tables.Endpoint
	byCgroup map[uint64]*tables.Endpoint
	// cgroupRoot is --cgroup-root, under which the endpoints' cgroups
	// are.
	cgroupRoot string
	namesRev   statedb.Revision
	names      map[netip.Addr][]string
}

// lbTables are the load-balancing tables a converter names Services from.
type lbTables struct {
	frontends statedb.Table[*tables.Frontend]
	backends  statedb.Table[*tables.Backend]
}

func newConverter(nodeName string, db *statedb.DB, eps statedb.Table[*tables.Endpoint], names statedb.Table[*tables.FQDNName], lb lbTables) *converter {
	return &converter{nodeName: nodeName, db: db, endpoints: eps, fqdnNames: names, frontends: lb.frontends, backends: lb.backends,
		byName: map[string]*tables.Endpoint{}, byIP: map[netip.Addr]*tables.Endpoint{}, byCgroup: map[uint64]*tables.Endpoint{},
		names: map[netip.Addr][]string{}}
}

func (c *converter) refresh() {
	if c.db == nil {
		return
	}
	txn := c.db.ReadTxn()
	if c.fqdnNames != nil {
		if rev := c.fqdnNames.Revision(txn); rev != c.namesRev {
			c.namesRev = rev
			clear(c.names)
			for n := range c.fqdnNames.All(txn) {
				for _, ip := range n.IPs {
					c.names[ip.IP.Unmap()] = append(c.names[ip.IP.Unmap()], n.Name)
				}
			}
		}
	}
	rev := c.endpoints.Revision(txn)
	if rev == c.rev {
		return
	}
	c.rev = rev
	clear(c.byName)
	clear(c.byIP)
	clear(c.byCgroup)
	for ep := range c.endpoints.All(txn) {
		c.byName[ep.Name] = ep
		if ep.CgroupID != 0 {
			c.byCgroup[ep.CgroupID] = ep
		}
		for _, ip := range ep.IPs {
			c.byIP[ip] = ep
		}
	}
}

// flows returns the flows v stands for: one for a policy verdict, the
// query and (when allowed) its answer for a DNS verdict.
func (c *converter) flows(v policy.Verdict) []*flowpb.Flow {
	c.refresh()
	if v.Type == policy.VerdictTypeDNS && v.DNS != nil {
		return c.dnsFlows(v)
	}
	return []*flowpb.Flow{c.policyFlow(v)}
}

func (c *converter) base(v policy.Verdict, t time.Time) (*flowpb.Flow, netip.AddrPort, netip.AddrPort) {
	src, _ := netip.ParseAddrPort(v.Src)
	dst, _ := netip.ParseAddrPort(v.Dst)
	// A socket's verdict at connect() comes before the kernel picks its
	// source address: the pod's own address of the family is the one it
	// will pick.
	if v.Direction == tables.DirEgress && src.Addr().IsUnspecified() {
		src = netip.AddrPortFrom(c.podAddr(v.Endpoint, src.Addr()), src.Port())
	} else if v.Direction == tables.DirIngress && dst.Addr().IsUnspecified() {
		dst = netip.AddrPortFrom(c.podAddr(v.Endpoint, dst.Addr()), dst.Port())
	}
	f := &flowpb.Flow{
		Time:     timestamppb.New(t),
		NodeName: c.nodeName,
		Verdict:  verdict(v.Verdict),
		IsReply:  wrapperspb.Bool(false),
	}
	if src.IsValid() && dst.IsValid() {
		f.IP = &flowpb.IP{Source: src.Addr().Unmap().String(), Destination: dst.Addr().Unmap().String(), IpVersion: flowpb.IPVersion_IPv4}
		if src.Addr().Unmap().Is6() {
			f.IP.IpVersion = flowpb.IPVersion_IPv6
		}
	}
	f.L4 = layer4(v.Proto, src.Port(), dst.Port(), f.IP != nil && f.IP.IpVersion == flowpb.IPVersion_IPv6)
	f.TrafficDirection = flowpb.TrafficDirection_INGRESS
	if v.Direction == tables.DirEgress {
		f.TrafficDirection = flowpb.TrafficDirection_EGRESS
	}
	return f, src, dst
}

func (c *converter) policyFlow(v policy.Verdict) *flowpb.Flow {
	f, src, dst := c.base(v, v.Time)
	f.Type = flowpb.FlowType_L3_L4
	local := c.local(v.Endpoint)
	var remote *flowpb.Endpoint
	if v.Direction == tables.DirEgress {
		remote = c.remote(dst.Addr(), v.RemoteIdentity, v.RemoteLabels)
		f.Source, f.Destination = local, remote
	} else {
		remote = c.remote(src.Addr(), v.RemoteIdentity, v.RemoteLabels)
		f.Source, f.Destination = remote, local
	}
	// The Service the flow went to: its frontend (without the socket LB,
	// the address the pod asked for) or one of its backends (with it,
	// the address the frontend was translated to).
	f.DestinationService = c.service(dst, v.Proto)
	f.SourceService = c.service(src, v.Proto)
	// The names DNS gave the addresses (`hubble observe --to-fqdn`).
	f.SourceNames, f.DestinationNames = c.names[src.Addr().Unmap()], c.names[dst.Addr().Unmap()]
	f.EventType = &flowpb.CiliumEventType{Type: eventTypePolicyVerdict}
	if f.Verdict == flowpb.Verdict_DROPPED {
		f.DropReasonDesc = dropReason(v.Reason)
		f.DropReason = uint32(f.DropReasonDesc)
		if v.Layer == policy.LayerInterface {
			// Dropped on the pod's interface: a packet drop, as the
			// reference's datapath reports it.
			f.EventType = &flowpb.CiliumEventType{Type: eventTypeDrop, SubType: int32(f.DropReasonDesc)}
		}
	}
	if v.Policy != "" {
		f.PolicyMatchType = policyMatchL3L4
		p := []*flowpb.Policy{policyRef(v.Policy)}
		switch {
		case v.Direction == tables.DirEgress && f.Verdict == flowpb.Verdict_DROPPED:
			f.EgressDeniedBy = p
		case v.Direction == tables.DirEgress:
			f.EgressAllowedBy = p
		case f.Verdict == flowpb.Verdict_DROPPED:
			f.IngressDeniedBy = p
		default:
			f.IngressAllowedBy = p
		}
	}
	f.Summary = v.Layer + ": " + v.Reason
	return f
}

// xlateFlows returns the socket LB's translation as the reference's
// trace-sock flows: the socket's connect() or sendmsg() to the frontend
// (pre-xlate-fwd, TRACED) and to the backend it was sent to
// (post-xlate-fwd, TRANSLATED). A socket of no pod of the node (a host
// process) has none, as the reference skips what it cannot name.
func (c *converter) xlateFlows(tr socketlb.Translation) []*flowpb.Flow {
	c.refresh()
	row := c.endpointOfCgroup(tr.CgroupID)
	if row == nil || row.HostNetwork {
		return nil
	}
	src := c.podAddr(row.Name, tr.Frontend.Addr())
	if src == tr.Frontend.Addr() {
		// The pod has no address of the frontend's family.
		src = netip.Addr{}
	}
	// Both are of the frontend's Service, which the translation names.
	svc := c.service(tr.Frontend, tr.Proto)
	flow := func(dst netip.AddrPort, point flowpb.SocketTranslationPoint, v flowpb.Verdict) *flowpb.Flow {
		f := &flowpb.Flow{
			Time: timestamppb.New(tr.Time), NodeName: c.nodeName, Verdict: v, Type: flowpb.FlowType_SOCK,
			EventType:      &flowpb.CiliumEventType{Type: eventTypeTraceSock, SubType: int32(point)},
			SockXlatePoint: point, SocketCookie: tr.SockCookie, CgroupId: tr.CgroupID,
			IsReply: wrapperspb.Bool(false), Summary: tr.Proto,
			Source: c.local(row.Name), Destination: c.remote(dst.Addr(), 0, nil),
			DestinationService: svc, DestinationNames: c.names[dst.Addr().Unmap()],
		}
		if src.IsValid() {
			f.IP = &flowpb.IP{Source: src.Unmap().String(), Destination: dst.Addr().Unmap().String(), IpVersion: flowpb.IPVersion_IPv4}
			if dst.Addr().Unmap().Is6() {
				f.IP.IpVersion = flowpb.IPVersion_IPv6
			}
		}
		// The source port is not known at connect(), as in the reference.
		f.L4 = layer4(tr.Proto, 0, dst.Port(), dst.Addr().Unmap().Is6())
		return f
	}
	return []*flowpb.Flow{
		flow(tr.Frontend, flowpb.SocketTranslationPoint_SOCK_XLATE_POINT_PRE_DIRECTION_FWD, flowpb.Verdict_TRACED),
		flow(tr.Backend, flowpb.SocketTranslationPoint_SOCK_XLATE_POINT_POST_DIRECTION_FWD, flowpb.Verdict_TRANSLATED),
	}
}

// endpointOfCgroup returns the endpoint whose cgroup is id or holds it: a
// pod's processes run in its containers' cgroups, the children of the pod's
// (the kubelet's layout), which the endpoints table does not list. Those are
// found by reading the pods' cgroup directories, once per unknown id until
// the endpoints change.
func (c *converter) endpointOfCgroup(id uint64) *tables.Endpoint {
	if ep, ok := c.byCgroup[id]; ok || c.cgroupRoot == "" {
		return ep
	}
	c.byCgroup[id] = nil // a miss is remembered too: host processes
	for _, ep := range c.byName {
		if ep.Cgroup == "" {
			continue
		}
		dir := filepath.Join(c.cgroupRoot, ep.Cgroup)
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range entries {
			if !e.IsDir() {
				continue
			}
			var st unix.Stat_t
			if unix.Stat(filepath.Join(dir, e.Name()), &st) == nil && st.Ino == id {
				c.byCgroup[id] = ep
				return ep
			}
		}
	}
	return nil
}

// dnsFlows returns the query (client to resolver) and, when the proxy let
// it through, the answer (resolver to client) as Hubble's L7 DNS flows.
func (c *converter) dnsFlows(v policy.Verdict) []*flowpb.Flow {
	latency := time.Duration(v.DNS.LatencyMs * float64(time.Millisecond))
	q, src, dst := c.base(v, v.Time.Add(-latency))
	q.Type = flowpb.FlowType_L7
	q.EventType = &flowpb.CiliumEventType{Type: eventTypeAccessLog}
	client := c.local(v.Endpoint)
	if client == nil {
		client = c.remote(src.Addr(), 0, nil)
	}
	resolver := c.remote(dst.Addr(), v.RemoteIdentity, v.RemoteLabels)
	q.Source, q.Destination = client, resolver
	q.DestinationNames = c.names[dst.Addr().Unmap()]
	rec := &flowpb.DNS{Query: v.DNS.Query, Qtypes: []string{v.DNS.QType}, ObservationSource: "proxy"}
	q.L7 = &flowpb.Layer7{Type: flowpb.L7FlowType_REQUEST, Record: &flowpb.Layer7_Dns{Dns: rec}}
	if v.Policy != "" {
		q.EgressAllowedBy = []*flowpb.Policy{policyRef(v.Policy)}
	}
	if q.Verdict == flowpb.Verdict_DROPPED {
		q.DropReasonDesc = flowpb.DropReason_POLICY_DENIED
		q.DropReason = uint32(q.DropReasonDesc)
		q.EgressAllowedBy = nil
	}
	q.Summary = "DNS Query " + v.DNS.Query + " " + v.DNS.QType
	if q.Verdict == flowpb.Verdict_DROPPED {
		return []*flowpb.Flow{q}
	}

	a, _, _ := c.base(v, v.Time)
	a.Type, a.EventType = flowpb.FlowType_L7, q.EventType
	a.IsReply = wrapperspb.Bool(true)
	a.Source, a.Destination = resolver, client
	if a.IP != nil {
		a.IP.Source, a.IP.Destination = a.IP.Destination, a.IP.Source
	}
	a.L4 = layer4(v.Proto, dst.Port(), src.Port(), a.IP != nil && a.IP.IpVersion == flowpb.IPVersion_IPv6)
	a.EgressAllowedBy = q.EgressAllowedBy
	rcode, ok := dns.StringToRcode[v.DNS.RCode]
	if !ok {
		rcode = dns.RcodeServerFailure
	}
	arec := &flowpb.DNS{Query: v.DNS.Query, Qtypes: []string{v.DNS.QType}, Rcode: uint32(rcode),
		Ips: v.DNS.Answers, ObservationSource: "proxy"}
	if len(v.DNS.Answers) > 0 {
		arec.Rrtypes = []string{v.DNS.QType}
	}
	a.L7 = &flowpb.Layer7{Type: flowpb.L7FlowType_RESPONSE, LatencyNs: uint64(latency), Record: &flowpb.Layer7_Dns{Dns: arec}}
	a.SourceNames = q.DestinationNames
	a.Summary = "DNS Answer " + strings.Join(v.DNS.Answers, ",") + " (" + v.DNS.RCode + ")"
	return []*flowpb.Flow{q, a}
}

// service returns the Service whose frontend or backend addr is, nil for
// none.
func (c *converter) service(addr netip.AddrPort, proto string) *flowpb.Service {
	if c.db == nil || c.frontends == nil || c.backends == nil || !addr.IsValid() {
		return nil
	}
	p, err := tables.ParseProto(proto)
	if err != nil {
		return nil
	}
	l4 := tables.L4Addr{Addr: addr.Addr().Unmap(), Port: addr.Port(), Proto: p}
	txn := c.db.ReadTxn()
	if fe, _, ok := c.frontends.Get(txn, tables.FrontendAddressIndex.Query(l4)); ok {
		return &flowpb.Service{Namespace: fe.Service.Namespace, Name: fe.Service.Name}
	}
	if be, _, ok := c.backends.Get(txn, tables.BackendAddressIndex.Query(l4)); ok && len(be.Services) > 0 {
		return &flowpb.Service{Namespace: be.Services[0].Service.Namespace, Name: be.Services[0].Service.Name}
	}
	return nil
}

// podAddr returns the address of the pod named "<namespace>/<pod>" of
// the family of unspec, unspec when it has none.
func (c *converter) podAddr(name string, unspec netip.Addr) netip.Addr {
	if row := c.byName[name]; row != nil {
		for _, ip := range row.IPs {
			if ip.Unmap().Is4() == unspec.Unmap().Is4() {
				return ip
			}
		}
	}
	return unspec
}

// local returns the node's endpoint named "<namespace>/<pod>", nil when
// name is no pod.
func (c *converter) local(name string) *flowpb.Endpoint {
	ns, pod, ok := strings.Cut(name, "/")
	if !ok {
		return nil
	}
	ep := &flowpb.Endpoint{Namespace: ns, PodName: pod}
	if row := c.byName[name]; row != nil {
		ep.Identity, ep.Labels = row.Identity, sortedLabels(row.Labels)
		if w := row.Workload; w != nil {
			ep.Workloads = []*flowpb.Workload{{Kind: w.Kind, Name: w.Name}}
		}
	}
	return ep
}

// remote returns the peer at addr: a pod of this node by its row, a pod
// of another node by its name in the ipcache, anything else by the
// identity the datapath saw.
func (c *converter) remote(addr netip.Addr, id uint32, labels []string) *flowpb.Endpoint {
	if row := c.byIP[addr.Unmap()]; row != nil && addr.IsValid() {
		return c.local(row.Name)
	}
	ep := &flowpb.Endpoint{Identity: id, Labels: sortedLabels(labels)}
	for _, l := range labels {
		if v, ok := strings.CutPrefix(l, namespaceLabel+"="); ok {
			ep.Namespace = v
		}
	}
	if c.ipcache != nil && addr.IsValid() {
		if e, _, ok := c.ipcache.Get(c.db.ReadTxn(), tables.IPCachePrefixIndex.Query(tables.HostPrefix(addr.Unmap()))); ok {
			for _, o := range e.Owners {
				if ns, pod, ok := tables.PodOfOwner(o); ok {
					ep.Namespace, ep.PodName = ns, pod
					if ep.Identity == 0 {
						ep.Identity, ep.Labels = e.Identity, sortedLabels(e.Labels)
					}
					break
				}
			}
		}
	}
	return ep
}

func sortedLabels(l []string) []string {
	if len(l) == 0 {
		return nil
	}
	return append([]string(nil), l...)
}

func verdict(v string) flowpb.Verdict {
	switch v {
	case policy.VerdictAllowed:
		return flowpb.Verdict_FORWARDED
	case policy.VerdictDenied:
		return flowpb.Verdict_DROPPED
	case policy.VerdictAudited:
		return flowpb.Verdict_AUDIT
	}
	return flowpb.Verdict_VERDICT_UNKNOWN
}

// dropReason names the agent's reason for a drop in Hubble's vocabulary.
func dropReason(reason string) flowpb.DropReason {
	switch reason {
	case policy.ReasonSpoofed:
		return flowpb.DropReason_INVALID_SOURCE_IP
	case policy.ReasonUnparsable:
		return flowpb.DropReason_INVALID_PACKET_DROPPED
	case policy.ReasonNotRouter:
		return flowpb.DropReason_FORBIDDEN_ICMPV6_MESSAGE
	case policy.ReasonPolicy:
		// An entry that denies: a deny rule.
		return flowpb.DropReason_POLICY_DENY
	}
	// The default deny, fail closed, unclassified pods, DNS bypass.
	return flowpb.DropReason_POLICY_DENIED
}

// policyRef names the policy "cnp/<ns>/<name>", "ccnp/<name>" or
// "netpol/<ns>/<name>" as Hubble's flows do.
func policyRef(name string) *flowpb.Policy {
	parts := strings.Split(name, "/")
	switch {
	case len(parts) == 3 && parts[0] == "cnp":
		return &flowpb.Policy{Kind: "CiliumNetworkPolicy", Namespace: parts[1], Name: parts[2]}
	case len(parts) == 3 && parts[0] == "netpol":
		return &flowpb.Policy{Kind: "NetworkPolicy", Namespace: parts[1], Name: parts[2]}
	case len(parts) == 2 && parts[0] == "ccnp":
		return &flowpb.Policy{Kind: "CiliumClusterwideNetworkPolicy", Name: parts[1]}
	}
	return &flowpb.Policy{Name: name}
}

func layer4(proto string, sport, dport uint16, v6 bool) *flowpb.Layer4 {
	switch proto {
	case "TCP":
		return &flowpb.Layer4{Protocol: &flowpb.Layer4_TCP{TCP: &flowpb.TCP{SourcePort: uint32(sport), DestinationPort: uint32(dport)}}}
	case "UDP":
		return &flowpb.Layer4{Protocol: &flowpb.Layer4_UDP{UDP: &flowpb.UDP{SourcePort: uint32(sport), DestinationPort: uint32(dport)}}}
	case "SCTP":
		return &flowpb.Layer4{Protocol: &flowpb.Layer4_SCTP{SCTP: &flowpb.SCTP{SourcePort: uint32(sport), DestinationPort: uint32(dport)}}}
	case "ICMP", "proto-58":
		if v6 {
			return &flowpb.Layer4{Protocol: &flowpb.Layer4_ICMPv6{ICMPv6: &flowpb.ICMPv6{}}}
		}
		return &flowpb.Layer4{Protocol: &flowpb.Layer4_ICMPv4{ICMPv4: &flowpb.ICMPv4{}}}
	}
	return nil
}
