package policyprog

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// prefix puts a policy prefix with its CIDR identity in policy_prefixes.
func prefix(t testing.TB, m interface {
	Put(key, value any) error
}, cidr string, id uint32) {
	t.Helper()
	if err := m.Put(bpf.NewIPCacheKey(netip.MustParsePrefix(cidr)), bpf.IPCacheValue{Identity: id}); err != nil {
		t.Fatal(err)
	}
}

// CIDR identities of the address tests: a block holding the peers, an
// except inside it holding peerB, and the block of a CNP's toCIDR.
const (
	idBlock  = 0x01000101
	idExcept = 0x01000102
	idCNP    = 0x01000103
)

// TestAddressPeers: a peer with a workload's identity that no entry allows
// is allowed by an entry of the policy prefix holding its address only
// when a NetworkPolicy ipBlock made that entry (bpf.PolicyFlagPodAddrs);
// the event names that entry and the prefix's identity. A CIDR rule of a
// CNP still selects no pod, an except prefix keeps its pods out, and a
// deny of the pod's identity still wins.
func TestAddressPeers(t *testing.T) {
	testenv.RequireRoot(t)
	servers(t,
		[2]string{"tcp", peerA + ":8080"}, [2]string{"tcp", peerA + ":8081"}, [2]string{"tcp", peerA + ":8082"},
		[2]string{"tcp", peerB + ":8080"}, [2]string{"tcp", peerC + ":8080"}, [2]string{"tcp", peerC + ":8083"},
		[2]string{"tcp", peerD + ":8084"},
	)
	d := newDatapath(t)
	d.peers()
	prefix(t, d.maps.Prefixes, "127.0.77.0/24", idBlock)
	prefix(t, d.maps.Prefixes, peerB+"/32", idExcept)
	prefix(t, d.maps.Prefixes, "127.0.77.12/31", idCNP) // B and C
	eg := bpf.PolicyEgress
	d.rules(
		// The ipBlock 127.0.77.0/24 except B on 8080 and 8082.
		rule{identity: idBlock, dir: eg, proto: tcp, port: 8080, portBits: 16, cookie: 31},
		rule{identity: idBlock, dir: eg, proto: tcp, port: 8082, portBits: 16, cookie: 33},
		// A CNP's toCIDR of the /31 on 8083; the /31 is inside the
		// block, whose selector selects its identity too.
		rule{identity: idCNP, dir: eg, proto: tcp, port: 8083, portBits: 16, cookie: 34},
		rule{identity: idCNP, dir: eg, proto: tcp, port: 8080, portBits: 16, cookie: 32},
		// A deny of A's own identity on 8082.
		rule{identity: 1000, dir: eg, proto: tcp, port: 8082, portBits: 16, deny: true, cookie: 35},
		// D's identity allows 8084 itself.
		rule{identity: 1003, dir: eg, proto: tcp, port: 8084, portBits: 16, cookie: 36},
	)
	d.podAddrs(idBlock, eg, tcp, 8080)
	d.podAddrs(idBlock, eg, tcp, 8082)
	d.podAddrs(idCNP, eg, tcp, 8080)
	d.endpoint(bpf.PolicyEnforceEgress)
	c := startChild(t, d.app)

	const (
		entry = bpf.PolicyReasonEntry
		dflt  = bpf.PolicyReasonDefaultDeny
	)
	for _, tc := range []struct {
		name, dst, want  string
		identity, cookie uint32
		reason           uint8
	}{
		{"a pod inside the block", peerA + ":8080", "ok", idBlock, 31, entry},
		{"a port the block does not allow", peerA + ":8081", "EPERM", 1000, 0, dflt},
		{"the pod's own deny wins", peerA + ":8082", "EPERM", 1000, 35, entry},
		{"a pod in the except", peerB + ":8080", "EPERM", 1001, 0, dflt},
		// C's longest prefix is the CNP's /31, which the block holds.
		{"a pod in a longer prefix inside the block", peerC + ":8080", "ok", idCNP, 32, entry},
		{"a CNP CIDR rule selects no pod", peerC + ":8083", "EPERM", 1002, 0, dflt},
		{"the pod's identity decides first", peerD + ":8084", "ok", 1003, 36, entry},
	} {
		got, _, _ := strings.Cut(c.do("local", "tcp", tc.dst), " ")
		if got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
		want := event{hook: bpf.PolicyHookConnect4, remote: tc.dst, proto: tcp, identity: tc.identity,
			reason: tc.reason, cookie: tc.cookie, verdict: bpf.PolicyVerdictAllowed}
		if tc.want != "ok" {
			want.verdict = bpf.PolicyVerdictDenied
		}
		d.expectEvents(tc.name, want.policyEvent())
	}
}

// podAddrs marks an allow entry of the test endpoint as a NetworkPolicy
// ipBlock's, as the agent writes it.
func (d *datapath) podAddrs(identity uint32, dir, proto uint8, port uint16) {
	d.t.Helper()
	k := bpf.NewPolicyKey(testEndpoint, identity, dir, proto, port, 16)
	var v bpf.PolicyValue
	if err := d.maps.Policy.Lookup(k, &v); err != nil {
		d.t.Fatalf("lookup %s: %s", k, err)
	}
	v.Flags |= bpf.PolicyFlagPodAddrs
	if err := d.maps.Policy.Put(k, v); err != nil {
		d.t.Fatal(err)
	}
}

// TestInterfaceAddressPeers: the interface programs judge by address as
// the socket hooks do, both ways (a pod's address as the source of what
// another pod receives too).
func TestInterfaceAddressPeers(t *testing.T) {
	const pod, inBlock, except = "10.244.0.5", "10.244.1.7", "10.244.1.8"
	d := newIfaceDatapath(t, pod)
	d.identity(inBlock, 1000)
	d.identity(except, 1001)
	prefix(t, d.maps.Prefixes, "10.0.0.0/8", idBlock)
	prefix(t, d.maps.Prefixes, except+"/32", idExcept)
	d.endpoint(bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress)
	put := func(identity uint32, dir uint8, port uint16, flags uint8) {
		k := bpf.NewPolicyKey(testEndpoint, identity, dir, tcp, port, 16)
		if err := d.maps.Policy.Put(k, bpf.PolicyValue{Flags: flags, Cookie: 1}); err != nil {
			t.Fatal(err)
		}
	}
	put(idBlock, bpf.PolicyEgress, 80, bpf.PolicyFlagPodAddrs)
	put(idBlock, bpf.PolicyIngress, 8080, bpf.PolicyFlagPodAddrs)
	put(idBlock, bpf.PolicyEgress, 81, 0) // a CNP's
	out := func(dst string, port uint16) uint32 {
		return d.run(FromPod, frame(packet{src: pod, dst: dst, proto: tcp, sport: 4000, dport: port, tcpFlags: synFlag}))
	}
	in := func(src string, port uint16) uint32 {
		return d.run(ToPod, frame(packet{src: src, dst: pod, proto: tcp, sport: 5000, dport: port, tcpFlags: synFlag}))
	}
	for _, s := range []struct {
		name      string
		got, want uint32
	}{
		{"egress to a pod in the block", out(inBlock, 80), tcxNext},
		{"egress to the except", out(except, 80), tcxDrop},
		{"egress by a CNP's entry", out(inBlock, 81), tcxDrop},
		{"ingress from a pod in the block", in(inBlock, 8080), tcxNext},
		{"ingress from the except", in(except, 8080), tcxDrop},
		{"ingress to another port", in(inBlock, 8081), tcxDrop},
	} {
		if s.got != s.want {
			t.Errorf("%s: %#x, want %#x", s.name, s.got, s.want)
		}
	}
}
