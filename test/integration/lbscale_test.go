package integration

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// TestLBScaleBench measures apiary's half of test/cluster's kube-proxy
// benchmark (docs/benchmarks.md, "Side by side with kube-proxy") against
// a real API server with no node around it, so that it needs no cluster
// lock: 10,000 Services × 10 endpoints made through the API server, then
// the agent started cold three times (fresh pin directory each time) and
// timed from its process start until every Service is in lb4_services;
// then a new Service and one endpoint change, each timed from the API
// call until the maps have it. Only with APIARY_BENCH_LB_SCALE=1 (a
// benchmark, minutes long); APIARY_BENCH_SERVICES changes the count.
func TestLBScaleBench(t *testing.T) {
	if os.Getenv("APIARY_BENCH_LB_SCALE") == "" {
		t.Skip("a benchmark: APIARY_BENCH_LB_SCALE=1 runs it")
	}
	services, endpoints, runs, changes := 10000, 10, 3, 5
	if v := os.Getenv("APIARY_BENCH_SERVICES"); v != "" {
		if _, err := fmt.Sscan(v, &services); err != nil || services < 1 {
			t.Fatalf("APIARY_BENCH_SERVICES=%q", v)
		}
	}
	apiserverBin, etcdBin := requireTestbin(t)
	pinRoot := testenv.BPFPinDir(t)
	cgroup := testenv.Cgroup(t)
	ps := newProcs(t)
	c, bin := startInstalledCluster(t, ps, apiserverBin, etcdBin, "--service-cluster-ip-range=10.254.0.0/16")
	agentKubeconfig, _ := c.kubeconfig(t, "apiary-agent")
	cfg := *c.admin
	cfg.QPS, cfg.Burst = 2000, 4000
	cs, err := kubernetes.NewForConfig(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const ns = "bench"
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Logf("load average at the start: %s", loadavg())

	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1) - 1); i < services; i = int(next.Add(1) - 1) {
				if _, _, err := createScaleService(cs, ns, fmt.Sprintf("svc-%05d", i), i*endpoints, endpoints, time.Time{}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("%d Services × %d endpoints created in %s", services, endpoints, time.Since(start).Round(time.Millisecond))
	list, err := cs.CoreV1().Services(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ips := map[[4]byte]bool{}
	byName := map[string]netip.Addr{}
	for _, s := range list.Items {
		a := netip.MustParseAddr(s.Spec.ClusterIP)
		ips[a.As4()] = true
		byName[s.Name] = a
	}

	var initial []time.Duration
	var pin string
	var agent *apiaryProc
	for run := range runs {
		if agent != nil {
			agent.stop(t)
		}
		pin = filepath.Join(pinRoot, fmt.Sprintf("run%d", run))
		t0 := time.Now()
		agent = startApiary(t, ps, fmt.Sprintf("agent %d", run), bin, "agent",
			"--kubeconfig="+agentKubeconfig, "--node-name=bench-node", "--bpf-pin-dir="+pin,
			"--state-dir="+t.TempDir(), "--cgroup-root="+cgroup,
			// 10,000 × (1 + 10) entries: the default 65,536 holds about
			// 5,900 such Services (the rest get a clear error, the
			// agent's health degraded).
			"--bpf-lb-map-max=262144")
		var done time.Time
		testenv.Eventually(t, 10*time.Minute, "every Service in lb4_services", func() (bool, string) {
			m, err := ebpf.LoadPinnedMap(filepath.Join(pin, bpf.LB4ServicesMap), nil)
			if err != nil {
				return false, err.Error()
			}
			defer m.Close()
			got := 0
			err = bpf.Walk(m, 4096, func(keys []bpf.LB4ServiceKey, values []bpf.LB4ServiceValue) error {
				for i, k := range keys {
					if k.Slot == 0 && k.Port.Uint16() == 80 && ips[k.Address] && int(values[i].Count) == endpoints {
						got++
					}
				}
				return nil
			})
			done = time.Now()
			return got == len(ips), fmt.Sprintf("%d of %d (%v)", got, len(ips), err)
		})
		initial = append(initial, done.Sub(t0))
		t.Logf("cold start %d: every Service in the maps %s after the agent's start; load %s", run, done.Sub(t0).Round(time.Millisecond), loadavg())
	}

	services4, err := ebpf.LoadPinnedMap(filepath.Join(pin, bpf.LB4ServicesMap), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer services4.Close()
	backends4, err := ebpf.LoadPinnedMap(filepath.Join(pin, bpf.LB4BackendsMap), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer backends4.Close()
	var newSvc, epChange []time.Duration
	for ch := range changes {
		time.Sleep(2 * time.Second)
		trigger := time.Now()
		ip, _, err := createScaleService(cs, ns, fmt.Sprintf("new-%d", ch), (services+ch)*endpoints, endpoints, trigger)
		if err != nil {
			t.Fatal(err)
		}
		fe := netip.AddrPortFrom(ip, 80)
		newSvc = append(newSvc, pollMaps(t, trigger, func() bool {
			var v bpf.LB4ServiceValue
			return services4.Lookup(bpf.NewLB4ServiceKey(fe, 6, 0), &v) == nil && int(v.Count) == endpoints
		}))
	}
	for ch := range changes {
		time.Sleep(2 * time.Second)
		name := fmt.Sprintf("svc-%05d", (ch*1009+17)%services)
		s, err := cs.DiscoveryV1().EndpointSlices(ns).Get(ctx, name+"-a", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		old := netip.MustParseAddr(s.Endpoints[0].Addresses[0])
		addr := scaleAddr((services+1000+ch)*endpoints + 1)
		s.Endpoints[0].Addresses = []string{addr.String()}
		trigger := time.Now()
		if _, err := cs.DiscoveryV1().EndpointSlices(ns).Update(ctx, s, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		fe := netip.AddrPortFrom(byName[name], 80)
		epChange = append(epChange, pollMaps(t, trigger, func() bool {
			var master bpf.LB4ServiceValue
			if services4.Lookup(bpf.NewLB4ServiceKey(fe, 6, 0), &master) != nil {
				return false
			}
			var addrs []netip.Addr
			for slot := uint16(1); slot <= master.Count; slot++ {
				var sv bpf.LB4ServiceValue
				var bv bpf.LB4BackendValue
				if services4.Lookup(bpf.NewLB4ServiceKey(fe, 6, slot), &sv) == nil && backends4.Lookup(sv.BackendID, &bv) == nil {
					addrs = append(addrs, netip.AddrFrom4(bv.Address))
				}
			}
			return slices.Contains(addrs, addr) && !slices.Contains(addrs, old)
		}))
	}
	t.Logf("apiary at %d × %d: cold start %v; new Service %v; endpoint change %v; load at the end %s",
		services, endpoints, initial, newSvc, epChange, loadavg())
}

// createScaleService makes Service name (one TCP port, no selector) and
// then its EndpointSlice of count ready endpoints from address index
// first on, and returns the cluster IP.
func createScaleService(cs *kubernetes.Clientset, ns, name string, first, count int, trigger time.Time) (netip.Addr, string, error) {
	ctx := context.Background()
	svc, err := cs.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{
			{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP},
		}},
	}, metav1.CreateOptions{})
	if err != nil {
		return netip.Addr{}, "", err
	}
	s := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name + "-a", Namespace: ns, Labels: map[string]string{
			discoveryv1.LabelServiceName: name, discoveryv1.LabelManagedBy: "bench.apiary.test",
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}
	for j := range count {
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{scaleAddr(first + j).String()},
			Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)},
		})
	}
	if !trigger.IsZero() {
		s.Annotations = map[string]string{corev1.EndpointsLastChangeTriggerTime: trigger.Format(time.RFC3339Nano)}
	}
	if _, err := cs.DiscoveryV1().EndpointSlices(ns).Create(ctx, s, metav1.CreateOptions{}); err != nil {
		return netip.Addr{}, "", err
	}
	return netip.MustParseAddr(svc.Spec.ClusterIP), s.Name, nil
}

// scaleAddr is the i-th fake endpoint address from 10.160.0.0.
func scaleAddr(i int) netip.Addr {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], 10<<24|160<<16+uint32(i))
	return netip.AddrFrom4(b)
}

// pollMaps polls cond every millisecond, up to 2 minutes, and returns the
// time from start until it held.
func pollMaps(t *testing.T, start time.Time, cond func() bool) time.Duration {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if cond() {
			return time.Since(start)
		}
	}
	t.Fatal("not in the maps within 2 minutes")
	return 0
}

func loadavg() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return err.Error()
	}
	return string(data[:min(len(data), 14)])
}
