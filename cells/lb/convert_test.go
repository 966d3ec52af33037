package lb

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/statedb"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/apiary-net/apiary/tables"
)

func TestEndpointState(t *testing.T) {
	yes, no := new(bool), new(bool)
	*yes = true
	tests := []struct {
		name                        string
		ready, serving, terminating *bool
		want                        tables.BackendState
	}{
		{name: "all unset", want: tables.BackendActive},
		{name: "ready", ready: yes, want: tables.BackendActive},
		{name: "ready and serving", ready: yes, serving: yes, want: tables.BackendActive},
		{name: "ready and terminating (publishNotReadyAddresses)", ready: yes, serving: yes, terminating: yes, want: tables.BackendActive},
		{name: "ready and terminating, serving unset", ready: yes, terminating: yes, want: tables.BackendActive},
		{name: "ready unset and terminating", terminating: yes, want: tables.BackendActive},
		{name: "terminating and serving", ready: no, serving: yes, terminating: yes, want: tables.BackendTerminating},
		{name: "terminating, not serving", ready: no, serving: no, terminating: yes, want: tables.BackendNotServing},
		{name: "not ready", ready: no, want: tables.BackendNotServing},
		{name: "not ready but serving, not terminating", ready: no, serving: yes, terminating: no, want: tables.BackendNotServing},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := endpointState(discoveryv1.EndpointConditions{Ready: tt.ready, Serving: tt.serving, Terminating: tt.terminating})
			if got != tt.want {
				t.Errorf("endpointState = %v, want %v", got, tt.want)
			}
		})
	}
}

// frontendSummary is what the tests compare of a frontend.
type frontendSummary struct {
	addr     string
	typ      tables.FrontendType
	affinity uint32
}

func summarise(fes []*tables.Frontend) []frontendSummary {
	var out []frontendSummary
	for _, fe := range fes {
		out = append(out, frontendSummary{fe.Address.String(), fe.Type, fe.SessionAffinity})
	}
	return out
}

func TestServiceFrontends(t *testing.T) {
	proxy, vip := corev1.LoadBalancerIPModeProxy, corev1.LoadBalancerIPModeVIP
	local := corev1.ServiceInternalTrafficPolicyLocal
	nodeIPs := []netip.Addr{netip.MustParseAddr("192.168.1.10"), netip.MustParseAddr("192.168.1.11"), netip.MustParseAddr("fd00:1::10")}
	svc := func(typ corev1.ServiceType, labels map[string]string, mod func(*corev1.Service)) *corev1.Service {
		s := &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web", Labels: labels},
			Spec: corev1.ServiceSpec{
				Type:      typ,
				ClusterIP: "10.96.0.10",
				Ports:     []corev1.ServicePort{{Name: "http", Port: 80, NodePort: 30080}},
			},
		}
		if mod != nil {
			mod(s)
		}
		return s
	}
	dualStack := func(families ...corev1.IPFamily) func(*corev1.Service) {
		return func(s *corev1.Service) {
			s.Spec.ClusterIPs = []string{"10.96.0.10", "fd00::10"}
			if len(families) > 0 && families[0] == corev1.IPv6Protocol {
				s.Spec.ClusterIPs = []string{"fd00::10", "10.96.0.10"}
			}
			s.Spec.ClusterIP = s.Spec.ClusterIPs[0]
			s.Spec.IPFamilies = families
		}
	}
	affinity := func(timeout *int32) func(*corev1.Service) {
		return func(s *corev1.Service) {
			s.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
			if timeout != nil {
				s.Spec.SessionAffinityConfig = &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: timeout}}
			}
		}
	}
	clusterIP := frontendSummary{"10.96.0.10:80/TCP", tables.FrontendClusterIP, 0}
	tests := []struct {
		name         string
		svc          *corev1.Service
		want         []frontendSummary
		wantErrors   int
		wantExt      tables.TrafficPolicy
		wantInt      tables.TrafficPolicy
		wantAffinity uint32
		wantHCPort   uint16
	}{
		{
			name: "ClusterIP ignores a stale nodePort",
			svc:  svc(corev1.ServiceTypeClusterIP, nil, nil),
			want: []frontendSummary{clusterIP},
		},
		{
			name: "headless label, any value",
			svc:  svc(corev1.ServiceTypeClusterIP, map[string]string{corev1.IsHeadlessService: ""}, nil),
		},
		{
			name: "headless label on a NodePort service",
			svc:  svc(corev1.ServiceTypeNodePort, map[string]string{corev1.IsHeadlessService: "yes"}, nil),
		},
		{
			name: "clusterIP None",
			svc:  svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) { s.Spec.ClusterIP = corev1.ClusterIPNone }),
		},
		{
			name: "no valid port: no frontend",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.Ports[0].Protocol = "ICMP"
			}),
			wantErrors: 1,
		},
		{
			name: "NodePort: one frontend per node address of the service's family",
			svc:  svc(corev1.ServiceTypeNodePort, nil, nil),
			want: []frontendSummary{
				clusterIP,
				{"192.168.1.10:30080/TCP", tables.FrontendNodePort, 0},
				{"192.168.1.11:30080/TCP", tables.FrontendNodePort, 0},
			},
		},
		{
			name: "NodePort without a nodePort on a port",
			svc:  svc(corev1.ServiceTypeNodePort, nil, func(s *corev1.Service) { s.Spec.Ports[0].NodePort = 0 }),
			want: []frontendSummary{clusterIP},
		},
		{
			name:       "nodePort below --node-port-range",
			svc:        svc(corev1.ServiceTypeNodePort, nil, func(s *corev1.Service) { s.Spec.Ports[0].NodePort = 29999 }),
			want:       []frontendSummary{clusterIP},
			wantErrors: 1,
		},
		{
			name:       "nodePort out of range",
			svc:        svc(corev1.ServiceTypeNodePort, nil, func(s *corev1.Service) { s.Spec.Ports[0].NodePort = 70000 }),
			want:       []frontendSummary{clusterIP},
			wantErrors: 1,
		},
		{
			name: "LoadBalancer: ipMode Proxy is not a VIP",
			svc: svc(corev1.ServiceTypeLoadBalancer, nil, func(s *corev1.Service) {
				s.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{
					{IP: "203.0.113.1"},
					{IP: "203.0.113.2", IPMode: &vip},
					{IP: "203.0.113.3", IPMode: &proxy},
					{Hostname: "lb.example.com"},
				}
			}),
			want: []frontendSummary{
				clusterIP,
				{"203.0.113.1:80/TCP", tables.FrontendLoadBalancer, 0},
				{"203.0.113.2:80/TCP", tables.FrontendLoadBalancer, 0},
				{"192.168.1.10:30080/TCP", tables.FrontendNodePort, 0},
				{"192.168.1.11:30080/TCP", tables.FrontendNodePort, 0},
			},
		},
		{
			name: "a load-balancer IP that is also an external IP is one, of the first type",
			svc: svc(corev1.ServiceTypeLoadBalancer, nil, func(s *corev1.Service) {
				s.Spec.Ports[0].NodePort = 0
				s.Spec.ExternalIPs = []string{"203.0.113.1", "2001:db8::1"}
				s.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{
					{IP: "203.0.113.1"}, {IP: "192.168.1.10"}, {IP: "2001:db8::2"},
				}
			}),
			want: []frontendSummary{
				clusterIP,
				{"203.0.113.1:80/TCP", tables.FrontendExternalIP, 0},
				{"[2001:db8::1]:80/TCP", tables.FrontendExternalIP, 0},
				{"192.168.1.10:80/TCP", tables.FrontendLoadBalancer, 0},
				{"[2001:db8::2]:80/TCP", tables.FrontendLoadBalancer, 0},
			},
		},
		{
			name: "an external IP equal to a node address and port keeps its type",
			svc: svc(corev1.ServiceTypeNodePort, nil, func(s *corev1.Service) {
				s.Spec.ExternalIPs = []string{"192.168.1.10"}
				s.Spec.Ports[0].Port = 30080
			}),
			want: []frontendSummary{
				{"10.96.0.10:30080/TCP", tables.FrontendClusterIP, 0},
				{"192.168.1.10:30080/TCP", tables.FrontendExternalIP, 0},
				{"192.168.1.11:30080/TCP", tables.FrontendNodePort, 0},
			},
		},
		{
			name: "dual stack, IPv4 first: both families, node ports on both",
			svc:  svc(corev1.ServiceTypeNodePort, nil, dualStack(corev1.IPv4Protocol, corev1.IPv6Protocol)),
			want: []frontendSummary{
				clusterIP,
				{"[fd00::10]:80/TCP", tables.FrontendClusterIP, 0},
				{"192.168.1.10:30080/TCP", tables.FrontendNodePort, 0},
				{"192.168.1.11:30080/TCP", tables.FrontendNodePort, 0},
				{"[fd00:1::10]:30080/TCP", tables.FrontendNodePort, 0},
			},
		},
		{
			name: "dual stack, IPv6 first",
			svc:  svc(corev1.ServiceTypeClusterIP, nil, dualStack(corev1.IPv6Protocol, corev1.IPv4Protocol)),
			want: []frontendSummary{
				{"[fd00::10]:80/TCP", tables.FrontendClusterIP, 0},
				clusterIP,
			},
		},
		{
			name: "dual stack without ipFamilies",
			svc:  svc(corev1.ServiceTypeClusterIP, nil, dualStack()),
			want: []frontendSummary{
				clusterIP,
				{"[fd00::10]:80/TCP", tables.FrontendClusterIP, 0},
			},
		},
		{
			name: "IPv6 only: node ports on the IPv6 node address only",
			svc: svc(corev1.ServiceTypeNodePort, nil, func(s *corev1.Service) {
				s.Spec.ClusterIP, s.Spec.ClusterIPs = "fd00::20", []string{"fd00::20"}
				s.Spec.IPFamilies = []corev1.IPFamily{corev1.IPv6Protocol}
			}),
			want: []frontendSummary{
				{"[fd00::20]:80/TCP", tables.FrontendClusterIP, 0},
				{"[fd00:1::10]:30080/TCP", tables.FrontendNodePort, 0},
			},
		},
		{
			name: "a cluster IP of another family than ipFamilies says is left out",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				dualStack(corev1.IPv4Protocol, corev1.IPv4Protocol)(s)
			}),
			want:       []frontendSummary{clusterIP},
			wantErrors: 1,
		},
		{
			name: "a second cluster IP of one family is left out",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.ClusterIPs = []string{"10.96.0.10", "10.96.0.11"}
			}),
			want:       []frontendSummary{clusterIP},
			wantErrors: 1,
		},
		{
			name: "IPv4-mapped addresses are IPv4; zoned and invalid ones are errors",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.ClusterIPs = []string{"::ffff:10.96.0.10"}
				s.Spec.ExternalIPs = []string{"fe80::1%eth0", "bogus"}
			}),
			want:       []frontendSummary{clusterIP},
			wantErrors: 2,
		},
		{
			name:         "session affinity ClientIP: default timeout, on every frontend",
			svc:          svc(corev1.ServiceTypeNodePort, nil, affinity(nil)),
			wantAffinity: 10800,
			want: []frontendSummary{
				{"10.96.0.10:80/TCP", tables.FrontendClusterIP, 10800},
				{"192.168.1.10:30080/TCP", tables.FrontendNodePort, 10800},
				{"192.168.1.11:30080/TCP", tables.FrontendNodePort, 10800},
			},
		},
		{
			name:         "session affinity with a timeout",
			svc:          svc(corev1.ServiceTypeClusterIP, nil, affinity(ptr.To[int32](60))),
			wantAffinity: 60,
			want:         []frontendSummary{{"10.96.0.10:80/TCP", tables.FrontendClusterIP, 60}},
		},
		{
			name:         "session affinity timeout of a day",
			svc:          svc(corev1.ServiceTypeClusterIP, nil, affinity(ptr.To[int32](86400))),
			wantAffinity: 86400,
			want:         []frontendSummary{{"10.96.0.10:80/TCP", tables.FrontendClusterIP, 86400}},
		},
		{
			name:         "session affinity timeout 0 is invalid: the default is used",
			svc:          svc(corev1.ServiceTypeClusterIP, nil, affinity(ptr.To[int32](0))),
			wantAffinity: 10800,
			want:         []frontendSummary{{"10.96.0.10:80/TCP", tables.FrontendClusterIP, 10800}},
			wantErrors:   1,
		},
		{
			name:         "session affinity timeout over a day is invalid: the default is used",
			svc:          svc(corev1.ServiceTypeClusterIP, nil, affinity(ptr.To[int32](86401))),
			wantAffinity: 10800,
			want:         []frontendSummary{{"10.96.0.10:80/TCP", tables.FrontendClusterIP, 10800}},
			wantErrors:   1,
		},
		{
			name: "session affinity None ignores a config",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				affinity(ptr.To[int32](60))(s)
				s.Spec.SessionAffinity = corev1.ServiceAffinityNone
			}),
			want: []frontendSummary{clusterIP},
		},
		{
			name: "unknown session affinity means None",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.SessionAffinity = "Cookie"
			}),
			want:       []frontendSummary{clusterIP},
			wantErrors: 1,
		},
		{
			name: "traffic policies",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
				s.Spec.InternalTrafficPolicy = &local
			}),
			want:    []frontendSummary{clusterIP},
			wantExt: tables.TrafficPolicyLocal,
			wantInt: tables.TrafficPolicyLocal,
		},
		{
			name: "health check node port with Local",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 31000
			}),
			want:       []frontendSummary{clusterIP},
			wantExt:    tables.TrafficPolicyLocal,
			wantHCPort: 31000,
		},
		{
			name: "health check node port without Local is ignored",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.HealthCheckNodePort = 31000
			}),
			want:       []frontendSummary{clusterIP},
			wantErrors: 1,
		},
		{
			name: "health check node port out of range",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 70000
			}),
			want:       []frontendSummary{clusterIP},
			wantExt:    tables.TrafficPolicyLocal,
			wantErrors: 1,
		},
		{
			name: "unknown traffic policy means Cluster",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.ExternalTrafficPolicy = "Nearby"
			}),
			want:       []frontendSummary{clusterIP},
			wantErrors: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := serviceFromK8s(tt.svc, defaultNodePortRange)
			if len(s.Errors) != tt.wantErrors {
				t.Errorf("errors = %q, want %d", s.Errors, tt.wantErrors)
			}
			if s.ExternalTrafficPolicy != tt.wantExt || s.InternalTrafficPolicy != tt.wantInt {
				t.Errorf("policies = %q/%q, want %q/%q", s.ExternalTrafficPolicy, s.InternalTrafficPolicy, tt.wantExt, tt.wantInt)
			}
			if s.HealthCheckNodePort != tt.wantHCPort {
				t.Errorf("health check node port = %d, want %d", s.HealthCheckNodePort, tt.wantHCPort)
			}
			if s.SessionAffinityTimeout != tt.wantAffinity {
				t.Errorf("session affinity timeout = %d, want %d", s.SessionAffinityTimeout, tt.wantAffinity)
			}
			if got := summarise(desiredFrontends(s, nodeIPs)); !slices.Equal(got, tt.want) {
				t.Errorf("frontends = %v, want %v", got, tt.want)
			}
			// Without node addresses, no NodePort frontends.
			for _, fe := range desiredFrontends(s, nil) {
				if fe.Type == tables.FrontendNodePort {
					t.Errorf("NodePort frontend %s without node addresses", fe.Address)
				}
			}
		})
	}
}

func TestSliceFromK8s(t *testing.T) {
	slice := func(typ discoveryv1.AddressType, addrs ...string) *discoveryv1.EndpointSlice {
		s := &discoveryv1.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web-1",
				Labels: map[string]string{discoveryv1.LabelServiceName: "web"}},
			AddressType: typ,
			Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080)}},
		}
		for _, a := range addrs {
			s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{a}})
		}
		return s
	}
	tests := []struct {
		name       string
		slice      *discoveryv1.EndpointSlice
		want       []string
		wantErrors int
	}{
		{name: "IPv4", slice: slice(discoveryv1.AddressTypeIPv4, "10.244.0.1"), want: []string{"10.244.0.1:8080/TCP"}},
		{name: "IPv6", slice: slice(discoveryv1.AddressTypeIPv6, "fd00:244::1", "fd00:244::2"),
			want: []string{"[fd00:244::1]:8080/TCP", "[fd00:244::2]:8080/TCP"}},
		{name: "IPv6 address in an IPv4 slice", slice: slice(discoveryv1.AddressTypeIPv4, "10.244.0.1", "fd00:244::1"),
			want: []string{"10.244.0.1:8080/TCP"}, wantErrors: 1},
		{name: "IPv4 address in an IPv6 slice", slice: slice(discoveryv1.AddressTypeIPv6, "fd00:244::1", "10.244.0.1"),
			want: []string{"[fd00:244::1]:8080/TCP"}, wantErrors: 1},
		{name: "IPv4-mapped address in an IPv6 slice", slice: slice(discoveryv1.AddressTypeIPv6, "::ffff:10.244.0.1"), wantErrors: 1},
		{name: "zoned address", slice: slice(discoveryv1.AddressTypeIPv6, "fe80::1%eth0"), wantErrors: 1},
		{name: "FQDN slices are ignored", slice: slice(discoveryv1.AddressTypeFQDN, "db.example.com")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, ok := sliceFromK8s(tt.slice)
			if !ok || p.service != (tables.ServiceName{Namespace: "default", Name: "web"}) {
				t.Fatalf("service = %v, %v; want default/web", p.service, ok)
			}
			var got []string
			for _, b := range p.backends {
				got = append(got, b.addr.String())
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("backends = %v, want %v", got, tt.want)
			}
			if len(p.errs) != tt.wantErrors {
				t.Errorf("errors = %q, want %d", p.errs, tt.wantErrors)
			}
		})
	}
}

func TestNodePortAddrs(t *testing.T) {
	tests := []struct {
		name string
		in   []string
		want []string
	}{
		{name: "none"},
		{name: "both families", in: []string{"192.168.1.10", "2001:db8::10", "fd00:1::10"},
			want: []string{"192.168.1.10", "2001:db8::10", "fd00:1::10"}},
		{name: "IPv4-mapped is IPv4", in: []string{"::ffff:192.168.1.10"}, want: []string{"192.168.1.10"}},
		{name: "link-local addresses are left out", in: []string{"fe80::1", "fe80::2%eth0", "169.254.0.1", "10.0.0.1"},
			want: []string{"10.0.0.1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var in []netip.Addr
			for _, s := range tt.in {
				in = append(in, netip.MustParseAddr(s))
			}
			var got []string
			for _, a := range nodePortAddrs(in) {
				got = append(got, a.String())
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("nodePortAddrs = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestBackendsForTrafficPolicy(t *testing.T) {
	be := func(ip, node string, state tables.BackendState) sliceBackend {
		return sliceBackend{
			addr:     tables.L4Addr{Addr: netip.MustParseAddr(ip), Port: 8080, Proto: tables.TCP},
			portName: "http", state: state, nodeName: node,
		}
	}
	backends := []sliceBackend{
		be("10.244.0.1", "node-a", tables.BackendActive),
		be("10.244.1.1", "node-b", tables.BackendActive),
		be("10.244.0.2", "node-a", tables.BackendTerminating),
		be("10.244.2.1", "", tables.BackendActive),
	}
	fe := &tables.Frontend{
		Address:  tables.L4Addr{Addr: netip.MustParseAddr("10.96.0.10"), Port: 80, Proto: tables.TCP},
		PortName: "http",
	}
	tests := []struct {
		name  string
		local bool
		node  string
		want  []string
	}{
		{name: "cluster", node: "node-a", want: []string{"10.244.0.1:8080/TCP", "10.244.1.1:8080/TCP", "10.244.0.2:8080/TCP", "10.244.2.1:8080/TCP"}},
		{name: "local on node-a", local: true, node: "node-a", want: []string{"10.244.0.1:8080/TCP", "10.244.0.2:8080/TCP"}},
		{name: "local on node-b", local: true, node: "node-b", want: []string{"10.244.1.1:8080/TCP"}},
		{name: "local, no backend on the node", local: true, node: "node-c"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			for _, b := range backendsFor(fe, backends, tt.local, tt.node) {
				got = append(got, b.Address.String())
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("backends = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestBackendsForFamily(t *testing.T) {
	be := func(ip string) sliceBackend {
		return sliceBackend{addr: tables.L4Addr{Addr: netip.MustParseAddr(ip), Port: 8080, Proto: tables.TCP}, portName: "http"}
	}
	// A dual-stack service's slices, merged as serviceBackends does.
	backends := []sliceBackend{be("10.244.0.1"), be("10.244.0.2"), be("fd00:244::1")}
	tests := []struct {
		frontend string
		want     []string
	}{
		{frontend: "10.96.0.10", want: []string{"10.244.0.1:8080/TCP", "10.244.0.2:8080/TCP"}},
		{frontend: "fd00::10", want: []string{"[fd00:244::1]:8080/TCP"}},
	}
	for _, tt := range tests {
		t.Run(tt.frontend, func(t *testing.T) {
			fe := &tables.Frontend{Address: tables.L4Addr{Addr: netip.MustParseAddr(tt.frontend), Port: 80, Proto: tables.TCP}, PortName: "http"}
			var got []string
			for _, b := range backendsFor(fe, backends, false, "") {
				got = append(got, b.Address.String())
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("backends = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestWriterSharedAddress follows a load-balancer IP that services share,
// on different ports, through the writer: each port is its service's
// frontend, never a conflict, and none is at port 0: the wildcard entry of
// an address is no frontend (the reconciler writes those of cluster IPs
// itself), and a load-balancer IP has none.
func TestWriterSharedAddress(t *testing.T) {
	db := statedb.New()
	services, err := tables.NewServicesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	frontends, err := tables.NewFrontendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	backends, err := tables.NewBackendsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	w := &writer{services: services, frontends: frontends, backends: backends,
		conflicted: map[tables.ServiceName]struct{}{}, sliceRecords: map[tables.ServiceName][]sliceRecord{}}

	lb := func(name, clusterIP string, port int32, mod ...func(*corev1.Service)) *corev1.Service {
		s := &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
			Spec: corev1.ServiceSpec{
				Type: corev1.ServiceTypeLoadBalancer, ClusterIP: clusterIP,
				Ports: []corev1.ServicePort{{Port: port}},
			},
			Status: corev1.ServiceStatus{LoadBalancer: corev1.LoadBalancerStatus{
				Ingress: []corev1.LoadBalancerIngress{{IP: "203.0.113.5"}},
			}},
		}
		for _, m := range mod {
			m(s)
		}
		return s
	}
	upsert := func(s *corev1.Service) func(statedb.WriteTxn, *change) {
		return func(txn statedb.WriteTxn, c *change) {
			w.upsertService(txn, serviceFromK8s(s, defaultNodePortRange), c)
		}
	}
	del := func(name string) func(statedb.WriteTxn, *change) {
		return func(txn statedb.WriteTxn, c *change) {
			w.deleteService(txn, tables.ServiceName{Namespace: "default", Name: name}, c)
		}
	}
	withAffinity := func(s *corev1.Service) { s.Spec.SessionAffinity = corev1.ServiceAffinityClientIP }

	steps := []struct {
		name string
		ops  []func(statedb.WriteTxn, *change)
		// want are the frontends as "address service type affinity",
		// in address order.
		want []string
		// same says that the frontends table must not be written.
		same bool
	}{
		{
			name: "b alone",
			ops:  []func(statedb.WriteTxn, *change){upsert(lb("b", "10.96.0.2", 443))},
			want: []string{
				"10.96.0.2:443/TCP default/b ClusterIP 0",
				"203.0.113.5:443/TCP default/b LoadBalancer 0",
			},
		},
		{
			name: "a shares the IP on another port: no conflict",
			ops:  []func(statedb.WriteTxn, *change){upsert(lb("a", "10.96.0.1", 80))},
			want: []string{
				"10.96.0.1:80/TCP default/a ClusterIP 0",
				"10.96.0.2:443/TCP default/b ClusterIP 0",
				"203.0.113.5:80/TCP default/a LoadBalancer 0",
				"203.0.113.5:443/TCP default/b LoadBalancer 0",
			},
		},
		{
			name: "affinity reaches a's frontends only",
			ops:  []func(statedb.WriteTxn, *change){upsert(lb("a", "10.96.0.1", 80, withAffinity))},
			want: []string{
				"10.96.0.1:80/TCP default/a ClusterIP 10800",
				"10.96.0.2:443/TCP default/b ClusterIP 0",
				"203.0.113.5:80/TCP default/a LoadBalancer 10800",
				"203.0.113.5:443/TCP default/b LoadBalancer 0",
			},
		},
		{
			name: "c shares it too",
			ops:  []func(statedb.WriteTxn, *change){upsert(lb("c", "10.96.0.3", 53))},
			want: []string{
				"10.96.0.1:80/TCP default/a ClusterIP 10800",
				"10.96.0.2:443/TCP default/b ClusterIP 0",
				"10.96.0.3:53/TCP default/c ClusterIP 0",
				"203.0.113.5:53/TCP default/c LoadBalancer 0",
				"203.0.113.5:80/TCP default/a LoadBalancer 10800",
				"203.0.113.5:443/TCP default/b LoadBalancer 0",
			},
		},
		{
			name: "a goes: b and c keep their ports of the IP",
			ops:  []func(statedb.WriteTxn, *change){del("a")},
			want: []string{
				"10.96.0.2:443/TCP default/b ClusterIP 0",
				"10.96.0.3:53/TCP default/c ClusterIP 0",
				"203.0.113.5:53/TCP default/c LoadBalancer 0",
				"203.0.113.5:443/TCP default/b LoadBalancer 0",
			},
		},
		{
			name: "b loses its ingress IP while a comes back, in one batch",
			ops: []func(statedb.WriteTxn, *change){
				upsert(lb("b", "10.96.0.2", 443, func(s *corev1.Service) { s.Status.LoadBalancer.Ingress = nil })),
				upsert(lb("a", "10.96.0.1", 80)),
			},
			want: []string{
				"10.96.0.1:80/TCP default/a ClusterIP 0",
				"10.96.0.2:443/TCP default/b ClusterIP 0",
				"10.96.0.3:53/TCP default/c ClusterIP 0",
				"203.0.113.5:53/TCP default/c LoadBalancer 0",
				"203.0.113.5:80/TCP default/a LoadBalancer 0",
			},
		},
		{
			name: "the same again: nothing is written",
			ops: []func(statedb.WriteTxn, *change){
				upsert(lb("b", "10.96.0.2", 443, func(s *corev1.Service) { s.Status.LoadBalancer.Ingress = nil })),
				upsert(lb("a", "10.96.0.1", 80)),
				upsert(lb("c", "10.96.0.3", 53)),
			},
			want: []string{
				"10.96.0.1:80/TCP default/a ClusterIP 0",
				"10.96.0.2:443/TCP default/b ClusterIP 0",
				"10.96.0.3:53/TCP default/c ClusterIP 0",
				"203.0.113.5:53/TCP default/c LoadBalancer 0",
				"203.0.113.5:80/TCP default/a LoadBalancer 0",
			},
			same: true,
		},
		{
			name: "c goes",
			ops:  []func(statedb.WriteTxn, *change){del("c")},
			want: []string{
				"10.96.0.1:80/TCP default/a ClusterIP 0",
				"10.96.0.2:443/TCP default/b ClusterIP 0",
				"203.0.113.5:80/TCP default/a LoadBalancer 0",
			},
		},
		{
			name: "both go: nothing left",
			ops:  []func(statedb.WriteTxn, *change){del("a"), del("b")},
		},
	}
	for _, step := range steps {
		before := frontends.Revision(db.ReadTxn())
		txn := db.WriteTxn(services, frontends, backends)
		c := newChange()
		for _, op := range step.ops {
			op(txn, c)
		}
		w.refresh(txn, c)
		rtxn := txn.Commit()

		var got []string
		for fe := range frontends.All(rtxn) {
			got = append(got, fmt.Sprintf("%s %s %s %d", fe.Address, fe.Service, fe.Type, fe.SessionAffinity))
		}
		if !slices.Equal(got, step.want) {
			t.Errorf("%s: frontends =\n%s\nwant\n%s", step.name, strings.Join(got, "\n"), strings.Join(step.want, "\n"))
		}
		if step.same && frontends.Revision(rtxn) != before {
			t.Errorf("%s: the frontends table was written", step.name)
		}
		for svc := range services.All(rtxn) {
			if len(svc.Conflicts)+len(svc.Errors) > 0 {
				t.Errorf("%s: service %s has problems %q %q", step.name, svc.Name, svc.Errors, svc.Conflicts)
			}
		}
		if n := len(c.problems); n > 0 {
			t.Errorf("%s: %d services with problems reported", step.name, n)
		}
	}
}

// TestSourceRanges: loadBalancerSourceRanges become masked prefixes; an
// invalid one is an error and left out, and a service whose ranges are all
// invalid still says it has ranges (its LoadBalancer frontends then take
// nothing rather than everything).
func TestSourceRanges(t *testing.T) {
	for _, tt := range []struct {
		name   string
		ranges []string
		want   string
		set    bool
		errs   int
	}{
		{"none", nil, "[]", false, 0},
		{"masked", []string{"192.0.2.7/24", " 10.0.0.0/8 "}, "[192.0.2.0/24 10.0.0.0/8]", true, 0},
		{"one invalid", []string{"10.0.0.0/8", "nope"}, "[10.0.0.0/8]", true, 1},
		{"all invalid", []string{"nope"}, "[]", true, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := &corev1.Service{}
			s.Name, s.Namespace = "s", "default"
			s.Spec.Type = corev1.ServiceTypeLoadBalancer
			s.Spec.LoadBalancerSourceRanges = tt.ranges
			svc := serviceFromK8s(s, defaultNodePortRange)
			got := fmt.Sprint(svc.LoadBalancerSourceRanges)
			if got == "[]" || svc.LoadBalancerSourceRanges == nil {
				got = "[]"
			}
			if got != tt.want || svc.SourceRangesSet != tt.set || len(svc.Errors) != tt.errs {
				t.Errorf("ranges %s set %v errors %q; want %s set %v %d errors", got, svc.SourceRangesSet, svc.Errors, tt.want, tt.set, tt.errs)
			}
		})
	}
}

func TestParsePortRange(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want portRange
		err  bool
	}{
		{in: "30000-32767", want: portRange{30000, 32767}},
		{in: " 80 - 90 ", want: portRange{80, 90}},
		{in: "8080", want: portRange{8080, 8080}},
		{in: "1-65535", want: portRange{1, 65535}},
		{in: "0-10", err: true},
		{in: "90-80", err: true},
		{in: "1-65536", err: true},
		{in: "a-b", err: true},
		{in: "", err: true},
	} {
		got, err := parsePortRange(tt.in)
		if (err != nil) != tt.err || got != tt.want {
			t.Errorf("parsePortRange(%q) = %v, %v; want %v, error %v", tt.in, got, err, tt.want, tt.err)
		}
		if err == nil && !got.contains(int32(got.min)) || got.contains(int32(got.max)+1) && got.max != 0 {
			t.Errorf("%v: contains is wrong at its ends", got)
		}
	}
}
