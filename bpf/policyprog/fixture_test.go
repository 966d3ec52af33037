package policyprog

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// testEndpoint is the endpoint ID of the tests' pod cgroup.
const testEndpoint = 7

// datapath is the programs attached to a cgroup of the test's own, with
// fresh maps, and a pod cgroup below it:
//
//	root/           the programs are attached here
//	root/pod/       the endpoint, once registered
//	root/pod/app/   where the pod's processes run (a container)
//	root/other/     a cgroup in no endpoint
type datapath struct {
	t                     testing.TB
	maps                  Maps
	progs                 map[string]*ebpf.Program
	root, pod, app, other string
}

func newDatapath(t testing.TB) *datapath {
	t.Helper()
	testenv.RequireRoot(t)
	newMap := func(spec *ebpf.MapSpec) *ebpf.Map {
		spec = spec.Copy()
		spec.Pinning = ebpf.PinNone
		m, err := ebpf.NewMap(spec)
		if err != nil {
			t.Fatalf("create map %s: %s", spec.Name, err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	d := &datapath{t: t, maps: Maps{
		Policy:    newMap(bpf.PolicyMapSpec(1024)),
		Endpoints: newMap(bpf.PolicyEndpointsMapSpec(64)),
		Flows:     newMap(bpf.PolicyFlowsMapSpec(1024)),
		Stats:     newMap(bpf.PolicyStatsMapSpec()),
		IPCache:   newMap(bpf.IPCacheMapSpec(1024)),
	}}
	progs, err := Load(d.maps)
	if err != nil {
		t.Fatal(err)
	}
	d.progs = progs
	t.Cleanup(func() {
		for _, p := range progs {
			p.Close()
		}
	})
	d.root = testenv.Cgroup(t)
	d.pod = mkCgroup(t, d.root, "pod")
	d.app = mkCgroup(t, d.pod, "app")
	d.other = mkCgroup(t, d.root, "other")
	d.attach()
	return d
}

// attach attaches every hook, in order, to the root cgroup, until the test
// ends.
func (d *datapath) attach() {
	for _, h := range Hooks {
		lk, err := link.AttachCgroup(link.CgroupOptions{Path: d.root, Attach: h.Attach, Program: d.progs[h.Program]})
		if err != nil {
			d.t.Fatalf("attach %s: %s", h.Name, err)
		}
		d.t.Cleanup(func() { lk.Close() })
	}
}

// mkCgroup creates the cgroup dir/name and removes it when the test ends
// (before dir, since cleanups run last first).
func mkCgroup(t testing.TB, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.Mkdir(p, 0o755); err != nil {
		t.Fatalf("create cgroup: %s", err)
	}
	t.Cleanup(func() {
		// A child that has just exited may still be counted in it.
		deadline := time.Now().Add(2 * time.Second)
		for {
			err := os.Remove(p)
			if err == nil || errors.Is(err, os.ErrNotExist) {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("remove cgroup %s: %s", p, err)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	return p
}

// cgroupID returns the ID of a cgroup v2 directory: its inode number.
func cgroupID(t testing.TB, dir string) uint64 {
	t.Helper()
	st, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	return st.Sys().(*syscall.Stat_t).Ino
}

// endpoint makes the pod cgroup the test endpoint, with flags
// (bpf.PolicyEnforce*, bpf.PolicyAudit).
func (d *datapath) endpoint(flags uint32) {
	d.t.Helper()
	v := bpf.PolicyEndpointValue{EndpointID: testEndpoint, Flags: flags}
	if err := d.maps.Endpoints.Put(cgroupID(d.t, d.pod), v); err != nil {
		d.t.Fatal(err)
	}
}

// identity gives addr the identity id in the ipcache.
func (d *datapath) identity(addr string, id uint32) {
	d.t.Helper()
	k := bpf.NewIPCacheKey(netip.PrefixFrom(netip.MustParseAddr(addr), 32))
	if err := d.maps.IPCache.Put(k, bpf.IPCacheValue{Identity: id}); err != nil {
		d.t.Fatal(err)
	}
}

// rule is a policy entry of the test endpoint.
type rule struct {
	identity uint32
	dir      uint8 // bpf.PolicyIngress, bpf.PolicyEgress
	proto    uint8 // 0: any
	port     uint16
	portBits int
	deny     bool
}

func (d *datapath) rules(rules ...rule) {
	d.t.Helper()
	for _, r := range rules {
		k := bpf.NewPolicyKey(testEndpoint, r.identity, r.dir, r.proto, r.port, r.portBits)
		v := bpf.PolicyValue{PortPrefixLen: uint8(k.PrefixLen - bpf.PolicyStaticPrefixBits), Cookie: 1}
		if r.deny {
			v.Flags = bpf.PolicyFlagDeny
		}
		if err := d.maps.Policy.Put(k, v); err != nil {
			d.t.Fatalf("put %s: %s", k, err)
		}
	}
}

// stats returns policy_stats summed over the CPUs.
func (d *datapath) stats() (s [bpf.PolicyStatsEntries]uint64) {
	d.t.Helper()
	for i := range s {
		var perCPU []uint64
		if err := d.maps.Stats.Lookup(uint32(i), &perCPU); err != nil {
			d.t.Fatal(err)
		}
		for _, n := range perCPU {
			s[i] += n
		}
	}
	return s
}

// stat returns one count of stats.
func stat(s [bpf.PolicyStatsEntries]uint64, dir uint8, verdict int) uint64 {
	return s[int(dir)*bpf.PolicyVerdicts+verdict]
}

// flows returns the flows the programs remembered.
func (d *datapath) flows() map[bpf.PolicyFlowKey]bpf.PolicyFlowValue {
	d.t.Helper()
	out := map[bpf.PolicyFlowKey]bpf.PolicyFlowValue{}
	var k bpf.PolicyFlowKey
	var v bpf.PolicyFlowValue
	it := d.maps.Flows.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	if err := it.Err(); err != nil {
		d.t.Fatal(err)
	}
	return out
}

// servers answer pings (see serve) on each "proto addr:port" until the
// test ends; they run in the test process, in no endpoint.
func servers(t testing.TB, specs ...[2]string) {
	t.Helper()
	for _, s := range specs {
		c, err := startServer(s[0], s[1])
		if err != nil {
			t.Fatalf("serve %s %s: %s", s[0], s[1], err)
		}
		t.Cleanup(func() { c.Close() })
	}
}
