package lb

import (
	"fmt"
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/apiary-net/apiary/tables"
)

// headlessLabel marks a service as headless whatever its cluster IP, as
// kube-proxy and Cilium honour it.
const headlessLabel = corev1.IsHeadlessService

// serviceFromK8s turns a Kubernetes Service into a services row. What is
// invalid is listed in Errors and left out; the rest is kept. Only IPv4
// addresses are load-balanced (there are no lb6 maps), so IPv6 ones are
// left out without complaint. Load-balancer ingress addresses with ipMode
// Proxy are left out: the load balancer forwards their traffic to the
// nodes (to the nodePorts), so they are not addresses of this node.
func serviceFromK8s(s *corev1.Service) *tables.Service {
	svc := &tables.Service{
		Name:                  tables.ServiceName{Namespace: s.Namespace, Name: s.Name},
		Type:                  string(s.Spec.Type),
		ExternalTrafficPolicy: tables.TrafficPolicy(s.Spec.ExternalTrafficPolicy),
	}
	if s.Spec.InternalTrafficPolicy != nil {
		svc.InternalTrafficPolicy = tables.TrafficPolicy(*s.Spec.InternalTrafficPolicy)
	}
	if svc.Type == "" {
		svc.Type = string(corev1.ServiceTypeClusterIP)
	}
	errorf := func(format string, args ...any) {
		svc.Errors = append(svc.Errors, fmt.Sprintf(format, args...))
	}
	parse := func(field string, ips []string) []netip.Addr {
		var out []netip.Addr
		for _, raw := range ips {
			ip, err := netip.ParseAddr(raw)
			if err != nil {
				errorf("%s %q is not an IP address", field, raw)
				continue
			}
			if ip = ip.Unmap(); ip.Is4() {
				out = append(out, ip)
			}
		}
		return out
	}

	if s.Spec.Type == corev1.ServiceTypeExternalName {
		return svc
	}
	clusterIPs := s.Spec.ClusterIPs
	if len(clusterIPs) == 0 && s.Spec.ClusterIP != "" {
		clusterIPs = []string{s.Spec.ClusterIP}
	}
	if len(clusterIPs) > 0 && clusterIPs[0] == corev1.ClusterIPNone {
		svc.Headless = true
		clusterIPs = nil
	}
	if _, ok := s.Labels[headlessLabel]; ok {
		svc.Headless = true
	}
	for _, p := range []struct {
		field string
		v     tables.TrafficPolicy
	}{{"externalTrafficPolicy", svc.ExternalTrafficPolicy}, {"internalTrafficPolicy", svc.InternalTrafficPolicy}} {
		if p.v != "" && p.v != tables.TrafficPolicyCluster && p.v != tables.TrafficPolicyLocal {
			errorf("%s %q is not Cluster or Local; Cluster is used", p.field, p.v)
		}
	}
	if svc.ExternalTrafficPolicy != tables.TrafficPolicyLocal {
		svc.ExternalTrafficPolicy = ""
	}
	if svc.InternalTrafficPolicy != tables.TrafficPolicyLocal {
		svc.InternalTrafficPolicy = ""
	}
	svc.ClusterIPs = parse("clusterIP", clusterIPs)
	svc.ExternalIPs = parse("externalIP", s.Spec.ExternalIPs)
	var lbIPs []string
	for _, ing := range s.Status.LoadBalancer.Ingress {
		if ing.IP != "" && (ing.IPMode == nil || *ing.IPMode != corev1.LoadBalancerIPModeProxy) {
			lbIPs = append(lbIPs, ing.IP)
		}
	}
	svc.LoadBalancerIPs = parse("loadBalancer ingress IP", lbIPs)

	// Only these types open node ports; a stale nodePort on another type
	// is ignored, as the API server clears it.
	nodePorts := s.Spec.Type == corev1.ServiceTypeNodePort || s.Spec.Type == corev1.ServiceTypeLoadBalancer
	for _, p := range s.Spec.Ports {
		proto, err := tables.ParseProto(string(p.Protocol))
		switch {
		case err != nil:
			errorf("port %q: %v", portLabel(p.Name, p.Port), err)
		case p.Port <= 0 || p.Port > 65535:
			errorf("port %q: port %d is out of range 1-65535", portLabel(p.Name, p.Port), p.Port)
		default:
			sp := tables.ServicePort{Name: p.Name, Port: uint16(p.Port), Protocol: proto}
			switch {
			case !nodePorts || p.NodePort == 0:
			case p.NodePort < 0 || p.NodePort > 65535:
				errorf("port %q: nodePort %d is out of range 1-65535", portLabel(p.Name, p.Port), p.NodePort)
			default:
				sp.NodePort = uint16(p.NodePort)
			}
			svc.Ports = append(svc.Ports, sp)
		}
	}
	return svc
}

func portLabel(name string, port int32) string {
	if name != "" {
		return name
	}
	return fmt.Sprint(port)
}

// desiredFrontends lists the frontends a service asks for: each cluster IP,
// external IP and load-balancer IP times each port, then each of nodeIPs
// (the node's own IPv4 addresses) times each port's nodePort. An address
// listed twice makes one frontend, of the first type that lists it.
func desiredFrontends(svc *tables.Service, nodeIPs []netip.Addr) []*tables.Frontend {
	if svc == nil || svc.Headless {
		return nil
	}
	nodePorts := 0
	for _, p := range svc.Ports {
		if p.NodePort != 0 {
			nodePorts++
		}
	}
	out := make([]*tables.Frontend, 0, (len(svc.ClusterIPs)+len(svc.ExternalIPs)+len(svc.LoadBalancerIPs))*len(svc.Ports)+len(nodeIPs)*nodePorts)
	add := func(t tables.FrontendType, ips []netip.Addr) {
		for _, ip := range ips {
			for _, p := range svc.Ports {
				port := p.Port
				if t == tables.FrontendNodePort {
					if port = p.NodePort; port == 0 {
						continue
					}
				}
				addr := tables.L4Addr{Addr: ip, Port: port, Proto: p.Protocol}
				// A linear search: services have a handful of frontends.
				if slices.ContainsFunc(out, func(f *tables.Frontend) bool { return f.Address == addr }) {
					continue
				}
				out = append(out, &tables.Frontend{Address: addr, Service: svc.Name, Type: t, PortName: p.Name})
			}
		}
	}
	add(tables.FrontendClusterIP, svc.ClusterIPs)
	add(tables.FrontendExternalIP, svc.ExternalIPs)
	add(tables.FrontendLoadBalancer, svc.LoadBalancerIPs)
	if nodePorts > 0 {
		add(tables.FrontendNodePort, nodeIPs)
	}
	return out
}

// localOnly says whether a frontend of the service may use only the
// backends on this node: its traffic policy (internal for ClusterIP
// frontends, external for the others) is Local.
func localOnly(svc *tables.Service, t tables.FrontendType) bool {
	if t == tables.FrontendClusterIP {
		return svc.InternalTrafficPolicy == tables.TrafficPolicyLocal
	}
	return svc.ExternalTrafficPolicy == tables.TrafficPolicyLocal
}

// serviceNameLabel names the service an EndpointSlice belongs to.
const serviceNameLabel = discoveryv1.LabelServiceName

// sliceBackend is one address and port of an EndpointSlice.
type sliceBackend struct {
	addr     tables.L4Addr
	portName string
	state    tables.BackendState
	// nodeName is the endpoint's node ("" when the slice does not say),
	// which Local traffic policies select on.
	nodeName string
}

// parsedSlice is what the load balancer takes from an EndpointSlice.
type parsedSlice struct {
	service  tables.ServiceName
	name     string
	backends []sliceBackend
	errs     []string
}

// sliceFromK8s turns an EndpointSlice into backends: each endpoint address
// times each port. ok is false when the slice names no service. Invalid
// ports and addresses are listed in errs and left out. Only IPv4 slices are
// used.
func sliceFromK8s(s *discoveryv1.EndpointSlice) (p parsedSlice, ok bool) {
	p.name = s.Name
	errorf := func(format string, args ...any) {
		p.errs = append(p.errs, fmt.Sprintf(format, args...))
	}
	svcName := s.Labels[serviceNameLabel]
	if svcName == "" {
		errorf("no %s label: the slice belongs to no service", serviceNameLabel)
		return p, false
	}
	p.service = tables.ServiceName{Namespace: s.Namespace, Name: svcName}
	if s.AddressType != discoveryv1.AddressTypeIPv4 {
		return p, true
	}

	type port struct {
		name  string
		num   uint16
		proto tables.Proto
	}
	var ports []port
	for _, sp := range s.Ports {
		name := ""
		if sp.Name != nil {
			name = *sp.Name
		}
		proto := tables.TCP
		if sp.Protocol != nil {
			var err error
			if proto, err = tables.ParseProto(string(*sp.Protocol)); err != nil {
				errorf("port %q: %v", name, err)
				continue
			}
		}
		if sp.Port == nil || *sp.Port <= 0 || *sp.Port > 65535 {
			n := int32(0)
			if sp.Port != nil {
				n = *sp.Port
			}
			errorf("port %q: port %d is out of range 1-65535", name, n)
			continue
		}
		ports = append(ports, port{name, uint16(*sp.Port), proto})
	}

	for _, ep := range s.Endpoints {
		state := endpointState(ep.Conditions)
		nodeName := ""
		if ep.NodeName != nil {
			nodeName = *ep.NodeName
		}
		for _, raw := range ep.Addresses {
			ip, err := netip.ParseAddr(raw)
			if err != nil || !ip.Unmap().Is4() {
				errorf("endpoint address %q is not an IPv4 address", raw)
				continue
			}
			for _, pt := range ports {
				p.backends = append(p.backends, sliceBackend{
					addr:     tables.L4Addr{Addr: ip.Unmap(), Port: pt.num, Proto: pt.proto},
					portName: pt.name,
					state:    state,
					nodeName: nodeName,
				})
			}
		}
	}
	return p, true
}

// endpointState maps EndpointSlice conditions to a backend state: ready is
// active, also while terminating (a service with publishNotReadyAddresses
// keeps its terminating endpoints ready, and Kubernetes uses them as
// such); not ready but terminating and still serving is terminating;
// anything else takes no new connections. As the API says, an unset ready
// means ready, and an unset serving means the same as ready.
func endpointState(c discoveryv1.EndpointConditions) tables.BackendState {
	ready := c.Ready == nil || *c.Ready
	serving := ready
	if c.Serving != nil {
		serving = *c.Serving
	}
	terminating := c.Terminating != nil && *c.Terminating
	switch {
	case ready:
		return tables.BackendActive
	case terminating && serving:
		return tables.BackendTerminating
	}
	return tables.BackendNotServing
}
