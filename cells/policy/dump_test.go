package policy_test

import (
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/policy"
	"github.com/apiary-net/apiary/internal/testenv"
)

// listGolden is what `apiary bpf policy list` prints for the maps
// TestPolicyList pins: endpoints by ID, each with its cgroup and enforced
// directions, then its entries by direction, identity, protocol, port and
// prefix length; an endpoint with entries but no cgroup, and one with a
// cgroup but no entries; endpoint 2's reference to policy set 3.
const listGolden = `endpoint 1 cgroup 1001 enforce=ingress,egress
  ingress identity=any ANY allow
  ingress identity=256 TCP/8080 allow
  egress identity=any TCP allow
  egress identity=2 UDP/53 deny
  egress identity=257 TCP/8000-8063 allow
  egress identity=257 TCP/8000 deny
endpoint 2 cgroup 1002 enforce=egress audit
  egress identity=16777217 TCP/443 allow pod-addrs
  egress identity=16777217 TCP/8080 allow
  egress shares policy set 3 (its allows: --endpoint 3)
endpoint 3 (no cgroup)
  egress identity=any ANY allow
  egress identity=258 TCP/80 deny final
  egress identity=258 TCP/81 pass
endpoint 4 cgroup 1004 enforce=none
`

// TestPolicyList pins policy maps, reads them with ReadPinned and prints
// them with WriteEntries, whole and for one endpoint (--endpoint).
func TestPolicyList(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	const tcp, udp = unix.IPPROTO_TCP, unix.IPPROTO_UDP
	allow := func(k bpf.PolicyKey) policy.Entry {
		return policy.Entry{Key: k, Value: bpf.PolicyValue{PortPrefixLen: uint8(k.PrefixLen - bpf.PolicyStaticPrefixBits)}}
	}
	deny := func(k bpf.PolicyKey) policy.Entry {
		e := allow(k)
		e.Value.Flags = bpf.PolicyFlagDeny
		return e
	}
	podAddrs := func(k bpf.PolicyKey) policy.Entry {
		e := allow(k)
		e.Value.Flags = bpf.PolicyFlagPodAddrs
		return e
	}
	flagged := func(k bpf.PolicyKey, flags uint8) policy.Entry {
		e := allow(k)
		e.Value.Flags = flags
		return e
	}
	// In no particular order: the output is sorted.
	entries := []policy.Entry{
		podAddrs(bpf.NewPolicyKey(2, 0x01000001, bpf.PolicyEgress, tcp, 443, 16)),
		allow(bpf.NewPolicyKey(2, 0x01000001, bpf.PolicyEgress, tcp, 8080, 16)),
		deny(bpf.NewPolicyKey(1, 257, bpf.PolicyEgress, tcp, 8000, 16)),
		allow(bpf.NewPolicyKey(1, 257, bpf.PolicyEgress, tcp, 8000, 10)),
		deny(bpf.NewPolicyKey(1, 2, bpf.PolicyEgress, udp, 53, 16)),
		allow(bpf.NewPolicyKey(1, 0, bpf.PolicyEgress, tcp, 0, 0)),
		allow(bpf.NewPolicyKey(1, 256, bpf.PolicyIngress, tcp, 8080, 16)),
		allow(bpf.NewPolicyKey(3, 0, bpf.PolicyEgress, 0, 0, 0)),
		flagged(bpf.NewPolicyKey(3, 258, bpf.PolicyEgress, tcp, 80, 16), bpf.PolicyFlagDeny|bpf.PolicyFlagFinal),
		flagged(bpf.NewPolicyKey(3, 258, bpf.PolicyEgress, tcp, 81, 16), bpf.PolicyFlagPass),
		allow(bpf.NewPolicyKey(1, 0, bpf.PolicyIngress, 0, 0, 0)),
		{Key: bpf.NewPolicyKey(2, bpf.PolicySetRef, bpf.PolicyEgress, 0, 0, 0), Value: bpf.PolicyValue{Cookie: 3}},
	}
	endpoints := []policy.Endpoint{
		{CgroupID: 1002, Value: bpf.PolicyEndpointValue{EndpointID: 2, Flags: bpf.PolicyEnforceEgress | bpf.PolicyAudit}},
		{CgroupID: 1001, Value: bpf.PolicyEndpointValue{EndpointID: 1, Flags: bpf.PolicyEnforceIngress | bpf.PolicyEnforceEgress}},
		{CgroupID: 1004, Value: bpf.PolicyEndpointValue{EndpointID: 4}},
	}
	pin(t, dir, bpf.PolicyMapSpec(256), func(m *ebpf.Map) error {
		for _, e := range entries {
			if err := m.Put(e.Key, e.Value); err != nil {
				return err
			}
		}
		return nil
	})
	pin(t, dir, bpf.PolicyEndpointsMapSpec(64), func(m *ebpf.Map) error {
		for _, ep := range endpoints {
			if err := m.Put(ep.CgroupID, ep.Value); err != nil {
				return err
			}
		}
		return nil
	})

	gotEndpoints, gotEntries, err := policy.ReadPinned(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(gotEndpoints) != len(endpoints) || len(gotEntries) != len(entries) {
		t.Fatalf("read %d endpoints and %d entries, want %d and %d", len(gotEndpoints), len(gotEntries), len(endpoints), len(entries))
	}
	tests := []struct {
		name     string
		endpoint uint32
		want     string
		wantErr  string
	}{
		{"every endpoint", 0, listGolden, ""},
		{"--endpoint 2", 2, "endpoint 2 cgroup 1002 enforce=egress audit\n  egress identity=16777217 TCP/443 allow pod-addrs\n  egress identity=16777217 TCP/8080 allow\n  egress shares policy set 3 (its allows: --endpoint 3)\n", ""},
		{"--endpoint of no cgroup", 3, "endpoint 3 (no cgroup)\n  egress identity=any ANY allow\n  egress identity=258 TCP/80 deny final\n  egress identity=258 TCP/81 pass\n", ""},
		{"--endpoint without entries", 4, "endpoint 4 cgroup 1004 enforce=none\n", ""},
		{"--endpoint unknown", 99, "", "endpoint 99 is not in the policy maps"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out strings.Builder
			err := policy.WriteEntries(&out, gotEndpoints, gotEntries, tc.endpoint)
			if tc.wantErr != "" {
				if err == nil || err.Error() != tc.wantErr {
					t.Fatalf("error %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if out.String() != tc.want {
				t.Errorf("got\n%s\nwant\n%s", out.String(), tc.want)
			}
		})
	}
}

// TestReadPinnedMissing: without the maps (the agent never enforced
// policy with this pin directory) the error says so.
func TestReadPinnedMissing(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	_, _, err := policy.ReadPinned(dir)
	if err == nil || !strings.Contains(err.Error(), "not pinned (has the agent run with policy enforcement?)") {
		t.Fatalf("got %v, want the maps not pinned", err)
	}
}

// pin creates the map of spec pinned in dir and fills it with fill.
func pin(t *testing.T, dir string, spec *ebpf.MapSpec, fill func(*ebpf.Map) error) {
	t.Helper()
	m, err := bpf.OpenPinnedMap(nil, spec, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := fill(m.Map); err != nil {
		t.Fatalf("fill %s: %v", m.Path, err)
	}
}
