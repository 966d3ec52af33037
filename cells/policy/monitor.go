package policy

import (
	"sync"
	"sync/atomic"
	"time"
)

// Verdict is one decision of the policy programs about a new connection or
// flow (type policy), or of the DNS proxy about a query (type dns), as
// `apiary monitor` shows it.
type Verdict struct {
	Time time.Time `json:"time"`
	// Type is VerdictTypePolicy or VerdictTypeDNS.
	Type string `json:"type"`
	// Endpoint is the endpoint's name, "<namespace>/<pod>" (or
	// "endpoint <ID>" for one the agent no longer knows).
	Endpoint string `json:"endpoint"`
	// Direction is "ingress" or "egress".
	Direction string `json:"direction"`
	// Src and Dst are "address:port" (the port 0 when there is none).
	Src string `json:"src"`
	Dst string `json:"dst"`
	// Proto is "TCP", "UDP", "SCTP", "ICMP" or the protocol number.
	Proto string `json:"proto"`
	// RemoteIdentity is the peer's security identity, RemoteLabels its
	// labels.
	RemoteIdentity uint32   `json:"remoteIdentity"`
	RemoteLabels   []string `json:"remoteLabels"`
	// Verdict is "allowed", "denied" or "audited" (denied by policy but let
	// through by audit mode).
	Verdict string `json:"verdict"`
	// Policy is the policy whose entry decided, empty when none did.
	Policy string `json:"policy"`
	// Reason is "policy" (an entry decided), "default deny", "fail closed"
	// (the default deny an invalid policy keeps, which Policy names: see
	// --policy-invalid-mode) or "no policy" (the endpoint is not enforced in
	// that direction), "unclassified pod", "spoofed source" (a pod's
	// packet from an address not its own), "dns bypass" (a packet to port
	// 53 of a pod with DNS rules that did not go to the DNS proxy),
	// "unparsable" (headers that could not be read to the ports) or "not a
	// router" (a router's ICMPv6 from a pod).
	Reason string `json:"reason"`
	// Layer is where it was decided: "socket" (connect, sendmsg, the
	// socket's packets) or "interface" (the host side of the pod's
	// interface, which reports only drops).
	Layer string `json:"layer"`
	// DNS is the query and its answer, for type dns. Src is then the
	// client, Dst the resolver it asked (the proxy's upstream for a query
	// sent to the proxy directly), Policy the one whose DNS rule allowed
	// the name.
	DNS *DNSVerdict `json:"dns,omitempty"`
}

// DNSVerdict is what a verdict of type dns says of the query.
type DNSVerdict struct {
	// Query is the name asked ("www.example.com."), QType its type ("A").
	Query string `json:"query"`
	QType string `json:"qtype"`
	// Answers are the addresses the answer gave the name.
	Answers []string `json:"answers"`
	// Unlabelled says why the answer's addresses were not labelled for
	// every pod's FQDN selectors ("untrusted resolver: for this endpoint
	// only": a resolver the node does not trust answered, and only the
	// endpoint that asked may reach them; "pod address limit": past
	// --tofqdns-max-ips-per-pod; see docs/fqdn.md); absent when they were.
	Unlabelled string `json:"unlabelled,omitempty"`
	// RCode is the answer's response code (NOERROR, NXDOMAIN, REFUSED, …).
	RCode string `json:"rcode"`
	// LatencyMs is the time from the query to its answer, the hold until
	// policy allows the answer's addresses included, in milliseconds.
	LatencyMs float64 `json:"latencyMs"`
}

// Types of verdicts.
const (
	VerdictTypePolicy = "policy"
	VerdictTypeDNS    = "dns"
)

// Verdicts and reasons as Verdict spells them.
const (
	VerdictAllowed = "allowed"
	VerdictDenied  = "denied"
	VerdictAudited = "audited"

	ReasonPolicy      = "policy"
	ReasonDefaultDeny = "default deny"
	ReasonFailClosed  = "fail closed"
	ReasonNoPolicy    = "no policy"
	// ReasonUnclassified: a process of a pod cgroup under the kubelet's
	// tree that the agent has not registered (yet); see
	// --unclassified-pods.
	ReasonUnclassified = "unclassified pod"
	// ReasonSpoofed: a packet from a pod whose source is not one of the
	// pod's addresses, dropped on its interface.
	ReasonSpoofed = "spoofed source"
	// ReasonUnparsable: a packet whose headers could not be read to its
	// ports (more IPv6 extension headers than the programs walk, a
	// header cut short), dropped.
	ReasonUnparsable = "unparsable"
	// ReasonNotRouter: a router advertisement or redirect from a pod,
	// dropped: pods are not routers.
	ReasonNotRouter = "not a router"

	LayerSocket    = "socket"
	LayerInterface = "interface"
	// ReasonDNSProxy: DNS of an endpoint with a DNS rule that cannot go
	// to the DNS proxy (--dns-intercept=false, no --dns-proxy-addr, or no
	// proxy address of the socket's family), denied.
	ReasonDNSProxy = "dns proxy unavailable"
	// ReasonDNSBypass: a packet to port 53 of an endpoint with a DNS rule
	// that did not go to the DNS proxy (a raw or packet socket, a socket
	// connected to the resolver before the rule), dropped.
	ReasonDNSBypass = "dns bypass"
	// ReasonDNSRule: a DNS rule of the endpoint allows the query's name.
	ReasonDNSRule = "dns rule"
	// ReasonNoDNSRule: no DNS rule of the endpoint allows the name.
	ReasonNoDNSRule = "no dns rule"
	// ReasonNotIntercepted: a query sent to the DNS proxy by a process
	// of no endpoint with DNS rules; no rule applies.
	ReasonNotIntercepted = "not intercepted"
)

// Monitor hands the datapath's verdicts to subscribers (the API's
// streams). Publishing never blocks: a subscriber that does not keep up
// loses verdicts, counted for it, and slows no one.
type Monitor struct {
	mu   sync.Mutex
	subs map[*subscription]struct{}
	// lost counts the events the datapath could not hand over (a full ring
	// buffer), as read from policy_stats.
	lost atomic.Uint64
}

type subscription struct {
	ch      chan Verdict
	dropped atomic.Uint64
}

// NewMonitor returns a monitor without subscribers.
func NewMonitor() *Monitor {
	return &Monitor{subs: map[*subscription]struct{}{}}
}

// Subscribe returns a channel of the verdicts published from now on,
// buffered for buffer of them; dropped says how many did not fit. cancel
// ends the subscription and closes the channel.
func (m *Monitor) Subscribe(buffer int) (ch <-chan Verdict, dropped func() uint64, cancel func()) {
	s := &subscription{ch: make(chan Verdict, max(buffer, 1))}
	m.mu.Lock()
	m.subs[s] = struct{}{}
	m.mu.Unlock()
	var once sync.Once
	return s.ch, s.dropped.Load, func() {
		once.Do(func() {
			m.mu.Lock()
			delete(m.subs, s)
			m.mu.Unlock()
			close(s.ch)
		})
	}
}

// Publish hands v to every subscriber that has room for it.
func (m *Monitor) Publish(v Verdict) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for s := range m.subs {
		select {
		case s.ch <- v:
		default:
			s.dropped.Add(1)
		}
	}
}

// Lost returns how many events the datapath could not hand over since
// the programs' counters were created.
func (m *Monitor) Lost() uint64 { return m.lost.Load() }

// Subscribers returns how many subscriptions are open.
func (m *Monitor) Subscribers() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.subs)
}
