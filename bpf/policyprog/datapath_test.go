package policyprog

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// Peers of the tests, on loopback (127.0.0.0/8 is local): their identities
// and servers.
const (
	peerA     = "127.0.77.11" // identity 1000
	peerB     = "127.0.77.12" // identity 1001
	peerC     = "127.0.77.13" // identity 1002
	peerD     = "127.0.77.14" // identity 1003
	peerWorld = "127.0.77.15" // not in the ipcache: reserved:world
	// Ingress clients, and the address the pod serves on.
	clientAllowed = "127.0.77.21" // identity 2001
	clientDenied  = "127.0.77.22" // identity 2002
	podAddr       = "127.0.77.30"
)

const (
	tcp  = unix.IPPROTO_TCP
	udp  = unix.IPPROTO_UDP
	icmp = unix.IPPROTO_ICMP
)

func (d *datapath) peers() {
	d.identity(peerA, 1000)
	d.identity(peerB, 1001)
	d.identity(peerC, 1002)
	d.identity(peerD, 1003)
	d.identity(clientAllowed, 2001)
	d.identity(clientDenied, 2002)
}

// TestEgress runs connections, datagrams and pings from a process in the
// pod against its egress policy: connect() and sendmsg() that the policy
// denies fail with EPERM, other packets are dropped; the replies of what
// it allows come back, also through an ingress default deny. Each
// decision is one event, with the cookie of the entry that took it; the
// packets of a flow, and the replies, are none: each case's event is the
// next one read.
func TestEgress(t *testing.T) {
	testenv.RequireRoot(t)
	servers(t,
		[2]string{"tcp", peerA + ":8080"}, [2]string{"tcp", peerA + ":8081"}, [2]string{"tcp", peerA + ":7070"},
		[2]string{"udp", peerA + ":5353"}, [2]string{"udp", peerA + ":5354"},
		[2]string{"tcp", peerB + ":8080"}, [2]string{"tcp", peerB + ":8081"},
		[2]string{"tcp", peerC + ":8080"}, [2]string{"tcp", peerC + ":9090"},
		[2]string{"tcp", peerD + ":8079"}, [2]string{"tcp", peerD + ":8095"}, [2]string{"tcp", peerD + ":8096"},
		[2]string{"tcp", peerD + ":9090"},
		[2]string{"tcp", peerWorld + ":8080"},
	)
	eg := bpf.PolicyEgress
	rules := []rule{
		{identity: 1000, dir: eg, proto: tcp, port: 8080, portBits: 16, cookie: 11},
		{identity: 1000, dir: eg, proto: udp, port: 5353, portBits: 16, cookie: 12},
		{identity: 1000, dir: eg, proto: icmp, cookie: 13},
		// Every port and protocol, but one.
		{identity: 1001, dir: eg, cookie: 14},
		{identity: 1001, dir: eg, proto: tcp, port: 8081, portBits: 16, deny: true, cookie: 15},
		// Any peer; D also has its own entry, which decides.
		{identity: 0, dir: eg, proto: tcp, port: 9090, portBits: 16, cookie: 16},
		{identity: 1003, dir: eg, proto: tcp, port: 9090, portBits: 16, cookie: 21},
		// 8080-8095.
		{identity: 1003, dir: eg, proto: tcp, port: 8080, portBits: 12, cookie: 17},
		// Allowed for A, denied for any peer: the deny wins.
		{identity: 1000, dir: eg, proto: tcp, port: 7070, portBits: 16, cookie: 18},
		{identity: 0, dir: eg, proto: tcp, port: 7070, portBits: 16, deny: true, cookie: 19},
		{identity: 2, dir: eg, proto: tcp, port: 8080, portBits: 16, cookie: 20},
	}
	const (
		entry = bpf.PolicyReasonEntry
		dflt  = bpf.PolicyReasonDefaultDeny
	)
	cases := []struct {
		name, kind, dst, src, want string
		// The event: the peer's identity, why, and the entry's cookie.
		identity uint32
		reason   uint8
		cookie   uint32
	}{
		{"identity and port allowed", "tcp", peerA + ":8080", "", "ok", 1000, entry, 11},
		{"from a bound address", "tcp", peerA + ":8080", podAddr, "ok", 1000, entry, 11},
		{"another port", "tcp", peerA + ":8081", "", "EPERM", 1000, dflt, 0},
		{"another peer", "tcp", peerC + ":8080", "", "EPERM", 1002, dflt, 0},
		{"any port of the peer", "tcp", peerB + ":8080", "", "ok", 1001, entry, 14},
		{"deny of a port beats the peer's allow", "tcp", peerB + ":8081", "", "EPERM", 1001, entry, 15},
		{"any peer", "tcp", peerC + ":9090", "", "ok", 1002, entry, 16},
		{"the peer's own entry before any peer's", "tcp", peerD + ":9090", "", "ok", 1003, entry, 21},
		{"deny for any peer beats the peer's allow", "tcp", peerA + ":7070", "", "EPERM", 1000, entry, 19},
		{"port range, first below", "tcp", peerD + ":8079", "", "EPERM", 1003, dflt, 0},
		{"port range, last inside", "tcp", peerD + ":8095", "", "ok", 1003, entry, 17},
		{"port range, first above", "tcp", peerD + ":8096", "", "EPERM", 1003, dflt, 0},
		{"not in the ipcache is world", "tcp", peerWorld + ":8080", "", "ok", 2, entry, 20},
		{"UDP sendmsg allowed", "udp", peerA + ":5353", "", "ok", 1000, entry, 12},
		{"UDP sendmsg, twice on one socket", "udp2", peerA + ":5353", "", "ok", 1000, entry, 12},
		{"UDP sendmsg from a bound address", "udp", peerA + ":5353", podAddr, "ok", 1000, entry, 12},
		{"UDP sendmsg asking for a source", "udpsrc", peerA + ":5353", podAddr, "ok", 1000, entry, 12},
		{"UDP sendmsg to another port", "udp", peerA + ":5354", "", "EPERM", 1000, dflt, 0},
		{"UDP connect allowed", "udpc", peerA + ":5353", "", "ok", 1000, entry, 12},
		{"UDP connect to another port", "udpc", peerA + ":5354", "", "EPERM", 1000, dflt, 0},
		{"ICMP allowed", "icmp", peerA, "", "ok", 1000, entry, 13},
		{"ICMP denied", "icmp", peerC, "", "EPERM", 1002, dflt, 0},
	}
	for _, mode := range []struct {
		name  string
		flags uint32
	}{
		{"egress", bpf.PolicyEnforceEgress},
		// Nothing is allowed in: every packet coming in is a reply.
		{"ingress+egress", bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress},
	} {
		t.Run(mode.name, func(t *testing.T) {
			d := newDatapath(t)
			d.peers()
			d.rules(rules...)
			d.endpoint(mode.flags)
			c := startChild(t, d.app)

			var allowed, denied uint64
			for _, tc := range cases {
				cmd := []string{"local", tc.kind, tc.dst}
				if tc.src != "" {
					cmd = append(cmd, tc.src)
				}
				got, local, _ := strings.Cut(c.do(cmd...), " ")
				if got != tc.want {
					t.Errorf("%s: %s %s: %s, want %s", tc.name, tc.kind, tc.dst, got, tc.want)
				}
				want := event{
					hook: bpf.PolicyHookConnect4, remote: tc.dst, identity: tc.identity,
					reason: tc.reason, cookie: tc.cookie, verdict: bpf.PolicyVerdictAllowed,
				}
				if tc.want == "ok" {
					allowed++
				} else {
					denied++
					want.verdict = bpf.PolicyVerdictDenied
				}
				switch tc.kind {
				case "tcp", "udpc":
					want.proto = map[string]uint8{"tcp": tcp, "udpc": udp}[tc.kind]
					// connect4 runs before an unbound socket gets
					// its address and port.
					if tc.src != "" {
						want.local = local
					}
				case "udp", "udp2":
					// The socket is bound (to 0.0.0.0 without src)
					// before it sends.
					want.hook, want.proto, want.local = bpf.PolicyHookSendmsg4, udp, local
				case "udpsrc":
					// Bound to 0.0.0.0, sending from src.
					port := netip.MustParseAddrPort(local).Port()
					want.hook, want.proto = bpf.PolicyHookSendmsg4, udp
					want.local = netip.AddrPortFrom(netip.MustParseAddr(tc.src), port).String()
				case "icmp":
					// Judged by its packet, from the loopback
					// route's source.
					want.hook, want.proto, want.local = bpf.PolicyHookEgress, icmp, "127.0.0.1"
				}
				d.expectEvents(tc.name, want.policyEvent())
				// On loopback, the raw socket of an allowed ping
				// also receives its own request, which an enforced
				// ingress judges (and denies: its source,
				// 127.0.0.1, is world) before the reply comes.
				if tc.kind == "icmp" && tc.want == "ok" && mode.flags&bpf.PolicyEnforceIngress != 0 {
					d.expectEvents(tc.name+": the request's copy", event{
						hook: bpf.PolicyHookIngress, local: tc.dst, remote: "127.0.0.1", proto: icmp,
						identity: 2, verdict: bpf.PolicyVerdictDenied, reason: dflt,
					}.policyEvent())
				}
			}
			d.noEvents("after the last case")
			// One decision per connect(), sendmsg() or ping: the
			// packets that follow are the flow's.
			s := d.stats()
			if got := stat(s, bpf.PolicyEgress, bpf.PolicyVerdictAllowed); got != allowed {
				t.Errorf("egress allowed %d times, want %d", got, allowed)
			}
			if got := stat(s, bpf.PolicyEgress, bpf.PolicyVerdictDenied); got != denied {
				t.Errorf("egress denied %d times, want %d", got, denied)
			}
			if mode.flags&bpf.PolicyEnforceIngress == 0 {
				if s[bpf.PolicyVerdictAllowed]+s[bpf.PolicyVerdictDenied] != 0 {
					t.Errorf("ingress is not enforced, yet has verdicts: %v", s)
				}
			}

		})
	}
}

// TestIngress connects from the test process (in no endpoint) to servers
// in the pod, whose ingress policy allows one client address and not the
// other, and whose egress is a default deny: the SYN-ACK leaves on the
// listener, the rest of the server's packets as the accepted connection's
// flow, the UDP answers as the flow ingress remembered. With only egress
// enforced, every client gets its answers.
//
// Each connection or flow let in is one event, its first packet's (not
// the handshake's last ACK, which is judged again on the listener, nor
// anything after); each denied packet is one. Without ingress enforced,
// ingress reports nothing.
func TestIngress(t *testing.T) {
	for _, mode := range []struct {
		name  string
		flags uint32
	}{
		{"ingress+egress", bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress},
		{"egress", bpf.PolicyEnforceEgress},
	} {
		t.Run(mode.name, func(t *testing.T) {
			testIngress(t, mode.flags)
		})
	}
}

func testIngress(t *testing.T, flags uint32) {
	d := newDatapath(t)
	d.peers()
	in := bpf.PolicyIngress
	d.rules(
		rule{identity: 2001, dir: in, proto: tcp, port: 8080, portBits: 16, cookie: 31},
		rule{identity: 2001, dir: in, proto: udp, port: 5353, portBits: 16, cookie: 32},
	)
	d.endpoint(flags)
	c := startChild(t, d.app)
	for _, s := range []string{"tcp " + podAddr + ":8080", "tcp " + podAddr + ":8081", "udp " + podAddr + ":5353"} {
		proto, addr, _ := strings.Cut(s, " ")
		if got := c.do("serve", proto, addr); got != "ok "+addr {
			t.Fatalf("serve %s in the pod: %s", s, got)
		}
	}
	// A dual-stack listener (IPv6 wildcard), as Go, Java or nginx open
	// them: its IPv4 connections are AF_INET6 sockets.
	got := c.do("serve", "tcp", ":0")
	dual, err := netip.ParseAddrPort(strings.TrimPrefix(got, "ok "))
	if err != nil || !dual.Addr().Is6() {
		t.Fatalf("serve a dual-stack listener in the pod: %s", got)
	}
	d.rules(rule{identity: 2001, dir: in, proto: tcp, port: dual.Port(), portBits: 16, cookie: 33})
	dualAddr := netip.AddrPortFrom(netip.MustParseAddr(podAddr), dual.Port()).String()

	ingress := flags&bpf.PolicyEnforceIngress != 0
	denied := "ok"
	if ingress {
		denied = "timeout"
	}
	var tcpClient, udpClient, dualClient netip.AddrPort
	for _, tc := range []struct {
		name, kind, dst, src, want string
		local                      *netip.AddrPort
		// The event with ingress enforced: the client's identity,
		// and the entry's cookie (0: default deny).
		identity, cookie uint32
	}{
		{"TCP from an allowed peer", "tcp", podAddr + ":8080", clientAllowed, "ok", &tcpClient, 2001, 31},
		{"TCP from another peer", "tcp", podAddr + ":8080", freePort(t, clientDenied), denied, nil, 2002, 0},
		{"TCP to another port", "tcp", podAddr + ":8081", freePort(t, clientAllowed), denied, nil, 2001, 0},
		{"TCP to a dual-stack listener", "tcp", dualAddr, clientAllowed, "ok", &dualClient, 2001, 33},
		{"TCP to a dual-stack listener from another peer", "tcp", dualAddr, freePort(t, clientDenied), denied, nil, 2002, 0},
		{"UDP from an allowed peer", "udp", podAddr + ":5353", clientAllowed, "ok", &udpClient, 2001, 32},
		{"UDP from another peer", "udp", podAddr + ":5353", clientDenied, denied, nil, 2002, 0},
		// A second datagram of the socket is the flow's.
		{"UDP twice from an allowed peer", "udp2", podAddr + ":5353", clientAllowed, "ok", nil, 2001, 32},
	} {
		local, err := exchange(tc.kind, tc.dst, tc.src)
		if got := outcome(err); got != tc.want {
			t.Errorf("%s: %s %s from %s: %s, want %s", tc.name, tc.kind, tc.dst, tc.src, got, tc.want)
		}
		if tc.local != nil {
			*tc.local = local
		}
		if !ingress {
			continue
		}
		want := event{
			hook: bpf.PolicyHookIngress, local: tc.dst, remote: local.String(), proto: tcp,
			identity: tc.identity, cookie: tc.cookie,
			verdict: bpf.PolicyVerdictAllowed, reason: bpf.PolicyReasonEntry,
		}
		if tc.kind != "tcp" {
			want.proto = udp
		}
		if tc.cookie == 0 {
			want.verdict, want.reason = bpf.PolicyVerdictDenied, bpf.PolicyReasonDefaultDeny
		}
		d.expectEvents(tc.name, want.policyEvent())
	}
	d.noEvents("after the last connection")

	// sockops remembered the accepted connections with the client's port
	// (read from the upper half of remote_port), ingress the datagram's
	// peer: that is how the server's answers got out, unjudged (below).
	s := d.stats()
	if got := stat(s, bpf.PolicyEgress, bpf.PolicyVerdictDenied); got != 0 {
		t.Errorf("egress denied %d packets: a SYN-ACK or a reply was judged by policy", got)
	}
	allowed, denials := stat(s, bpf.PolicyIngress, bpf.PolicyVerdictAllowed), stat(s, bpf.PolicyIngress, bpf.PolicyVerdictDenied)
	switch {
	case ingress && (allowed == 0 || denials == 0):
		t.Errorf("ingress allowed %d packets, denied %d: want both", allowed, denials)
	case !ingress && allowed+denials != 0:
		t.Errorf("ingress is not enforced, yet allowed %d packets and denied %d", allowed, denials)
	}
}

// TestAudit: what an audit denies nothing of passes, counted and reported
// as audited: everything with the endpoint's audit flag; what a deny entry
// with the audit flag matches, unless another deny entry does; what the
// default deny of a direction would deny, with that direction's
// audit-default flag, which leaves deny entries and the other direction
// enforced.
func TestAudit(t *testing.T) {
	servers(t, [2]string{"tcp", peerC + ":8080"})
	const (
		both  = bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress
		entry = bpf.PolicyReasonEntry
		dflt  = bpf.PolicyReasonDefaultDeny
	)
	eg, in := bpf.PolicyEgress, bpf.PolicyIngress
	// Entries of peer C (1002) at TCP 8080: its own, and any peer's.
	own := rule{identity: 1002, dir: eg, proto: tcp, port: 8080, portBits: 16}
	anyPeer := rule{identity: 0, dir: eg, proto: tcp, port: 8080, portBits: 16}
	with := func(r rule, cookie uint32, deny, audit bool) rule {
		r.cookie, r.deny, r.audit = cookie, deny, audit
		return r
	}
	for _, tc := range []struct {
		name  string
		flags uint32
		rules []rule
		// in: a connection from clientDenied into the pod; else a
		// connect() from the pod to C.
		in      bool
		want    string
		verdict uint8
		reason  uint8
		cookie  uint32
	}{
		{"endpoint audit, default deny", both | bpf.PolicyAudit, nil,
			false, "ok", bpf.PolicyVerdictAudited, dflt, 0},
		{"endpoint audit, deny entry", both | bpf.PolicyAudit, []rule{with(own, 41, true, false)},
			false, "ok", bpf.PolicyVerdictAudited, entry, 41},
		{"endpoint audit, ingress default deny", both | bpf.PolicyAudit, nil,
			true, "ok", bpf.PolicyVerdictAudited, dflt, 0},
		{"audited deny entry", both, []rule{with(own, 42, true, true)},
			false, "ok", bpf.PolicyVerdictAudited, entry, 42},
		{"audited deny entry of any peer beats the peer's allow", both,
			[]rule{with(own, 43, false, false), with(anyPeer, 44, true, true)},
			false, "ok", bpf.PolicyVerdictAudited, entry, 44},
		{"deny entry of any peer beats the peer's audited one", both,
			[]rule{with(own, 45, true, true), with(anyPeer, 46, true, false)},
			false, "EPERM", bpf.PolicyVerdictDenied, entry, 46},
		{"the peer's deny entry beats an audited one of any peer", both,
			[]rule{with(own, 47, true, false), with(anyPeer, 48, true, true)},
			false, "EPERM", bpf.PolicyVerdictDenied, entry, 47},
		{"audited egress default deny", both | bpf.PolicyAuditDefaultEgress, nil,
			false, "ok", bpf.PolicyVerdictAudited, dflt, 0},
		{"audited egress default deny, deny entry", both | bpf.PolicyAuditDefaultEgress, []rule{with(own, 49, true, false)},
			false, "EPERM", bpf.PolicyVerdictDenied, entry, 49},
		{"audited egress default deny, ingress", both | bpf.PolicyAuditDefaultEgress, nil,
			true, "timeout", bpf.PolicyVerdictDenied, dflt, 0},
		{"audited ingress default deny", both | bpf.PolicyAuditDefaultIngress, nil,
			true, "ok", bpf.PolicyVerdictAudited, dflt, 0},
		{"audited ingress default deny, egress", both | bpf.PolicyAuditDefaultIngress, nil,
			false, "EPERM", bpf.PolicyVerdictDenied, dflt, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newDatapath(t)
			d.peers()
			d.rules(tc.rules...)
			d.endpoint(tc.flags)
			c := startChild(t, d.app)
			want := event{identity: 1002, verdict: tc.verdict, reason: tc.reason, cookie: tc.cookie, proto: tcp}
			dir := eg
			if tc.in {
				dir = in
				if got := c.do("serve", "tcp", podAddr+":8080"); got != "ok "+podAddr+":8080" {
					t.Fatalf("serve in the pod: %s", got)
				}
				src := freePort(t, clientDenied)
				if _, err := exchange("tcp", podAddr+":8080", src); outcome(err) != tc.want {
					t.Errorf("connection into the pod: %s, want %s", outcome(err), tc.want)
				}
				want.hook, want.local, want.remote, want.identity = bpf.PolicyHookIngress, podAddr+":8080", src, 2002
			} else {
				if got := c.do("tcp", peerC+":8080"); got != tc.want {
					t.Errorf("connect: %s, want %s", got, tc.want)
				}
				want.hook, want.remote = bpf.PolicyHookConnect4, peerC+":8080"
			}
			d.expectEvents(tc.name, want.policyEvent())
			d.noEvents("after the connection")

			// Counted as reported: the handshake's last ACK is judged
			// (and counted) again on ingress.
			s := d.stats()
			for v := range bpf.PolicyVerdicts {
				got := stat(s, dir, v)
				switch {
				case v == int(tc.verdict) && (got == 1 || tc.in && got == 2):
				case v != int(tc.verdict) && got == 0:
				default:
					t.Errorf("direction %d counts %d of verdict %d; stats %v", dir, got, v, s)
				}
			}
		})
	}
}

// TestTiers: the entries ClusterNetworkPolicy tiers make. A final entry of
// the peer's identity decides alone, whatever identity 0's says; a pass
// entry counts as none (identity 0, then the default deny decide), and a
// default deny after it reports its cookie.
func TestTiers(t *testing.T) {
	servers(t, [2]string{"tcp", peerC + ":8080"})
	const (
		both  = bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress
		entry = bpf.PolicyReasonEntry
		dflt  = bpf.PolicyReasonDefaultDeny
	)
	own := rule{identity: 1002, dir: bpf.PolicyEgress, proto: tcp, port: 8080, portBits: 16}
	anyPeer := rule{identity: 0, dir: bpf.PolicyEgress}
	with := func(r rule, cookie uint32, deny, final, pass bool) rule {
		r.cookie, r.deny, r.final, r.pass = cookie, deny, final, pass
		return r
	}
	for _, tc := range []struct {
		name    string
		rules   []rule
		want    string
		verdict uint8
		reason  uint8
		cookie  uint32
	}{
		{"final allow beats any peer's deny", []rule{with(own, 61, false, true, false), with(anyPeer, 62, true, false, false)},
			"ok", bpf.PolicyVerdictAllowed, entry, 61},
		{"final deny beats any peer's allow", []rule{with(own, 63, true, true, false), with(anyPeer, 64, false, false, false)},
			"EPERM", bpf.PolicyVerdictDenied, entry, 63},
		{"final audited deny", []rule{{identity: 1002, dir: bpf.PolicyEgress, proto: tcp, port: 8080, portBits: 16, deny: true, audit: true, final: true, cookie: 65}},
			"ok", bpf.PolicyVerdictAudited, entry, 65},
		{"pass, any peer's allow", []rule{with(own, 66, false, false, true), with(anyPeer, 67, false, false, false)},
			"ok", bpf.PolicyVerdictAllowed, entry, 67},
		{"pass, any peer's deny", []rule{with(own, 68, false, false, true), with(anyPeer, 69, true, false, false)},
			"EPERM", bpf.PolicyVerdictDenied, entry, 69},
		{"pass, then the default deny names the pass", []rule{with(own, 70, false, false, true)},
			"EPERM", bpf.PolicyVerdictDenied, dflt, 70},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newDatapath(t)
			d.peers()
			d.rules(tc.rules...)
			d.endpoint(both)
			c := startChild(t, d.app)
			if got := c.do("tcp", peerC+":8080"); got != tc.want && !(tc.want == "ok" && strings.HasPrefix(got, "ok")) {
				t.Errorf("connect: %s, want %s", got, tc.want)
			}
			want := event{identity: 1002, verdict: tc.verdict, reason: tc.reason, cookie: tc.cookie, proto: tcp,
				hook: bpf.PolicyHookConnect4, remote: peerC + ":8080"}
			if tc.verdict != bpf.PolicyVerdictAllowed {
				d.expectEvents(tc.name, want.policyEvent())
			}
		})
	}
}

// TestNoPolicy: a direction that the endpoint does not enforce is
// reported as allowed with reason "no policy": each connect(), each
// sendmsg() flow once (sendmsg4 remembers it); cgroup_skb reports nothing
// of a direction it does not enforce.
func TestNoPolicy(t *testing.T) {
	servers(t, [2]string{"tcp", peerC + ":8080"}, [2]string{"udp", peerC + ":5353"}, [2]string{"tcp", peerC + ":9090"})
	np := func(hook uint8, local, remote string, proto uint8) bpf.PolicyEvent {
		return event{
			hook: hook, local: local, remote: remote, proto: proto, identity: 1002,
			verdict: bpf.PolicyVerdictAllowed, reason: bpf.PolicyReasonNoPolicy,
		}.policyEvent()
	}
	for _, mode := range []struct {
		name  string
		flags uint32
	}{
		{"nothing enforced", 0},
		// The replies of every flow need it to pass ingress.
		{"ingress", bpf.PolicyEnforceIngress},
	} {
		t.Run(mode.name, func(t *testing.T) {
			d := newDatapath(t)
			d.peers()
			d.endpoint(mode.flags)
			c := startChild(t, d.app)
			for i := range 2 {
				if got := c.do("tcp", peerC+":8080"); got != "ok" {
					t.Errorf("connect %d: %s, want ok", i+1, got)
				}
				d.expectEvents(fmt.Sprintf("connect %d", i+1), np(bpf.PolicyHookConnect4, "", peerC+":8080", tcp))
			}
			got, local, _ := strings.Cut(c.do("local", "udp2", peerC+":5353"), " ")
			if got != "ok" {
				t.Errorf("two datagrams: %s, want ok", got)
			}
			d.expectEvents("two datagrams", np(bpf.PolicyHookSendmsg4, local, peerC+":5353", udp))
			if got := c.do("udpc", peerC+":5353"); got != "ok" {
				t.Errorf("UDP connect: %s, want ok", got)
			}
			d.expectEvents("UDP connect", np(bpf.PolicyHookConnect4, "", peerC+":5353", udp))

			if mode.flags == 0 {
				// A ping (cgroup_skb/egress) and a connection
				// into the pod (cgroup_skb/ingress).
				if got := c.do("icmp", peerC); got != "ok" {
					t.Errorf("ping: %s, want ok", got)
				}
				if got := c.do("serve", "tcp", podAddr+":8080"); got != "ok "+podAddr+":8080" {
					t.Fatalf("serve in the pod: %s", got)
				}
				if _, err := exchange("tcp", podAddr+":8080", clientDenied); err != nil {
					t.Errorf("connection into the pod: %s", outcome(err))
				}
			}
			// The next decision is the next event: nothing came
			// between.
			if got := c.do("tcp", peerC+":9090"); got != "ok" {
				t.Errorf("connect: %s, want ok", got)
			}
			d.expectEvents("the last connect", np(bpf.PolicyHookConnect4, "", peerC+":9090", tcp))
			d.noEvents("after the last connect")
			if s := d.stats(); s != [bpf.PolicyStatsEntries]uint64{} {
				t.Errorf("decisions of no policy are not counted: stats %v", s)
			}
		})
	}
}

// TestEventsLost: when policy_events is full (nobody reads it), the
// programs go on deciding and count each event that finds no room as
// lost.
func TestEventsLost(t *testing.T) {
	servers(t, [2]string{"tcp", peerC + ":8080"})
	d := newDatapathEvents(t, 4096) // room for 85 events (48 bytes each)
	d.peers()
	d.rules(rule{identity: 1002, dir: bpf.PolicyEgress, proto: tcp, port: 8080, portBits: 16})
	d.endpoint(bpf.PolicyEnforceEgress)
	c := startChild(t, d.app)
	const connects = 200
	for i := range connects {
		if got := c.do("tcp", peerC+":8080"); got != "ok" {
			t.Fatalf("connect %d: %s, want ok", i+1, got)
		}
	}
	lost := d.lost()
	if lost == 0 || lost >= connects {
		t.Errorf("%d of %d events lost, want some", lost, connects)
	}
	s := d.stats()
	if got := stat(s, bpf.PolicyEgress, bpf.PolicyVerdictAllowed); got != connects {
		t.Errorf("%d connects allowed, want %d", got, connects)
	}
	// Every decision is either in the ring or lost.
	var kept uint64
	for d.reader().AvailableBytes() > 0 {
		if e := d.nextEvent(); e.Verdict != bpf.PolicyVerdictAllowed || e.Hook != bpf.PolicyHookConnect4 {
			t.Errorf("event %s, want an allowed connect", fmtEvent(e))
		}
		kept++
	}
	if kept+lost != connects {
		t.Errorf("%d events kept and %d lost, want %d in all", kept, lost, connects)
	}
	// With room again, events are kept again.
	if got := c.do("tcp", peerC+":8080"); got != "ok" {
		t.Errorf("connect: %s, want ok", got)
	}
	d.expectEvents("connect after draining", event{
		hook: bpf.PolicyHookConnect4, remote: peerC + ":8080", proto: tcp, identity: 1002,
		verdict: bpf.PolicyVerdictAllowed, reason: bpf.PolicyReasonEntry, cookie: 1,
	}.policyEvent())
	if got := d.lost(); got != lost {
		t.Errorf("%d events lost after draining, want still %d", got, lost)
	}
}

// TestOutside: processes in the cgroup the programs are attached to but in
// no endpoint are untouched; processes in the pod's cgroup itself are the
// endpoint as much as those below it.
func TestOutside(t *testing.T) {
	servers(t, [2]string{"tcp", peerC + ":8080"}, [2]string{"udp", peerC + ":5353"})
	d := newDatapath(t)
	d.peers()
	// Everything denied both ways.
	d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)

	for _, tc := range []struct {
		name, cgroup, want string
	}{
		{"attached cgroup", d.root, "ok"},
		{"sibling of the pod", d.other, "ok"},
		{"pod", d.pod, "EPERM"},
		{"below the pod", d.app, "EPERM"},
	} {
		c := startChild(t, tc.cgroup)
		for _, kind := range []string{"tcp", "udp"} {
			addr := peerC + ":8080"
			if kind == "udp" {
				addr = peerC + ":5353"
			}
			if got := c.do(kind, addr); got != tc.want {
				t.Errorf("%s: %s %s: %s, want %s", tc.name, kind, addr, got, tc.want)
			}
		}
	}
	s := d.stats()
	if got := stat(s, bpf.PolicyEgress, bpf.PolicyVerdictDenied); got != 4 {
		t.Errorf("egress denied %d times, want 4 (the pod's); stats %v", got, s)
	}
}

// TestSharedSet: an endpoint's reference entry sends a lookup its own
// entries leave at default deny to its policy set's entry of the peer's
// identity, which allows; the endpoint's own denies (of the peer or of any
// peer) still win, its own allows decide first, a deny entry in a set
// allows nothing, and a final entry of its own decides alone.
func TestSharedSet(t *testing.T) {
	servers(t, [2]string{"tcp", peerC + ":8080"})
	const (
		both  = bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress
		set   = 77
		entry = bpf.PolicyReasonEntry
		dflt  = bpf.PolicyReasonDefaultDeny
	)
	ref := rule{identity: bpf.PolicySetRef, dir: bpf.PolicyEgress, cookie: set}
	shared := rule{endpoint: set, identity: 1002, dir: bpf.PolicyEgress, proto: tcp, port: 8080, portBits: 16, cookie: 81}
	for _, tc := range []struct {
		name    string
		rules   []rule
		want    string
		verdict uint8
		reason  uint8
		cookie  uint32
	}{
		{"the set allows", []rule{ref, shared}, "ok", bpf.PolicyVerdictAllowed, entry, 81},
		{"no reference: default deny", []rule{shared}, "EPERM", bpf.PolicyVerdictDenied, dflt, 0},
		{"reference, the set has no entry of the peer", []rule{ref, {endpoint: set, identity: 1003, dir: bpf.PolicyEgress, cookie: 82}},
			"EPERM", bpf.PolicyVerdictDenied, dflt, 0},
		{"reference in the other direction", []rule{{identity: bpf.PolicySetRef, dir: bpf.PolicyIngress, cookie: set}, shared},
			"EPERM", bpf.PolicyVerdictDenied, dflt, 0},
		{"own deny of the peer wins", []rule{ref, shared, {identity: 1002, dir: bpf.PolicyEgress, proto: tcp, deny: true, cookie: 83}},
			"EPERM", bpf.PolicyVerdictDenied, entry, 83},
		{"own deny of any peer wins", []rule{ref, shared, {identity: 0, dir: bpf.PolicyEgress, proto: tcp, port: 8080, portBits: 16, deny: true, cookie: 84}},
			"EPERM", bpf.PolicyVerdictDenied, entry, 84},
		{"own audited deny: audited", []rule{ref, shared, {identity: 1002, dir: bpf.PolicyEgress, deny: true, audit: true, cookie: 85}},
			"ok", bpf.PolicyVerdictAudited, entry, 85},
		{"own allow decides first", []rule{ref, shared, {identity: 0, dir: bpf.PolicyEgress, cookie: 86}},
			"ok", bpf.PolicyVerdictAllowed, entry, 86},
		{"a deny in a set allows nothing", []rule{ref, {endpoint: set, identity: 1002, dir: bpf.PolicyEgress, deny: true, cookie: 87}},
			"EPERM", bpf.PolicyVerdictDenied, dflt, 0},
		{"own final deny decides alone", []rule{ref, shared, {identity: 1002, dir: bpf.PolicyEgress, deny: true, final: true, cookie: 88}},
			"EPERM", bpf.PolicyVerdictDenied, entry, 88},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newDatapath(t)
			d.peers()
			d.rules(tc.rules...)
			d.endpoint(both)
			c := startChild(t, d.app)
			if got := c.do("tcp", peerC+":8080"); got != tc.want && !(tc.want == "ok" && strings.HasPrefix(got, "ok")) {
				t.Errorf("connect: %s, want %s", got, tc.want)
			}
			want := event{identity: 1002, verdict: tc.verdict, reason: tc.reason, cookie: tc.cookie, proto: tcp,
				hook: bpf.PolicyHookConnect4, remote: peerC + ":8080"}
			d.expectEvents(tc.name, want.policyEvent())
		})
	}
}
