package policyprog

import (
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
// it allows come back, also through an ingress default deny.
func TestEgress(t *testing.T) {
	testenv.RequireRoot(t)
	servers(t,
		[2]string{"tcp", peerA + ":8080"}, [2]string{"tcp", peerA + ":8081"}, [2]string{"tcp", peerA + ":7070"},
		[2]string{"udp", peerA + ":5353"}, [2]string{"udp", peerA + ":5354"},
		[2]string{"tcp", peerB + ":8080"}, [2]string{"tcp", peerB + ":8081"},
		[2]string{"tcp", peerC + ":8080"}, [2]string{"tcp", peerC + ":9090"},
		[2]string{"tcp", peerD + ":8079"}, [2]string{"tcp", peerD + ":8095"}, [2]string{"tcp", peerD + ":8096"},
		[2]string{"tcp", peerWorld + ":8080"},
	)
	eg := bpf.PolicyEgress
	rules := []rule{
		{identity: 1000, dir: eg, proto: tcp, port: 8080, portBits: 16},
		{identity: 1000, dir: eg, proto: udp, port: 5353, portBits: 16},
		{identity: 1000, dir: eg, proto: icmp},
		// Every port and protocol, but one.
		{identity: 1001, dir: eg},
		{identity: 1001, dir: eg, proto: tcp, port: 8081, portBits: 16, deny: true},
		// Any peer.
		{identity: 0, dir: eg, proto: tcp, port: 9090, portBits: 16},
		// 8080-8095.
		{identity: 1003, dir: eg, proto: tcp, port: 8080, portBits: 12},
		// Allowed for A, denied for any peer: the deny wins.
		{identity: 1000, dir: eg, proto: tcp, port: 7070, portBits: 16},
		{identity: 0, dir: eg, proto: tcp, port: 7070, portBits: 16, deny: true},
		{identity: 2, dir: eg, proto: tcp, port: 8080, portBits: 16},
	}
	cases := []struct {
		name, kind, dst, want string
	}{
		{"identity and port allowed", "tcp", peerA + ":8080", "ok"},
		{"another port", "tcp", peerA + ":8081", "EPERM"},
		{"another peer", "tcp", peerC + ":8080", "EPERM"},
		{"any port of the peer", "tcp", peerB + ":8080", "ok"},
		{"deny of a port beats the peer's allow", "tcp", peerB + ":8081", "EPERM"},
		{"any peer", "tcp", peerC + ":9090", "ok"},
		{"deny for any peer beats the peer's allow", "tcp", peerA + ":7070", "EPERM"},
		{"port range, first below", "tcp", peerD + ":8079", "EPERM"},
		{"port range, last inside", "tcp", peerD + ":8095", "ok"},
		{"port range, first above", "tcp", peerD + ":8096", "EPERM"},
		{"not in the ipcache is world", "tcp", peerWorld + ":8080", "ok"},
		{"UDP sendmsg allowed", "udp", peerA + ":5353", "ok"},
		{"UDP sendmsg to another port", "udp", peerA + ":5354", "EPERM"},
		{"UDP connect allowed", "udpc", peerA + ":5353", "ok"},
		{"UDP connect to another port", "udpc", peerA + ":5354", "EPERM"},
		{"ICMP allowed", "icmp", peerA, "ok"},
		{"ICMP denied", "icmp", peerC, "EPERM"},
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
				if got := c.do(tc.kind, tc.dst); got != tc.want {
					t.Errorf("%s: %s %s: %s, want %s", tc.name, tc.kind, tc.dst, got, tc.want)
				}
				if tc.want == "ok" {
					allowed++
				} else {
					denied++
				}
			}
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

			// The flow of the first connection, as connect4 remembered it.
			found := false
			for k, v := range d.flows() {
				if netip.AddrFrom4(k.Peer).String() == peerA && k.PeerPort.Uint16() == 8080 && k.Protocol == tcp {
					found = true
					if v.EndpointID != testEndpoint || v.Egress != 1 {
						t.Errorf("flow to %s:8080: %+v, want endpoint %d egress", peerA, v, testEndpoint)
					}
				}
			}
			if !found {
				t.Errorf("no flow to %s:8080/TCP in %v", peerA, d.flows())
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
		rule{identity: 2001, dir: in, proto: tcp, port: 8080, portBits: 16},
		rule{identity: 2001, dir: in, proto: udp, port: 5353, portBits: 16},
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
	d.rules(rule{identity: 2001, dir: in, proto: tcp, port: dual.Port(), portBits: 16})
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
	}{
		{"TCP from an allowed peer", "tcp", podAddr + ":8080", clientAllowed, "ok", &tcpClient},
		{"TCP from another peer", "tcp", podAddr + ":8080", clientDenied, denied, nil},
		{"TCP to another port", "tcp", podAddr + ":8081", clientAllowed, denied, nil},
		{"TCP to a dual-stack listener", "tcp", dualAddr, clientAllowed, "ok", &dualClient},
		{"TCP to a dual-stack listener from another peer", "tcp", dualAddr, clientDenied, denied, nil},
		{"UDP from an allowed peer", "udp", podAddr + ":5353", clientAllowed, "ok", &udpClient},
		{"UDP from another peer", "udp", podAddr + ":5353", clientDenied, denied, nil},
	} {
		local, err := exchange(tc.kind, tc.dst, tc.src)
		if got := outcome(err); got != tc.want {
			t.Errorf("%s: %s %s from %s: %s, want %s", tc.name, tc.kind, tc.dst, tc.src, got, tc.want)
		}
		if tc.local != nil {
			*tc.local = local
		}
	}

	// sockops remembered the accepted connections with the client's port
	// (read from the upper half of remote_port), ingress the datagram's
	// peer: that is how the server's answers got out.
	flows := d.flows()
	for _, want := range []struct {
		peer  netip.AddrPort
		proto uint8
		ep    uint32
	}{
		{tcpClient, tcp, 0}, // sockops cannot tell the endpoint
		{dualClient, tcp, 0},
		{udpClient, udp, testEndpoint},
	} {
		found := false
		for k, v := range flows {
			if netip.AddrPortFrom(netip.AddrFrom4(k.Peer), k.PeerPort.Uint16()) == want.peer && k.Protocol == want.proto {
				found = true
				if v.Egress != 0 || v.EndpointID != want.ep {
					t.Errorf("flow from %s/%d: %+v, want ingress of endpoint %d", want.peer, want.proto, v, want.ep)
				}
			}
		}
		if !found {
			t.Errorf("no flow from %s/%d in %v", want.peer, want.proto, flows)
		}
	}

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

// TestAudit: with the audit flag, what the policy denies passes, counted
// as audited.
func TestAudit(t *testing.T) {
	servers(t, [2]string{"tcp", peerC + ":8080"})
	d := newDatapath(t)
	d.peers()
	d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress | bpf.PolicyAudit)
	c := startChild(t, d.app)
	if got := c.do("serve", "tcp", podAddr+":8080"); got != "ok "+podAddr+":8080" {
		t.Fatalf("serve in the pod: %s", got)
	}

	if got := c.do("tcp", peerC+":8080"); got != "ok" {
		t.Errorf("audited connect: %s, want ok", got)
	}
	s := d.stats()
	if got := stat(s, bpf.PolicyEgress, bpf.PolicyVerdictAudited); got != 1 {
		t.Errorf("egress audited %d times, want 1 (the connect)", got)
	}
	if _, err := exchange("tcp", podAddr+":8080", clientDenied); err != nil {
		t.Errorf("audited connection into the pod: %s", outcome(err))
	}
	s = d.stats()
	if got := stat(s, bpf.PolicyIngress, bpf.PolicyVerdictAudited); got == 0 {
		t.Error("ingress audited nothing")
	}
	for _, dir := range []uint8{bpf.PolicyIngress, bpf.PolicyEgress} {
		if stat(s, dir, bpf.PolicyVerdictDenied) != 0 || stat(s, dir, bpf.PolicyVerdictAllowed) != 0 {
			t.Errorf("direction %d: allowed or denied under audit with no policy: %v", dir, s)
		}
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
