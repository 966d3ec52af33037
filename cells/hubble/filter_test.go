package hubble

import (
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	flowpb "github.com/cilium/cilium/api/v1/flow"
	"github.com/cilium/statedb"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/cells/policy"
	"github.com/apiary-net/apiary/cells/socketlb"
	"github.com/apiary-net/apiary/tables"
)

// endpointsWith returns a database whose endpoints table holds eps.
func endpointsWith(t *testing.T, eps ...*tables.Endpoint) (*statedb.DB, statedb.Table[*tables.Endpoint]) {
	t.Helper()
	db := statedb.New()
	tbl, err := tables.NewEndpointsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	wtxn := db.WriteTxn(tbl)
	for _, ep := range eps {
		if _, _, err := tbl.Insert(wtxn, ep); err != nil {
			t.Fatal(err)
		}
	}
	wtxn.Commit()
	return db, tbl
}

// testFlows are flows as the converter makes them from verdicts.
func testFlows(t *testing.T) map[string]*flowpb.Flow {
	t.Helper()
	// shop/web-1 is a pod of this node, of the Deployment web.
	db, eps := endpointsWith(t, &tables.Endpoint{Name: "shop/web-1", IPs: []netip.Addr{netip.MustParseAddr("10.0.0.5")},
		Labels: tables.Labels{"k8s:app=web"}, Identity: 1000, Workload: &tables.Workload{Kind: "Deployment", Name: "web"}})
	c := newConverter("node-1", db, eps, nil, lbTables{})
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	out := map[string]*flowpb.Flow{}
	one := func(v policy.Verdict) *flowpb.Flow {
		fs := c.flows(v)
		if len(fs) != 1 {
			t.Fatalf("%+v: %d flows", v, len(fs))
		}
		return fs[0]
	}
	out["allowed"] = one(policy.Verdict{Time: now, Type: policy.VerdictTypePolicy, Endpoint: "shop/web-1", Direction: "egress",
		Src: "10.0.0.5:40000", Dst: "10.0.0.9:8080", Proto: "TCP", RemoteIdentity: 300,
		RemoteLabels: []string{"k8s:app=db", namespaceLabel + "=data"}, Verdict: policy.VerdictAllowed,
		Policy: "cnp/shop/web", Reason: policy.ReasonPolicy, Layer: policy.LayerSocket})
	out["denied"] = one(policy.Verdict{Time: now, Type: policy.VerdictTypePolicy, Endpoint: "shop/web-1", Direction: "ingress",
		Src: "192.168.1.1:5000", Dst: "10.0.0.5:22", Proto: "UDP", RemoteIdentity: 2,
		RemoteLabels: []string{"reserved:world"}, Verdict: policy.VerdictDenied, Reason: policy.ReasonDefaultDeny, Layer: policy.LayerSocket})
	out["spoofed"] = one(policy.Verdict{Time: now, Type: policy.VerdictTypePolicy, Endpoint: "default/other", Direction: "egress",
		Src: "10.9.9.9:1", Dst: "10.0.0.1:53", Proto: "UDP", Verdict: policy.VerdictDenied,
		Reason: policy.ReasonSpoofed, Layer: policy.LayerInterface})
	dns := c.flows(policy.Verdict{Time: now, Type: policy.VerdictTypeDNS, Endpoint: "shop/web-1", Direction: "egress",
		Src: "10.0.0.5:3333", Dst: "10.96.0.10:53", Proto: "UDP", Verdict: policy.VerdictAllowed, Policy: "ccnp/dns",
		DNS: &policy.DNSVerdict{Query: "www.example.com.", QType: "A", Answers: []string{"1.2.3.4"}, RCode: "NOERROR", LatencyMs: 2}})
	if len(dns) != 2 {
		t.Fatalf("an answered DNS verdict: %d flows, want the query and its answer", len(dns))
	}
	out["dns-query"], out["dns-answer"] = dns[0], dns[1]
	return out
}

func TestConverter(t *testing.T) {
	fs := testFlows(t)
	a := fs["allowed"]
	if a.GetSource().GetPodName() != "web-1" || a.GetSource().GetNamespace() != "shop" ||
		a.GetDestination().GetNamespace() != "data" || a.GetDestination().GetIdentity() != 300 ||
		a.GetVerdict() != flowpb.Verdict_FORWARDED || a.GetEventType().GetType() != eventTypePolicyVerdict ||
		a.GetEgressAllowedBy()[0].GetKind() != "CiliumNetworkPolicy" || a.GetEgressAllowedBy()[0].GetName() != "web" ||
		a.GetNodeName() != "node-1" || a.GetL4().GetTCP().GetDestinationPort() != 8080 ||
		a.GetSource().GetIdentity() != 1000 || len(a.GetSource().GetWorkloads()) != 1 ||
		a.GetSource().GetWorkloads()[0].GetKind() != "Deployment" || a.GetSource().GetWorkloads()[0].GetName() != "web" ||
		a.GetDestination().GetWorkloads() != nil {
		t.Errorf("allowed: %v", a)
	}
	if d := fs["denied"]; d.GetDestination().GetPodName() != "web-1" || d.GetDropReasonDesc() != flowpb.DropReason_POLICY_DENIED ||
		d.GetTrafficDirection() != flowpb.TrafficDirection_INGRESS || d.GetIngressDeniedBy() != nil {
		t.Errorf("denied: %v", d)
	}
	if s := fs["spoofed"]; s.GetEventType().GetType() != eventTypeDrop || s.GetDropReasonDesc() != flowpb.DropReason_INVALID_SOURCE_IP {
		t.Errorf("spoofed: %v", s)
	}
	q, ans := fs["dns-query"], fs["dns-answer"]
	if q.GetL7().GetType() != flowpb.L7FlowType_REQUEST || q.GetL7().GetDns().GetQuery() != "www.example.com." ||
		q.GetSource().GetPodName() != "web-1" || !q.GetTime().AsTime().Before(ans.GetTime().AsTime()) {
		t.Errorf("query: %v", q)
	}
	if ans.GetL7().GetType() != flowpb.L7FlowType_RESPONSE || ans.GetL7().GetDns().GetRcode() != 0 ||
		ans.GetL7().GetDns().GetIps()[0] != "1.2.3.4" || ans.GetDestination().GetPodName() != "web-1" ||
		!ans.GetIsReply().GetValue() || ans.GetL4().GetUDP().GetSourcePort() != 53 || ans.GetL7().GetLatencyNs() != 2e6 {
		t.Errorf("answer: %v", ans)
	}
}

func TestFilters(t *testing.T) {
	fs := testFlows(t)
	for _, tc := range []struct {
		name   string
		filter *flowpb.FlowFilter
		want   []string // the flows it matches
		err    bool
	}{
		{"empty", &flowpb.FlowFilter{}, []string{"allowed", "denied", "spoofed", "dns-query", "dns-answer"}, false},
		{"namespace as the CLI sends it", &flowpb.FlowFilter{SourcePod: []string{"shop/"}}, []string{"allowed", "dns-query"}, false},
		{"pod prefix", &flowpb.FlowFilter{DestinationPod: []string{"shop/web"}}, []string{"denied", "dns-answer"}, false},
		{"pod without namespace is default", &flowpb.FlowFilter{SourcePod: []string{"other"}}, []string{"spoofed"}, false},
		{"verdict", &flowpb.FlowFilter{Verdict: []flowpb.Verdict{flowpb.Verdict_DROPPED}}, []string{"denied", "spoofed"}, false},
		{"drop reason", &flowpb.FlowFilter{DropReasonDesc: []flowpb.DropReason{flowpb.DropReason_INVALID_SOURCE_IP}}, []string{"spoofed"}, false},
		{"event type", &flowpb.FlowFilter{EventType: []*flowpb.EventTypeFilter{{Type: eventTypePolicyVerdict}}}, []string{"allowed", "denied"}, false},
		{"event subtype", &flowpb.FlowFilter{EventType: []*flowpb.EventTypeFilter{{Type: eventTypeDrop, MatchSubType: true, SubType: 132}}}, []string{"spoofed"}, false},
		{"protocol", &flowpb.FlowFilter{Protocol: []string{"UDP"}}, []string{"denied", "spoofed", "dns-query", "dns-answer"}, false},
		{"protocol dns", &flowpb.FlowFilter{Protocol: []string{"dns"}}, []string{"dns-query", "dns-answer"}, false},
		{"unknown protocol", &flowpb.FlowFilter{Protocol: []string{"gopher"}}, nil, true},
		{"source CIDR", &flowpb.FlowFilter{SourceIp: []string{"10.0.0.0/24"}}, []string{"allowed", "dns-query"}, false},
		{"destination IP", &flowpb.FlowFilter{DestinationIp: []string{"10.0.0.5"}}, []string{"denied", "dns-answer"}, false},
		{"bad IP", &flowpb.FlowFilter{DestinationIp: []string{"10.0.0.300"}}, nil, true},
		{"port", &flowpb.FlowFilter{DestinationPort: []string{"53"}}, []string{"spoofed", "dns-query"}, false},
		{"bad port", &flowpb.FlowFilter{DestinationPort: []string{"http"}}, nil, true},
		{"label", &flowpb.FlowFilter{DestinationLabel: []string{"app=db"}}, []string{"allowed"}, false},
		{"label with source", &flowpb.FlowFilter{SourceLabel: []string{"reserved:world"}}, []string{"denied"}, false},
		{"label not", &flowpb.FlowFilter{DestinationLabel: []string{"app!=db"}}, []string{"denied", "spoofed", "dns-query", "dns-answer"}, false},
		{"identity", &flowpb.FlowFilter{SourceIdentity: []uint32{2}}, []string{"denied"}, false},
		{"direction", &flowpb.FlowFilter{TrafficDirection: []flowpb.TrafficDirection{flowpb.TrafficDirection_INGRESS}}, []string{"denied"}, false},
		{"reply", &flowpb.FlowFilter{Reply: []bool{true}}, []string{"dns-answer"}, false},
		{"node name", &flowpb.FlowFilter{NodeName: []string{"default/node-*"}}, []string{"allowed", "denied", "spoofed", "dns-query", "dns-answer"}, false},
		{"other node", &flowpb.FlowFilter{NodeName: []string{"node-2"}}, nil, false},
		{"fields AND", &flowpb.FlowFilter{SourcePod: []string{"shop/"}, Protocol: []string{"tcp"}}, []string{"allowed"}, false},
		{"http matches nothing", &flowpb.FlowFilter{HttpMethod: []string{"GET"}}, nil, false},
		{"service", &flowpb.FlowFilter{DestinationService: []string{"kube-system/kube"}}, nil, false},
		{"workload", &flowpb.FlowFilter{SourceWorkload: []*flowpb.Workload{{Kind: "Deployment", Name: "web"}}}, []string{"allowed", "dns-query"}, false},
		{"workload by name", &flowpb.FlowFilter{DestinationWorkload: []*flowpb.Workload{{Name: "web"}}}, []string{"denied", "dns-answer"}, false},
		{"workload by kind", &flowpb.FlowFilter{SourceWorkload: []*flowpb.Workload{{Kind: "Deployment"}}}, []string{"allowed", "dns-query"}, false},
		{"other workload", &flowpb.FlowFilter{SourceWorkload: []*flowpb.Workload{{Kind: "DaemonSet", Name: "web"}, {Name: "api"}}}, nil, false},
		{"interface unsupported", &flowpb.FlowFilter{Interface: []*flowpb.NetworkInterface{{Name: "eth0"}}}, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := compileFilter(tc.filter)
			if (err != nil) != tc.err {
				t.Fatalf("error %v, want one: %t", err, tc.err)
			}
			if err != nil {
				return
			}
			var got []string
			for _, name := range []string{"allowed", "denied", "spoofed", "dns-query", "dns-answer"} {
				if m(fs[name]) {
					got = append(got, name)
				}
			}
			if len(got) != len(tc.want) {
				t.Fatalf("matched %v, want %v", got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Fatalf("matched %v, want %v", got, tc.want)
				}
			}
		})
	}
}

func TestFQDNFilter(t *testing.T) {
	f := &flowpb.Flow{DestinationNames: []string{"api.example.com"}}
	for pat, want := range map[string]bool{"*.example.com": true, "api.example.com.": true, "*.other.com": false} {
		m, err := compileFilter(&flowpb.FlowFilter{DestinationFqdn: []string{pat}})
		if err != nil {
			t.Fatal(err)
		}
		if m(f) != want {
			t.Errorf("%s: %t, want %t", pat, m(f), want)
		}
	}
}

// TestServiceFlows: a flow names the Service of its destination as the
// address the pod asked for (the frontend, without the socket LB) or the
// one the socket LB translated it to (a backend), in destination_service,
// and a reply's source as source_service; an address of no Service, or
// another port or protocol of a frontend's address, names none.
func TestServiceFlows(t *testing.T) {
	db, eps := endpointsWith(t)
	fes, err := tables.NewFrontendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	bes, err := tables.NewBackendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	web := tables.ServiceName{Namespace: "shop", Name: "web"}
	wtxn := db.WriteTxn(fes, bes)
	if _, _, err := fes.Insert(wtxn, &tables.Frontend{Address: tables.L4Addr{Addr: netip.MustParseAddr("10.96.0.80"), Port: 80, Proto: tables.TCP}, Service: web}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := bes.Insert(wtxn, &tables.Backend{Address: tables.L4Addr{Addr: netip.MustParseAddr("10.0.0.9"), Port: 8080, Proto: tables.TCP},
		Services: []tables.BackendInstance{{Service: web, Slice: "web-1"}}}); err != nil {
		t.Fatal(err)
	}
	wtxn.Commit()
	c := newConverter("node-1", db, eps, nil, lbTables{fes, bes})
	for _, tc := range []struct {
		name, dir, src, dst, proto string
		wantDst, wantSrc           string
	}{
		{"to the frontend", "egress", "10.0.0.5:40000", "10.96.0.80:80", "TCP", "shop/web", ""},
		{"to a backend", "egress", "10.0.0.5:40000", "10.0.0.9:8080", "TCP", "shop/web", ""},
		{"a backend's reply", "ingress", "10.0.0.9:8080", "10.0.0.5:40000", "TCP", "", "shop/web"},
		{"another port of the frontend", "egress", "10.0.0.5:40000", "10.96.0.80:81", "TCP", "", ""},
		{"another protocol", "egress", "10.0.0.5:40000", "10.96.0.80:80", "UDP", "", ""},
		{"no service", "egress", "10.0.0.5:40000", "10.0.0.7:8080", "TCP", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := c.flows(policy.Verdict{Time: time.Now(), Type: policy.VerdictTypePolicy, Endpoint: "shop/client", Direction: tc.dir,
				Src: tc.src, Dst: tc.dst, Proto: tc.proto, Verdict: policy.VerdictAllowed, Layer: policy.LayerSocket})
			name := func(s *flowpb.Service) string {
				if s == nil {
					return ""
				}
				return s.GetNamespace() + "/" + s.GetName()
			}
			if got := name(fs[0].GetDestinationService()); got != tc.wantDst {
				t.Errorf("destination_service %q, want %q", got, tc.wantDst)
			}
			if got := name(fs[0].GetSourceService()); got != tc.wantSrc {
				t.Errorf("source_service %q, want %q", got, tc.wantSrc)
			}
		})
	}
}

// TestRemotePodNamed: a peer that is a pod of another node is named by
// its address's owner in the ipcache, so that `hubble observe --pod`
// finds both ends of a cross-node flow; an address no pod owns keeps the
// identity the datapath saw and no pod name.
func TestRemotePodNamed(t *testing.T) {
	db, eps := endpointsWith(t, &tables.Endpoint{Name: "shop/web-1", IPs: []netip.Addr{netip.MustParseAddr("10.0.0.5")}, Identity: 1000})
	ipc, err := tables.NewIPCacheTable(db)
	if err != nil {
		t.Fatal(err)
	}
	wtxn := db.WriteTxn(ipc)
	for _, e := range []*tables.IPCacheEntry{
		{Prefix: netip.MustParsePrefix("10.0.1.7/32"), Identity: 300, Labels: tables.Labels{"k8s:app=db"}, Owners: []string{tables.PodOwner("data", "db-0")}},
		{Prefix: netip.MustParsePrefix("192.168.1.11/32"), Identity: 6, Labels: tables.Labels{"reserved:remote-node"}, Owners: []string{"node"}},
	} {
		if _, _, err := ipc.Insert(wtxn, e); err != nil {
			t.Fatal(err)
		}
	}
	wtxn.Commit()
	c := newConverter("node-1", db, eps, nil, lbTables{})
	c.ipcache = ipc
	for _, tc := range []struct {
		name, dst       string
		id              uint32
		wantNS, wantPod string
		wantIdentity    uint32
	}{
		{"a pod of another node", "10.0.1.7:5432", 300, "data", "db-0", 300},
		{"its identity unknown to the datapath", "10.0.1.7:5432", 0, "data", "db-0", 300},
		{"another node", "192.168.1.11:10250", 6, "", "", 6},
		{"no entry", "203.0.113.1:443", 2, "", "", 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := c.flows(policy.Verdict{Time: time.Now(), Type: policy.VerdictTypePolicy, Endpoint: "shop/web-1", Direction: "egress",
				Src: "10.0.0.5:40000", Dst: tc.dst, Proto: "TCP", RemoteIdentity: tc.id, Verdict: policy.VerdictAllowed, Layer: policy.LayerSocket})
			d := fs[0].GetDestination()
			if d.GetNamespace() != tc.wantNS || d.GetPodName() != tc.wantPod || d.GetIdentity() != tc.wantIdentity {
				t.Errorf("destination %v, want %s/%s identity %d", d, tc.wantNS, tc.wantPod, tc.wantIdentity)
			}
		})
	}
}

// TestXlateFlows: a socket LB translation of a pod's socket is the
// reference's two trace-sock flows, to the frontend (TRACED) and to the
// backend (TRANSLATED), each naming the Service; one of a socket in no
// pod's cgroup is none.
func TestXlateFlows(t *testing.T) {
	db, eps := endpointsWith(t, &tables.Endpoint{Name: "shop/client", IPs: []netip.Addr{netip.MustParseAddr("10.0.0.5")},
		Identity: 1000, CgroupID: 77})
	fes, err := tables.NewFrontendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	bes, err := tables.NewBackendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	web := tables.ServiceName{Namespace: "shop", Name: "web"}
	wtxn := db.WriteTxn(fes)
	if _, _, err := fes.Insert(wtxn, &tables.Frontend{Address: tables.L4Addr{Addr: netip.MustParseAddr("10.96.0.80"), Port: 80, Proto: tables.TCP}, Service: web}); err != nil {
		t.Fatal(err)
	}
	wtxn.Commit()
	c := newConverter("node-1", db, eps, nil, lbTables{fes, bes})
	now := time.Now()
	tr := socketlb.Translation{Time: now, CgroupID: 77, SockCookie: 4242, Proto: "TCP",
		Frontend: netip.MustParseAddrPort("10.96.0.80:80"), Backend: netip.MustParseAddrPort("10.0.0.9:8080")}
	fs := c.xlateFlows(tr)
	if len(fs) != 2 {
		t.Fatalf("%d flows, want 2", len(fs))
	}
	for i, want := range []struct {
		point   flowpb.SocketTranslationPoint
		verdict flowpb.Verdict
		dst     string
		port    uint32
	}{
		{flowpb.SocketTranslationPoint_SOCK_XLATE_POINT_PRE_DIRECTION_FWD, flowpb.Verdict_TRACED, "10.96.0.80", 80},
		{flowpb.SocketTranslationPoint_SOCK_XLATE_POINT_POST_DIRECTION_FWD, flowpb.Verdict_TRANSLATED, "10.0.0.9", 8080},
	} {
		f := fs[i]
		if f.GetSockXlatePoint() != want.point || f.GetVerdict() != want.verdict || f.GetType() != flowpb.FlowType_SOCK ||
			f.GetEventType().GetType() != eventTypeTraceSock || f.GetEventType().GetSubType() != int32(want.point) ||
			f.GetIP().GetSource() != "10.0.0.5" || f.GetIP().GetDestination() != want.dst ||
			f.GetL4().GetTCP().GetDestinationPort() != want.port || f.GetSource().GetPodName() != "client" ||
			f.GetSource().GetIdentity() != 1000 || f.GetSocketCookie() != 4242 || f.GetCgroupId() != 77 ||
			f.GetDestinationService().GetName() != "web" || !f.GetTime().AsTime().Equal(now) || f.GetNodeName() != "node-1" {
			t.Errorf("flow %d: %v", i, f)
		}
	}
	// The pre-translation flow is the one a filter by the frontend finds.
	m, err := compileFilter(&flowpb.FlowFilter{DestinationIp: []string{"10.96.0.80"}, EventType: []*flowpb.EventTypeFilter{{Type: eventTypeTraceSock}}})
	if err != nil {
		t.Fatal(err)
	}
	if !m(fs[0]) || m(fs[1]) {
		t.Errorf("--to-ip frontend --type trace-sock: %t %t", m(fs[0]), m(fs[1]))
	}
	tr.CgroupID = 78
	if fs := c.xlateFlows(tr); len(fs) != 0 {
		t.Errorf("a socket of no pod: %v", fs)
	}

	// A socket of a container of the pod: its cgroup is a child of the
	// pod's, as the kubelet lays them out.
	root := t.TempDir()
	ctr := filepath.Join(root, "kubepods", "podabc", "ctr1")
	if err := os.MkdirAll(ctr, 0o755); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(ctr, &st); err != nil {
		t.Fatal(err)
	}
	db2, eps2 := endpointsWith(t, &tables.Endpoint{Name: "shop/client", IPs: []netip.Addr{netip.MustParseAddr("10.0.0.5")},
		Cgroup: "kubepods/podabc", CgroupID: 77})
	c2 := newConverter("node-1", db2, eps2, nil, lbTables{})
	c2.cgroupRoot = root
	tr.CgroupID = st.Ino
	if fs := c2.xlateFlows(tr); len(fs) != 2 || fs[0].GetSource().GetPodName() != "client" {
		t.Errorf("a socket of the pod's container: %v", fs)
	}
}
