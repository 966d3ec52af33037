package lb

import (
	"net/netip"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
	addr string
	typ  tables.FrontendType
}

func summarise(fes []*tables.Frontend) []frontendSummary {
	var out []frontendSummary
	for _, fe := range fes {
		out = append(out, frontendSummary{fe.Address.String(), fe.Type})
	}
	return out
}

func TestServiceFrontends(t *testing.T) {
	proxy, vip := corev1.LoadBalancerIPModeProxy, corev1.LoadBalancerIPModeVIP
	local := corev1.ServiceInternalTrafficPolicyLocal
	nodeIPs := []netip.Addr{netip.MustParseAddr("192.168.1.10"), netip.MustParseAddr("192.168.1.11")}
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
	tests := []struct {
		name       string
		svc        *corev1.Service
		want       []frontendSummary
		wantErrors int
		wantExt    tables.TrafficPolicy
		wantInt    tables.TrafficPolicy
	}{
		{
			name: "ClusterIP ignores a stale nodePort",
			svc:  svc(corev1.ServiceTypeClusterIP, nil, nil),
			want: []frontendSummary{{"10.96.0.10:80/TCP", tables.FrontendClusterIP}},
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
			name: "NodePort: one frontend per node address",
			svc:  svc(corev1.ServiceTypeNodePort, nil, nil),
			want: []frontendSummary{
				{"10.96.0.10:80/TCP", tables.FrontendClusterIP},
				{"192.168.1.10:30080/TCP", tables.FrontendNodePort},
				{"192.168.1.11:30080/TCP", tables.FrontendNodePort},
			},
		},
		{
			name: "NodePort without a nodePort on a port",
			svc:  svc(corev1.ServiceTypeNodePort, nil, func(s *corev1.Service) { s.Spec.Ports[0].NodePort = 0 }),
			want: []frontendSummary{{"10.96.0.10:80/TCP", tables.FrontendClusterIP}},
		},
		{
			name:       "nodePort out of range",
			svc:        svc(corev1.ServiceTypeNodePort, nil, func(s *corev1.Service) { s.Spec.Ports[0].NodePort = 70000 }),
			want:       []frontendSummary{{"10.96.0.10:80/TCP", tables.FrontendClusterIP}},
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
				{"10.96.0.10:80/TCP", tables.FrontendClusterIP},
				{"203.0.113.1:80/TCP", tables.FrontendLoadBalancer},
				{"203.0.113.2:80/TCP", tables.FrontendLoadBalancer},
				{"192.168.1.10:30080/TCP", tables.FrontendNodePort},
				{"192.168.1.11:30080/TCP", tables.FrontendNodePort},
			},
		},
		{
			name: "an external IP equal to a node address and port keeps its type",
			svc: svc(corev1.ServiceTypeNodePort, nil, func(s *corev1.Service) {
				s.Spec.ExternalIPs = []string{"192.168.1.10"}
				s.Spec.Ports[0].Port = 30080
			}),
			want: []frontendSummary{
				{"10.96.0.10:30080/TCP", tables.FrontendClusterIP},
				{"192.168.1.10:30080/TCP", tables.FrontendExternalIP},
				{"192.168.1.11:30080/TCP", tables.FrontendNodePort},
			},
		},
		{
			name: "traffic policies",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
				s.Spec.InternalTrafficPolicy = &local
			}),
			want:    []frontendSummary{{"10.96.0.10:80/TCP", tables.FrontendClusterIP}},
			wantExt: tables.TrafficPolicyLocal,
			wantInt: tables.TrafficPolicyLocal,
		},
		{
			name: "unknown traffic policy means Cluster",
			svc: svc(corev1.ServiceTypeClusterIP, nil, func(s *corev1.Service) {
				s.Spec.ExternalTrafficPolicy = "Nearby"
			}),
			want:       []frontendSummary{{"10.96.0.10:80/TCP", tables.FrontendClusterIP}},
			wantErrors: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := serviceFromK8s(tt.svc)
			if len(s.Errors) != tt.wantErrors {
				t.Errorf("errors = %q, want %d", s.Errors, tt.wantErrors)
			}
			if s.ExternalTrafficPolicy != tt.wantExt || s.InternalTrafficPolicy != tt.wantInt {
				t.Errorf("policies = %q/%q, want %q/%q", s.ExternalTrafficPolicy, s.InternalTrafficPolicy, tt.wantExt, tt.wantInt)
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
