package fqdn_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// agent is a started hive with the fqdn cell and what the tests look at.
type agent struct {
	proxy      *fqdn.Proxy
	db         *statedb.DB
	identities statedb.Table[*tables.Identity]
	names      statedb.Table[*tables.FQDNName]
	reg        *prometheus.Registry
	pinDir     string
}

const examplePolicy = `apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: example, namespace: default}
spec:
  endpointSelector: {}
  egress:
  - toFQDNs: [{matchPattern: "*.example.com"}]
`

// startAgent starts a hive whose DNS proxy forwards to upstream, with
// examplePolicy in --config-dir, and waits for its FQDN selector.
func startAgent(t testing.TB, upstream string, args ...string) *agent {
	t.Helper()
	return startAgentWith(t, upstream, nil, nil, args...)
}

// newClients returns fake clients holding objects.
func newClients(t testing.TB, objects []runtime.Object) *k8sfake.Clients {
	c := k8sfake.New()
	for _, o := range objects {
		if err := c.Tracker().Add(o); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// startAgentWith is startAgent with more cells in the hive (extra) and
// objects in the fake clientset.
func startAgentWith(t testing.TB, upstream string, extra []cell.Cell, objects []runtime.Object, args ...string) *agent {
	t.Helper()
	pinDir := testenv.BPFPinDir(t)
	configDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(configDir, "policy.yaml"), []byte(examplePolicy), 0o644); err != nil {
		t.Fatal(err)
	}
	a := &agent{pinDir: pinDir}
	cells := append([]cell.Cell{
		infra.Cell, k8sfake.NewCell(newClients(t, objects)),
		identity.Cell, ipcache.Cell, selectors.Cell, fqdn.Cell,
		cell.Invoke(func(p *fqdn.Proxy, db *statedb.DB, ids statedb.Table[*tables.Identity], names statedb.Table[*tables.FQDNName], reg *prometheus.Registry) {
			a.proxy, a.db, a.identities, a.names, a.reg = p, db, ids, names, reg
		}),
	}, extra...)
	h := hive.NewWithOptions(core.HiveOptions(), cells...)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	flags := append([]string{
		"--api-addr=127.0.0.1:0", "--bpf-pin-dir=" + pinDir, "--state-dir=" + t.TempDir(),
		"--config-dir=" + configDir, "--node-name=test", "--node-ips=192.168.1.10",
		"--dns-proxy-addr=127.0.0.1:0", "--dns-upstream=" + upstream,
	}, args...)
	if err := fs.Parse(flags); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	// The selector has come once its identity is pre-allocated.
	testenv.Eventually(t, 10*time.Second, "one FQDN identity", func() (bool, string) {
		n := a.fqdnIdentities()
		return n == 1, fmt.Sprintf("%d FQDN identities", n)
	})
	return a
}

// fqdnIdentities counts the identities carrying fqdn: labels.
func (a *agent) fqdnIdentities() int {
	n := 0
	for id := range a.identities.All(a.db.ReadTxn()) {
		if id.Labels.HasSource(tables.SourceFQDN) {
			n++
		}
	}
	return n
}

// counter returns the value of the metric name (without labels).
func (a *agent) counter(t testing.TB, name string) float64 {
	t.Helper()
	mfs, err := a.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) > 0 {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	return 0
}

// mapIdentity looks ip up in the pinned ipcache map, as the datapath does.
func (a *agent) mapIdentity(t testing.TB, ip netip.Addr) (uint32, bool) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.pinDir, bpf.IPCacheMap), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var v bpf.IPCacheValue
	if err := m.Lookup(bpf.NewIPCacheKey(tables.HostPrefix(ip)), &v); err != nil {
		return 0, false
	}
	return v.Identity, true
}

func records(n int, offset int) []string {
	out := make([]string, n)
	for i := range n {
		j := i + offset
		out[i] = fmt.Sprintf("300 IN A 10.%d.%d.%d", j>>16&255, j>>8&255, j&255)
	}
	return out
}

// A name returning 1000 addresses costs one identity, every address is in
// the map when the client gets the answer, and a new address for the same
// selector costs exactly one ipcache map write.
func TestOneIdentityPerSelectorSet(t *testing.T) {
	testenv.RequireRoot(t)
	up := startUpstream(t)
	// The answer must wait for the map however loaded the machine is; the
	// default bound (100ms) is about speed, which the benchmark measures.
	a := startAgent(t, up.addr, "--tofqdns-proxy-response-max-delay=10s")
	up.set(t, "many.example.com", records(1000, 1)...)

	resp, err := fqdn.Query(a.proxy.Addr(), "many.example.com", dns.TypeA, true, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Answer) != 1000 {
		t.Fatalf("%d answers, want 1000", len(resp.Answer))
	}
	var first uint32
	for _, rr := range resp.Answer {
		ip, _ := netip.AddrFromSlice(rr.(*dns.A).A.To4())
		id, ok := a.mapIdentity(t, ip)
		if !ok {
			t.Fatalf("%s is not in the ipcache map when the client has the answer", ip)
		}
		if first == 0 {
			first = id
		} else if id != first {
			t.Fatalf("%s has identity %d, others %d", ip, id, first)
		}
	}
	if n := a.fqdnIdentities(); n != 1 {
		t.Fatalf("%d FQDN identities, want 1 (the pre-allocated one)", n)
	}

	before := a.counter(t, "apiary_ipcache_map_updates_total")
	up.set(t, "many.example.com", records(1001, 1)...)
	if _, err := fqdn.Query(a.proxy.Addr(), "many.example.com", dns.TypeA, true, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := a.counter(t, "apiary_ipcache_map_updates_total") - before; got != 1 {
		t.Fatalf("a new address cost %v map writes, want 1", got)
	}
	if id, ok := a.mapIdentity(t, netip.MustParseAddr("10.0.3.233")); !ok || id != first {
		t.Fatalf("new address: identity %d (in map: %v), want %d", id, ok, first)
	}
	if a.counter(t, "apiary_fqdn_proxy_response_delay_exceeded_total") != 0 {
		t.Fatal("an answer was released before the map had its addresses")
	}
}

// Past --tofqdns-max-ips-per-name the least recently seen addresses go;
// a TTL under --tofqdns-min-ttl is raised to it.
func TestMaxIPsAndMinTTL(t *testing.T) {
	testenv.RequireRoot(t)
	up := startUpstream(t)
	a := startAgent(t, up.addr, "--tofqdns-max-ips-per-name=3", "--tofqdns-min-ttl=600")
	up.set(t, "a.example.com", "1 IN A 192.0.2.1", "1 IN A 192.0.2.2")
	if _, err := fqdn.Query(a.proxy.Addr(), "a.example.com", dns.TypeA, false, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond) // so that Seen differs
	up.set(t, "a.example.com", "1 IN A 192.0.2.3", "1 IN A 192.0.2.4")
	if _, err := fqdn.Query(a.proxy.Addr(), "a.example.com", dns.TypeA, false, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	row, _, ok := a.names.Get(a.db.ReadTxn(), tables.FQDNNameIndex.Query("a.example.com"))
	if !ok {
		t.Fatal("a.example.com not in fqdn-names")
	}
	var got []string
	for _, e := range row.IPs {
		got = append(got, e.IP.String())
		if ttl := time.Until(e.Expires); ttl < 590*time.Second {
			t.Errorf("%s expires in %s, want about 600s (--tofqdns-min-ttl)", e.IP, ttl)
		}
	}
	if fmt.Sprint(got) != "[192.0.2.2 192.0.2.3 192.0.2.4]" && fmt.Sprint(got) != "[192.0.2.1 192.0.2.3 192.0.2.4]" {
		t.Fatalf("addresses %v, want one of the first answer's and both of the second's", got)
	}
	if a.counter(t, "apiary_fqdn_evicted_ips_total") != 1 {
		t.Fatal("eviction not counted")
	}
	evicted := netip.MustParseAddr("192.0.2.1")
	if got[0] == "192.0.2.1" {
		evicted = netip.MustParseAddr("192.0.2.2")
	}
	testenv.Eventually(t, 10*time.Second, evicted.String()+" out of the ipcache map", func() (bool, string) {
		id, in := a.mapIdentity(t, evicted)
		return !in, fmt.Sprintf("identity %v", id)
	})
}

// With nothing listening at the upstream's address the client gets
// SERVFAIL, over UDP and TCP.
func TestUpstreamDown(t *testing.T) {
	testenv.RequireRoot(t)
	a := startAgent(t, "127.0.0.1:1", "--dns-upstream-timeout=500ms")
	for _, tcp := range []bool{false, true} {
		resp, err := fqdn.Query(a.proxy.Addr(), "www.example.com", dns.TypeA, tcp, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if resp.Rcode != dns.RcodeServerFailure {
			t.Fatalf("tcp=%v: rcode %s, want SERVFAIL", tcp, dns.RcodeToString[resp.Rcode])
		}
	}
}

// A statedb write on fqdn-names that takes long (here: held by the test)
// holds up the answers whose addresses must be labelled, not the proxy:
// other queries are still answered meanwhile, and the held answer comes
// once the write is done.
func TestAnswersWhileNamesAreLocked(t *testing.T) {
	testenv.RequireRoot(t)
	up := startUpstream(t)
	a := startAgent(t, up.addr, "--tofqdns-proxy-response-max-delay=10s")
	up.set(t, "new.example.com", "300 IN A 192.0.2.77")

	wtxn := a.db.WriteTxn(a.names)
	released := false
	defer func() {
		if !released {
			wtxn.Abort()
		}
	}()
	labelled := make(chan error, 1)
	go func() {
		_, err := fqdn.Query(a.proxy.Addr(), "new.example.com", dns.TypeA, false, 10*time.Second)
		labelled <- err
	}()
	// Its answer is on its way to the proxy before the next query's.
	testenv.Eventually(t, 10*time.Second, "the upstream to see the query to label", func() (bool, string) {
		up.mu.Lock()
		defer up.mu.Unlock()
		return up.queries >= 1, fmt.Sprintf("%d queries", up.queries)
	})
	// An answer with nothing to label: NXDOMAIN.
	resp, err := fqdn.Query(a.proxy.Addr(), "unknown.example.org", dns.TypeA, false, 5*time.Second)
	if err != nil {
		t.Fatalf("a query with nothing to label, while fqdn-names is locked: %v", err)
	}
	if resp.Rcode != dns.RcodeNameError {
		t.Fatalf("got %v, want NXDOMAIN", resp)
	}
	select {
	case err := <-labelled:
		t.Fatalf("the answer to label came before fqdn-names could be written (%v)", err)
	default:
	}
	wtxn.Abort()
	released = true
	if err := <-labelled; err != nil {
		t.Fatalf("the answer to label, after the write: %v", err)
	}
	if _, _, found := a.names.Get(a.db.ReadTxn(), tables.FQDNNameIndex.Query("new.example.com")); !found {
		t.Fatal("new.example.com is not in fqdn-names")
	}
}
