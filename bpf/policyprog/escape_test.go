package policyprog

import (
	"net"
	"net/netip"
	"os/exec"
	"testing"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// family is one address family's addresses for TestFamilies: the same
// roles as the IPv4 constants of datapath_test.go.
type family struct {
	name                             string
	peerA, peerWorld                 string
	clientAllowed, clientDenied, pod string
	tcp, udp, icmp                   string // the child's exchange kinds
	hookConnect                      uint8
	needsAddrs                       bool // IPv6: put on lo (addV6)
}

// IPv6 addresses of the tests, on loopback; addV6 adds them to lo.
const (
	peerA6         = "fd00:a9::11"
	peerWorld6     = "fd00:a9::15"
	clientAllowed6 = "fd00:a9::21"
	clientDenied6  = "fd00:a9::22"
	podAddr6       = "fd00:a9::30"
)

func hostPort(addr string, port int) string {
	return netip.AddrPortFrom(netip.MustParseAddr(addr), uint16(port)).String()
}

var families = []family{
	{
		name: "IPv4", peerA: peerA, peerWorld: peerWorld, clientAllowed: clientAllowed, clientDenied: clientDenied, pod: podAddr,
		tcp: "tcp", udp: "udp", icmp: "icmp", hookConnect: bpf.PolicyHookConnect4,
	},
	{
		name: "IPv6", peerA: peerA6, peerWorld: peerWorld6, clientAllowed: clientAllowed6, clientDenied: clientDenied6, pod: podAddr6,
		tcp: "tcp6", udp: "udp6", icmp: "icmp6", hookConnect: bpf.PolicyHookConnect6, needsAddrs: true,
	},
}

// addV6 puts the tests' IPv6 addresses on lo until the test ends.
func addV6(t *testing.T) {
	t.Helper()
	testenv.RequireProgram(t, "ip")
	for _, a := range []string{peerA6, peerWorld6, clientAllowed6, clientDenied6, podAddr6} {
		out, err := exec.Command("ip", "-6", "addr", "add", a+"/128", "dev", "lo", "nodad").CombinedOutput()
		if err != nil {
			t.Fatalf("ip -6 addr add %s: %s: %s", a, err, out)
		}
		t.Cleanup(func() { exec.Command("ip", "-6", "addr", "del", a+"/128", "dev", "lo").Run() })
	}
}

// TestFamilies runs one policy, the same table of cases, over IPv4 and
// IPv6: egress by identity, protocol and port (connect and sendmsg refused
// with EPERM), ICMP and ICMPv6 echo dropped, ingress by client identity,
// and the replies of what is allowed coming back through an ingress
// default deny. An echo request of either family is refused (EPERM: the
// packet filter drops it on the way out). The first decision of each family is checked as an
// event: the right hook and family.
func TestFamilies(t *testing.T) {
	testenv.RequireRoot(t)
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			if fam.needsAddrs {
				addV6(t)
			}
			servers(t,
				[2]string{"tcp", hostPort(fam.peerA, 8080)}, [2]string{"tcp", hostPort(fam.peerA, 8081)},
				[2]string{"udp", hostPort(fam.peerA, 5353)}, [2]string{"udp", hostPort(fam.peerA, 5354)},
				[2]string{"tcp", hostPort(fam.peerWorld, 8080)},
			)
			d := newDatapath(t)
			d.identity(fam.peerA, 1000)
			d.identity(fam.clientAllowed, 2001)
			d.identity(fam.clientDenied, 2002)
			d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)
			d.rules(
				rule{identity: 1000, dir: bpf.PolicyEgress, proto: tcp, port: 8080, portBits: 16, cookie: 31},
				rule{identity: 1000, dir: bpf.PolicyEgress, proto: udp, port: 5353, portBits: 16, cookie: 32},
				rule{identity: 2001, dir: bpf.PolicyIngress, proto: tcp, port: 9000, portBits: 16, cookie: 33},
			)
			c := startChild(t, d.app)

			// The first decision, and its event.
			if got := c.do(fam.tcp, hostPort(fam.peerA, 8081)); got != "EPERM" {
				t.Errorf("TCP to a denied port: %s, want EPERM", got)
			}
			d.expectEvents("the denied connect", event{
				hook: fam.hookConnect, remote: hostPort(fam.peerA, 8081), proto: tcp, identity: 1000,
				verdict: bpf.PolicyVerdictDenied, reason: bpf.PolicyReasonDefaultDeny,
			}.policyEvent())

			for _, tc := range []struct {
				name string
				cmd  []string
				want string
			}{
				{"TCP allowed", []string{fam.tcp, hostPort(fam.peerA, 8080)}, "ok"},
				{"TCP to the world", []string{fam.tcp, hostPort(fam.peerWorld, 8080)}, "EPERM"},
				{"UDP allowed, its answer let in", []string{fam.udp, hostPort(fam.peerA, 5353)}, "ok"},
				{"UDP denied", []string{fam.udp, hostPort(fam.peerA, 5354)}, "EPERM"},
				{"echo request", []string{fam.icmp, fam.peerA}, "EPERM"},
			} {
				if got := c.do(tc.cmd...); got != tc.want {
					t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
				}
			}

			// Ingress: a server in the pod, one client allowed.
			if got := c.do("serve", "tcp", hostPort(fam.pod, 9000)); got != "ok "+hostPort(fam.pod, 9000) {
				t.Fatalf("serve in the pod: %s", got)
			}
			if _, err := exchange(fam.tcp, hostPort(fam.pod, 9000), fam.clientAllowed); err != nil {
				t.Errorf("allowed client: %s, want ok", outcome(err))
			}
			if _, err := exchange(fam.tcp, hostPort(fam.pod, 9000), fam.clientDenied); outcome(err) != "timeout" {
				t.Errorf("denied client: %s, want timeout", outcome(err))
			}
		})
	}
}

// TestMapped: a dual-stack (AF_INET6) socket connecting to an IPv4 address
// written as ::ffff:a.b.c.d is judged as that IPv4 address by connect6:
// EPERM at once when denied (not a timeout from the packet filter), and
// the IPv4 identity's entries when allowed.
func TestMapped(t *testing.T) {
	servers(t, [2]string{"tcp", peerA + ":8080"}, [2]string{"tcp", peerA + ":8081"})
	d := newDatapath(t)
	d.peers()
	d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)
	d.rules(rule{identity: 1000, dir: bpf.PolicyEgress, proto: tcp, port: 8080, portBits: 16, cookie: 41})
	c := startChild(t, d.app)
	if got := c.do("tcpmapped", peerA+":8081"); got != "EPERM" {
		t.Errorf("mapped address, denied port: %s, want EPERM", got)
	}
	want := event{
		hook: bpf.PolicyHookConnect6, remote: peerA + ":8081", proto: tcp, identity: 1000,
		verdict: bpf.PolicyVerdictDenied, reason: bpf.PolicyReasonDefaultDeny,
	}.policyEvent()
	want.LocalAddr = [16]byte{} // an unbound AF_INET6 socket's: ::
	d.expectEvents("the mapped connect", want)
	if got := c.do("tcpmapped", peerA+":8080"); got != "ok" {
		t.Errorf("mapped address, allowed port: %s, want ok", got)
	}
}

// TestListenerReuse: a socket that made an allowed connection to a peer,
// then disconnected (connect with AF_UNSPEC) and listens on the same
// address, keeps nothing of that flow: the peer connecting to it from the
// port it had is judged by the pod's ingress policy, which denies it.
func TestListenerReuse(t *testing.T) {
	d := newDatapath(t)
	d.peers()
	d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)
	// The pod may reach A's port, and nobody may reach the pod.
	peerPort := freePort(t, peerA)
	port := netip.MustParseAddrPort(peerPort).Port()
	d.rules(rule{identity: 1000, dir: bpf.PolicyEgress, proto: tcp, port: port, portBits: 16, cookie: 51})
	srv, err := startServer("tcp", peerPort)
	if err != nil {
		t.Fatal(err)
	}
	c := startChild(t, d.app)
	local := freePort(t, podAddr)
	if got := c.do("reuse", peerPort, local); got != "ok" {
		t.Fatalf("connect, then listen on the same socket: %s", got)
	}
	// A connects from the port the pod's flow was with.
	srv.Close()
	if _, got := exchange("tcp", local, peerPort); outcome(got) != "timeout" {
		t.Errorf("the old peer into the reused listener: %s, want timeout (denied by ingress)", outcome(got))
	}
}

// TestUnclassified: below a cgroup registered as a pod tree, a pod cgroup
// in no endpoint is denied both ways, with reason unclassified and
// endpoint 0; a registered pod next to it, enforcing nothing, and a cgroup
// outside the tree are not.
func TestUnclassified(t *testing.T) {
	servers(t, [2]string{"tcp", peerA + ":8080"})
	d := newDatapath(t)
	d.peers()
	tree := mkCgroup(t, d.root, "kubepods")
	unknown := mkCgroup(t, tree, "podunknown")
	known := mkCgroup(t, tree, "podknown")
	put := func(dir string, v bpf.PolicyEndpointValue) {
		if err := d.putEndpoint(cgroupID(t, dir), v); err != nil {
			t.Fatal(err)
		}
	}
	put(tree, bpf.PolicyEndpointValue{Flags: bpf.PolicyPodTree})
	put(known, bpf.PolicyEndpointValue{EndpointID: 9})

	c := startChild(t, unknown)
	if got := c.do("tcp", peerA+":8080"); got != "EPERM" {
		t.Errorf("unclassified pod: %s, want EPERM", got)
	}
	want := event{
		hook: bpf.PolicyHookConnect4, remote: peerA + ":8080", proto: tcp, identity: 1000,
		verdict: bpf.PolicyVerdictDenied, reason: bpf.PolicyReasonUnclassified,
	}.policyEvent()
	want.EndpointID = 0
	d.expectEvents("the unclassified connect", want)
	if got := c.do("serve", "tcp", podAddr+":9100"); got != "ok "+podAddr+":9100" {
		t.Fatalf("serve in the unclassified pod: %s", got)
	}
	if _, err := exchange("tcp", podAddr+":9100", clientAllowed); outcome(err) != "timeout" {
		t.Errorf("into the unclassified pod: %s, want timeout", outcome(err))
	}
	for name, dir := range map[string]string{"registered pod": known, "outside the tree": d.other} {
		if got := startChild(t, dir).do("tcp", peerA+":8080"); got != "ok" {
			t.Errorf("%s: %s, want ok", name, got)
		}
	}
}

// TestFloodKeepsFlows: a pod with no policy sends 200,000 datagrams to
// fresh peers while another pod, whose ingress is a default deny, holds an
// idle allowed connection: the connection still works afterwards, its
// replies still let in. Flows live with their sockets, so no pod's
// traffic can push out another's (the shared LRU of 65,536 flows that this
// replaced lost the connection).
func TestFloodKeepsFlows(t *testing.T) {
	testenv.RequireRoot(t)
	srv, err := net.Listen("tcp", peerA+":0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	go func() {
		for {
			c, err := srv.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 5)
				for {
					if _, err := c.Read(buf); err != nil {
						return
					}
					c.Write([]byte("pong\n"))
				}
			}()
		}
	}()
	d := newDatapath(t)
	d.peers()
	d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)
	port := uint16(srv.Addr().(*net.TCPAddr).Port)
	d.rules(rule{identity: 1000, dir: bpf.PolicyEgress, proto: tcp, port: port, portBits: 16, cookie: 61})
	// The flooding pod: registered, enforcing nothing but ingress, so
	// that each datagram's flow is remembered.
	flooder := mkCgroup(t, d.root, "flooder")
	if err := d.putEndpoint(cgroupID(t, flooder), bpf.PolicyEndpointValue{EndpointID: 8, Flags: bpf.PolicyEnforceIngress}); err != nil {
		t.Fatal(err)
	}

	victim := startChild(t, d.app)
	if got := victim.do("hold", srv.Addr().String()); got != "ok" {
		t.Fatalf("connect: %s", got)
	}
	if got := startChild(t, flooder).do("flood", "200000", "3"); got != "ok" {
		t.Fatalf("flood: %s", got)
	}
	if got := victim.do("use"); got != "ok" {
		t.Errorf("the idle connection after the flood: %s, want ok", got)
	}
}
