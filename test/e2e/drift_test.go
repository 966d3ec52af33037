package e2e

import (
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// driftMetric is the name and labels of one series of
// apiary_bpf_map_drift_repaired_total, as /metrics writes it.
func driftMetric(mapName, kind string) string {
	return fmt.Sprintf("apiary_bpf_map_drift_repaired_total{kind=%q,map=%q}", kind, mapName)
}

// waitDriftRepaired waits until the agent has counted at least atLeast
// repairs of each kind of mapName.
func (a *agent) waitDriftRepaired(t *testing.T, mapName string, atLeast int, kinds ...string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, mapName+" repaired", func() (bool, string) {
		var state []string
		ok := true
		for _, kind := range kinds {
			n, err := a.metric(driftMetric(mapName, kind))
			if err != nil || n < float64(atLeast) {
				ok = false
			}
			state = append(state, fmt.Sprintf("%s=%v (%v)", kind, n, err))
		}
		return ok, strings.Join(state, ", ")
	})
}

// openPinned opens one of the agent's pinned maps through a handle of the
// test's own, as bpftool would.
func (a *agent) openPinned(t *testing.T, name string) *ebpf.Map {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.pinDir, name), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// TestLBDriftRepaired is the scenario of issue 28: with socket load
// balancing, backend 1 of a Service is deleted from lb4_backends and
// backend 2 rewritten to another address behind the agent's back. The
// resync (--bpf-map-resync-interval=1s) writes them again, and connections
// through the VIP reach both real backends again.
func TestLBDriftRepaired(t *testing.T) {
	t.Parallel()
	curl := testenv.RequireProgram(t, "curl")
	cgroup := testenv.Cgroup(t)

	ln1, err := net.Listen("tcp4", "127.0.0.11:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln1.Addr().(*net.TCPAddr).Port
	ln2, err := net.Listen("tcp4", net.JoinHostPort("127.0.0.12", strconv.Itoa(port)))
	if err != nil {
		ln1.Close()
		t.Fatal(err)
	}
	for _, ln := range []net.Listener{ln1, ln2} {
		srv := &http.Server{
			Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				fmt.Fprintf(w, "backend %s\n", ln.Addr())
			}),
			ReadHeaderTimeout: 5 * time.Second,
		}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
	}

	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "web.yaml"), webService(nil, port, "127.0.0.11", "127.0.0.12"))
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{
		"--enable-socket-lb", "--cgroup-root=" + cgroup, "--bpf-map-resync-interval=1s",
	}})
	be1 := fmt.Sprintf("127.0.0.11:%d/TCP", port)
	be2 := fmt.Sprintf("127.0.0.12:%d/TCP", port)
	wantMaps := []string{
		"BE " + be1 + " active",
		"BE " + be2 + " active",
		"FE 10.96.0.10:80/TCP count=2 qcount=0 flags=ClusterIP backends=" + be1 + "," + be2,
		"REV 10.96.0.10:80",
		"WILDCARD 10.96.0.10",
	}
	testenv.Eventually(t, waitTimeout, "the socket LB attached and the maps written", func() (bool, string) {
		var health []struct{ Scope, Message string }
		if err := a.dump("health", &health); err != nil {
			return false, err.Error()
		}
		attached := slices.ContainsFunc(health, func(h struct{ Scope, Message string }) bool {
			return h.Scope == "socketlb.job-attach" && strings.HasPrefix(h.Message, "Attached to cgroup")
		})
		got, err := a.lbMaps()
		if err != nil {
			return false, err.Error()
		}
		return attached && slices.Equal(got, wantMaps), fmt.Sprintf("attached %t, maps\n%s", attached, strings.Join(got, "\n"))
	})

	// Backend 1 goes, backend 2 now points elsewhere.
	backends := a.openPinned(t, bpf.LB4BackendsMap)
	ids := map[netip.Addr]uint32{}
	var id uint32
	var v bpf.LB4BackendValue
	for it := backends.Iterate(); it.Next(&id, &v); {
		ids[netip.AddrFrom4(v.Address)] = id
	}
	id1, id2 := ids[netip.MustParseAddr("127.0.0.11")], ids[netip.MustParseAddr("127.0.0.12")]
	if id1 == 0 || id2 == 0 {
		t.Fatalf("lb4_backends holds %v, want both backends", ids)
	}
	if err := backends.Delete(id1); err != nil {
		t.Fatal(err)
	}
	bad := bpf.LB4BackendValue{Address: [4]byte{127, 0, 0, 13}, Port: bpf.NewBe16(uint16(port)), Proto: 6}
	if err := backends.Put(id2, bad); err != nil {
		t.Fatal(err)
	}

	a.waitDriftRepaired(t, bpf.LB4BackendsMap, 1, "missing", "changed")
	got, err := a.lbMaps()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, wantMaps) {
		t.Fatalf("after the repair the maps hold\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(wantMaps, "\n"))
	}
	want := []string{fmt.Sprintf("backend 127.0.0.11:%d", port), fmt.Sprintf("backend 127.0.0.12:%d", port)}
	seen := map[string]int{}
	for i := 0; len(seen) < 2; i++ {
		if i == 100 {
			t.Fatalf("100 connections through the VIP after the repair all reached the same backend: %v", seen)
		}
		out, err := runInCgroup(cgroup, curl, "-sS", "--max-time", "2", "http://10.96.0.10/")
		out = strings.TrimSpace(out)
		if err != nil {
			t.Fatalf("curl http://10.96.0.10/ after the repair: %v", err)
		}
		if !slices.Contains(want, out) {
			t.Fatalf("curl http://10.96.0.10/ got %q, no backend's answer (so far: %v)", out, seen)
		}
		seen[out]++
	}
	t.Logf("answers after the repair: %v", seen)
	if a.proc.findLog("Repaired BPF map drift: the map held other entries than the agent wrote") == nil {
		t.Error("the repair was not logged")
	}
}

// TestIPCacheDriftRepaired deletes one of the node's prefixes from the
// ipcache map, gives the other another identity and adds a stray prefix,
// behind the agent's back, three resyncs in a row: each resync puts the map
// back as it was, and the third says the map keeps drifting.
func TestIPCacheDriftRepaired(t *testing.T) {
	t.Parallel()
	a := startAgent(t, agentOptions{flags: []string{"--node-ips=192.0.2.1,192.0.2.2", "--bpf-map-resync-interval=1s"}})
	var want map[string]uint32
	testenv.Eventually(t, waitTimeout, "the node's prefixes in the ipcache map", func() (bool, string) {
		var err error
		want, err = a.ipcacheMap()
		if err != nil {
			return false, err.Error()
		}
		_, ok1 := want["192.0.2.1/32"]
		_, ok2 := want["192.0.2.2/32"]
		return ok1 && ok2, fmt.Sprint(want)
	})

	m := a.openPinned(t, bpf.IPCacheMap)
	key := func(s string) bpf.IPCacheKey { return bpf.NewIPCacheKey(netip.MustParsePrefix(s)) }
	for round := 1; round <= 3; round++ {
		for _, err := range []error{
			m.Delete(key("192.0.2.1/32")),
			m.Put(key("192.0.2.2/32"), bpf.IPCacheValue{Identity: want["192.0.2.2/32"] + 1000}),
			m.Put(key("203.0.113.0/24"), bpf.IPCacheValue{Identity: 2}),
		} {
			if err != nil {
				t.Fatal(err)
			}
		}
		a.waitDriftRepaired(t, bpf.IPCacheMap, round, "missing", "changed", "stray")
		got, err := a.ipcacheMap()
		if err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(got, want) {
			t.Fatalf("round %d: after the repair the ipcache map holds %v, want %v", round, got, want)
		}
	}
	rec := a.waitLog(t, "Reconciler: failed to prune objects")
	if msg := fmt.Sprint(rec["error"]); !strings.Contains(msg, "map ipcache drifted in 3 resyncs in a row") {
		t.Errorf("the failed prune says %q, want the map reported as drifting", msg)
	}
}

// TestPolicyPrefixesDriftRepaired: the prefixes a NetworkPolicy's ipBlock
// names are in the policy_prefixes map (`apiary bpf policy-prefixes list`),
// and a prefix deleted, one given another identity and a stray one added
// behind the agent's back are put back by the resync, as for the ipcache.
func TestPolicyPrefixesDriftRepaired(t *testing.T) {
	t.Parallel()
	configDir := t.TempDir()
	writeFile(t, filepath.Join(configDir, "np.yaml"), `apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: block, namespace: default}
spec:
  podSelector: {}
  policyTypes: [Egress]
  egress: [{to: [{ipBlock: {cidr: 198.51.100.0/24, except: [198.51.100.128/25]}}]}]
`)
	a := startAgent(t, agentOptions{configDir: configDir, flags: []string{"--node-ips=192.0.2.1", "--bpf-map-resync-interval=1s"}})
	var want map[string]uint32
	testenv.Eventually(t, waitTimeout, "the ipBlock's prefixes in the policy_prefixes map", func() (bool, string) {
		var err error
		want, err = a.prefixMap("policy-prefixes")
		if err != nil {
			return false, err.Error()
		}
		return len(want) == 2 && want["198.51.100.0/24"] != 0 && want["198.51.100.128/25"] != 0, fmt.Sprint(want)
	})

	m := a.openPinned(t, bpf.PolicyPrefixesMap)
	key := func(s string) bpf.IPCacheKey { return bpf.NewIPCacheKey(netip.MustParsePrefix(s)) }
	for _, err := range []error{
		m.Delete(key("198.51.100.0/24")),
		m.Put(key("198.51.100.128/25"), bpf.IPCacheValue{Identity: want["198.51.100.128/25"] + 1000}),
		m.Put(key("10.0.0.0/8"), bpf.IPCacheValue{Identity: 2}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	a.waitDriftRepaired(t, bpf.PolicyPrefixesMap, 1, "missing", "changed", "stray")
	got, err := a.prefixMap("policy-prefixes")
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(got, want) {
		t.Fatalf("after the repair the policy_prefixes map holds %v, want %v", got, want)
	}
}
