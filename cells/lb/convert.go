package lb

import (
	"fmt"
	"iter"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/apiary-net/apiary/tables"
)

// headlessLabel marks a service as headless whatever its cluster IP, as
// kube-proxy and Cilium honour it.
const headlessLabel = corev1.IsHeadlessService

// serviceProxyNameLabel names the proxy that serves a service; the others
// leave it alone (see servedBy, --k8s-service-proxy-name).
const serviceProxyNameLabel = "service.kubernetes.io/service-proxy-name"

// serviceFromK8s turns a Kubernetes Service into a services row. What is
// invalid is listed in Errors and left out; the rest is kept. Addresses of
// both families are kept: the cluster IPs (at most one per family, as
// spec.clusterIPs and spec.ipFamilies list them), the external IPs and the
// load-balancer ingress IPs. Load-balancer ingress addresses with ipMode
// Proxy are left out: the load balancer forwards their traffic to the
// nodes (to the nodePorts), so they are not addresses of this node.
//
// A nodePort outside nodePorts (--node-port-range, the API server's
// --service-node-port-range) is reported and left out: the agent would
// otherwise take a port of the node that something else may listen on.
func serviceFromK8s(s *corev1.Service, nodePorts portRange) *tables.Service {
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
	parseIP := func(field, raw string) (netip.Addr, bool) {
		ip, err := netip.ParseAddr(raw)
		switch {
		case err != nil:
			errorf("%s %q is not an IP address", field, raw)
			return netip.Addr{}, false
		case ip.Zone() != "":
			// A zone names an interface of the host that wrote it: it
			// means nothing here, and the datapath would match the bare
			// address on every interface.
			errorf("%s %q has a zone: a service address cannot", field, raw)
			return netip.Addr{}, false
		}
		return ip.Unmap(), true
	}
	parse := func(field string, ips []string) []netip.Addr {
		var out []netip.Addr
		for _, raw := range ips {
			if ip, ok := parseIP(field, raw); ok {
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
	// Kubernetes allocates it only for ExternalTrafficPolicy Local (and
	// clears it otherwise); a --config-dir file may say anything.
	if hc := s.Spec.HealthCheckNodePort; hc != 0 {
		switch {
		case svc.ExternalTrafficPolicy != tables.TrafficPolicyLocal:
			errorf("healthCheckNodePort %d without externalTrafficPolicy Local is ignored", hc)
		case hc < 1 || hc > 65535:
			errorf("healthCheckNodePort %d is not a port", hc)
		default:
			svc.HealthCheckNodePort = uint16(hc)
		}
	}
	svc.SessionAffinityTimeout = sessionAffinity(s, errorf)

	// The API server keeps clusterIPs and ipFamilies in step, one address
	// per family; a --config-dir file may not, and an address whose family
	// disagrees, or a second one of a family, is left out rather than
	// guessed at.
	for i, raw := range clusterIPs {
		ip, ok := parseIP("clusterIP", raw)
		if !ok {
			continue
		}
		fam := ipFamily(ip)
		if i < len(s.Spec.IPFamilies) && s.Spec.IPFamilies[i] != fam {
			errorf("clusterIP %s is %s but ipFamilies[%d] is %q", ip, fam, i, s.Spec.IPFamilies[i])
			continue
		}
		if slices.ContainsFunc(svc.ClusterIPs, func(o netip.Addr) bool { return o.Is4() == ip.Is4() }) {
			errorf("clusterIP %s is a second %s cluster IP: a service has at most one per family", ip, fam)
			continue
		}
		svc.ClusterIPs = append(svc.ClusterIPs, ip)
	}
	svc.ExternalIPs = parse("externalIP", s.Spec.ExternalIPs)
	var lbIPs []string
	for _, ing := range s.Status.LoadBalancer.Ingress {
		if ing.IP != "" && (ing.IPMode == nil || *ing.IPMode != corev1.LoadBalancerIPModeProxy) {
			lbIPs = append(lbIPs, ing.IP)
		}
	}
	svc.LoadBalancerIPs = parse("loadBalancer ingress IP", lbIPs)
	svc.SourceRangesSet = len(s.Spec.LoadBalancerSourceRanges) > 0
	for _, raw := range s.Spec.LoadBalancerSourceRanges {
		pfx, err := netip.ParsePrefix(strings.TrimSpace(raw))
		if err != nil {
			// Left out, the service would take traffic from anywhere:
			// say so rather than guess.
			errorf("loadBalancerSourceRanges %q is not a prefix", raw)
			continue
		}
		svc.LoadBalancerSourceRanges = append(svc.LoadBalancerSourceRanges, pfx.Masked())
	}

	// Only these types open node ports; a stale nodePort on another type
	// is ignored, as the API server clears it.
	opensNodePorts := s.Spec.Type == corev1.ServiceTypeNodePort || s.Spec.Type == corev1.ServiceTypeLoadBalancer
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
			case !opensNodePorts || p.NodePort == 0:
			case !nodePorts.contains(p.NodePort):
				errorf("port %q: nodePort %d is outside --node-port-range %s", portLabel(p.Name, p.Port), p.NodePort, nodePorts)
			default:
				sp.NodePort = uint16(p.NodePort)
			}
			svc.Ports = append(svc.Ports, sp)
		}
	}
	return svc
}

// portRange is an inclusive range of ports, as --node-port-range gives it.
type portRange struct{ min, max uint16 }

// defaultNodePortRange is Kubernetes' default --service-node-port-range.
var defaultNodePortRange = portRange{30000, 32767}

func (r portRange) contains(p int32) bool { return p >= int32(r.min) && p <= int32(r.max) }

func (r portRange) String() string { return fmt.Sprintf("%d-%d", r.min, r.max) }

// parsePortRange parses "MIN-MAX" (1 <= MIN <= MAX <= 65535), or a single
// port.
func parsePortRange(s string) (portRange, error) {
	lo, hi, found := strings.Cut(strings.TrimSpace(s), "-")
	if !found {
		hi = lo
	}
	min, err1 := strconv.ParseUint(strings.TrimSpace(lo), 10, 16)
	max, err2 := strconv.ParseUint(strings.TrimSpace(hi), 10, 16)
	if err1 != nil || err2 != nil || min == 0 || min > max {
		return portRange{}, fmt.Errorf("port range %q: want MIN-MAX with 1 <= MIN <= MAX <= 65535", s)
	}
	return portRange{uint16(min), uint16(max)}, nil
}

// maxAffinitySeconds is the longest ClientIP affinity timeout the API
// server accepts (a day); k8s.io/api has no constant for it.
const maxAffinitySeconds = 86400

// sessionAffinity returns the ClientIP session affinity timeout of the
// service in seconds, 0 for none. ClientIP without a timeout gets the
// Kubernetes default (three hours); a timeout the API server would refuse
// (outside 1-86400) is reported through errorf and the default is used, so
// that the service keeps the affinity it asked for.
func sessionAffinity(s *corev1.Service, errorf func(string, ...any)) uint32 {
	switch s.Spec.SessionAffinity {
	case "", corev1.ServiceAffinityNone:
		return 0
	case corev1.ServiceAffinityClientIP:
	default:
		errorf("sessionAffinity %q is not None or ClientIP; None is used", s.Spec.SessionAffinity)
		return 0
	}
	cfg := s.Spec.SessionAffinityConfig
	if cfg == nil || cfg.ClientIP == nil || cfg.ClientIP.TimeoutSeconds == nil {
		return uint32(corev1.DefaultClientIPServiceAffinitySeconds)
	}
	t := *cfg.ClientIP.TimeoutSeconds
	if t < 1 || t > maxAffinitySeconds {
		errorf("sessionAffinityConfig.clientIP.timeoutSeconds %d is out of range 1-%d; %d is used",
			t, maxAffinitySeconds, corev1.DefaultClientIPServiceAffinitySeconds)
		return uint32(corev1.DefaultClientIPServiceAffinitySeconds)
	}
	return uint32(t)
}

// ipFamily returns the Kubernetes name of ip's family.
func ipFamily(ip netip.Addr) corev1.IPFamily {
	if ip.Is4() {
		return corev1.IPv4Protocol
	}
	return corev1.IPv6Protocol
}

func portLabel(name string, port int32) string {
	if name != "" {
		return name
	}
	return fmt.Sprint(port)
}

// desiredFrontends lists the frontends a service asks for: each cluster IP,
// external IP and load-balancer IP times each port, then each of nodeIPs
// (the node's own addresses) times each port's nodePort. An address
// listed twice makes one frontend, of the first type that lists it. Every
// frontend carries the service's session affinity.
//
// Node ports open only on the node addresses of the families the service
// has a cluster IP of, as in kube-proxy: a service's backends are of its
// families, so an IPv4 service would have none for an IPv6 node address.
//
// There are no wildcard frontends (port 0): the reconciler writes the
// wildcard entry of each cluster IP itself, from the ClusterIP frontends.
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
	// A linear search: services have a handful of frontends; a set for
	// the rare one with many ports, where the search is quadratic.
	var seen map[tables.L4Addr]struct{}
	if cap(out) > 64 {
		seen = make(map[tables.L4Addr]struct{}, cap(out))
	}
	listed := func(addr tables.L4Addr) bool {
		if seen != nil {
			_, ok := seen[addr]
			seen[addr] = struct{}{}
			return ok
		}
		return slices.ContainsFunc(out, func(f *tables.Frontend) bool { return f.Address == addr })
	}
	for addr, of := range frontendAddrs(svc, nodeIPs) {
		if listed(addr) {
			continue
		}
		out = append(out, &tables.Frontend{Address: addr, Service: svc.Name, Type: of.typ, PortName: of.portName,
			SessionAffinity: svc.SessionAffinityTimeout})
	}
	return out
}

// frontendOf is what makes a frontend besides its address.
type frontendOf struct {
	typ      tables.FrontendType
	portName string
}

// frontendAddrs yields the address, type and port name of each frontend
// desiredFrontends makes of svc, in the same order, and also those an
// address listed twice repeats (it makes one frontend, of the first).
func frontendAddrs(svc *tables.Service, nodeIPs []netip.Addr) iter.Seq2[tables.L4Addr, frontendOf] {
	return func(yield func(tables.L4Addr, frontendOf) bool) {
		if svc == nil || svc.Headless {
			return
		}
		has4 := slices.ContainsFunc(svc.ClusterIPs, netip.Addr.Is4)
		has6 := slices.ContainsFunc(svc.ClusterIPs, netip.Addr.Is6)
		add := func(t tables.FrontendType, ips []netip.Addr) bool {
			for _, ip := range ips {
				if t == tables.FrontendNodePort && !(ip.Is4() && has4 || ip.Is6() && has6) {
					continue
				}
				for _, p := range svc.Ports {
					port := p.Port
					if t == tables.FrontendNodePort {
						if port = p.NodePort; port == 0 {
							continue
						}
					}
					if !yield(tables.L4Addr{Addr: ip, Port: port, Proto: p.Protocol}, frontendOf{t, p.Name}) {
						return false
					}
				}
			}
			return true
		}
		_ = add(tables.FrontendClusterIP, svc.ClusterIPs) &&
			add(tables.FrontendExternalIP, svc.ExternalIPs) &&
			add(tables.FrontendLoadBalancer, svc.LoadBalancerIPs) &&
			add(tables.FrontendNodePort, nodeIPs)
	}
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
// ports and addresses, including an address of the other family than the
// slice's addressType, are listed in errs and left out. IPv4 and IPv6
// slices are used; FQDN slices have no addresses to balance to and are
// ignored.
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
	var family func(netip.Addr) bool
	switch s.AddressType {
	case discoveryv1.AddressTypeIPv4:
		family = netip.Addr.Is4
	case discoveryv1.AddressTypeIPv6:
		family = netip.Addr.Is6
	default:
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
			// An IPv4-mapped address in an IPv6 slice is an IPv4 one:
			// it must come in an IPv4 slice.
			if ip = ip.Unmap(); err != nil || ip.Zone() != "" || !family(ip) {
				errorf("endpoint address %q is not an %s address", raw, s.AddressType)
				continue
			}
			for _, pt := range ports {
				p.backends = append(p.backends, sliceBackend{
					addr:     tables.L4Addr{Addr: ip, Port: pt.num, Proto: pt.proto},
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
