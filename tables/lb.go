package tables

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// Statedb names of the load-balancing tables.
const (
	ServicesTableName  = "services"
	FrontendsTableName = "frontends"
	BackendsTableName  = "backends"
)

// Proto is the IANA number of a transport protocol.
type Proto uint8

// Protocols a service port can have.
const (
	// AnyProto is the protocol of a wildcard map entry (port 0): it stands
	// for every port and protocol of its address that no service port
	// names.
	AnyProto Proto = 0
	TCP      Proto = 6
	UDP      Proto = 17
	SCTP     Proto = 132
)

// String returns "ANY", "TCP", "UDP", "SCTP" or "proto-N".
func (p Proto) String() string {
	switch p {
	case AnyProto:
		return "ANY"
	case TCP:
		return "TCP"
	case UDP:
		return "UDP"
	case SCTP:
		return "SCTP"
	}
	return "proto-" + strconv.Itoa(int(p))
}

// ParseProto parses a protocol as Kubernetes writes it ("TCP", "UDP",
// "SCTP"; case-insensitive). Empty means TCP, the Kubernetes default.
// A Service port cannot be ANY; only ParseL4Addr takes it.
func ParseProto(s string) (Proto, error) {
	switch strings.ToUpper(s) {
	case "", "TCP":
		return TCP, nil
	case "UDP":
		return UDP, nil
	case "SCTP":
		return SCTP, nil
	}
	return 0, fmt.Errorf("unknown protocol %q (want TCP, UDP or SCTP)", s)
}

// L4Addr is an address, port and protocol: where a frontend listens or a
// backend serves. Its text form is "10.96.0.10:80/TCP".
type L4Addr struct {
	Addr  netip.Addr
	Port  uint16
	Proto Proto
}

// String returns the address as "IP:port/PROTO".
func (a L4Addr) String() string {
	return netip.AddrPortFrom(a.Addr, a.Port).String() + "/" + a.Proto.String()
}

// ParseL4Addr parses "IP:port/PROTO"; the protocol defaults to TCP, and
// may be ANY (a wildcard map entry).
func ParseL4Addr(s string) (L4Addr, error) {
	hostPort, proto, _ := strings.Cut(s, "/")
	ap, err := netip.ParseAddrPort(hostPort)
	if err != nil {
		return L4Addr{}, fmt.Errorf("parse address %q: %w", s, err)
	}
	p, err := ParseProto(proto)
	if strings.EqualFold(proto, AnyProto.String()) {
		p, err = AnyProto, nil
	}
	if err != nil {
		return L4Addr{}, fmt.Errorf("parse address %q: %w", s, err)
	}
	return L4Addr{Addr: ap.Addr().Unmap(), Port: ap.Port(), Proto: p}, nil
}

// MarshalText implements encoding.TextMarshaler.
func (a L4Addr) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (a *L4Addr) UnmarshalText(b []byte) error {
	v, err := ParseL4Addr(string(b))
	*a = v
	return err
}

// Key returns the address as an index key that sorts by IP, port, protocol.
func (a L4Addr) Key() index.Key {
	var k [19]byte
	ip := a.Addr.As16()
	copy(k[:16], ip[:])
	binary.BigEndian.PutUint16(k[16:], a.Port)
	k[18] = byte(a.Proto)
	return k[:]
}

// ServiceName identifies a service: "namespace/name".
type ServiceName struct {
	Namespace string
	Name      string
}

// String returns "namespace/name".
func (n ServiceName) String() string { return n.Namespace + "/" + n.Name }

// ParseServiceName parses "namespace/name".
func ParseServiceName(s string) (ServiceName, error) {
	ns, name, ok := strings.Cut(s, "/")
	if !ok || ns == "" || name == "" {
		return ServiceName{}, fmt.Errorf("service name %q is not namespace/name", s)
	}
	return ServiceName{Namespace: ns, Name: name}, nil
}

// MarshalText implements encoding.TextMarshaler.
func (n ServiceName) MarshalText() ([]byte, error) { return []byte(n.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (n *ServiceName) UnmarshalText(b []byte) error {
	v, err := ParseServiceName(string(b))
	*n = v
	return err
}

// Compare orders service names by namespace, then name.
func (n ServiceName) Compare(m ServiceName) int {
	if c := strings.Compare(n.Namespace, m.Namespace); c != 0 {
		return c
	}
	return strings.Compare(n.Name, m.Name)
}

// ServicePort is one port of a service.
type ServicePort struct {
	// Name matches the port of the same name in the service's
	// EndpointSlices, which carry the resolved target port.
	Name     string `json:"name,omitempty" yaml:"name,omitempty"`
	Port     uint16 `json:"port" yaml:"port"`
	Protocol Proto  `json:"protocol" yaml:"protocol"`
	// NodePort is the port opened on each of the node's addresses
	// (services of type NodePort and LoadBalancer); 0 when none.
	NodePort uint16 `json:"nodePort,omitempty" yaml:"nodePort,omitempty"`
}

// TrafficPolicy says which backends a frontend may use: all of them
// (Cluster, also when empty) or only those on this node (Local).
type TrafficPolicy string

// Traffic policies, as Kubernetes names them.
const (
	TrafficPolicyCluster TrafficPolicy = "Cluster"
	TrafficPolicyLocal   TrafficPolicy = "Local"
)

// MarshalText implements encoding.TextMarshaler, so that protocols read as
// names in JSON and YAML.
func (p Proto) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (p *Proto) UnmarshalText(b []byte) error {
	v, err := ParseProto(string(b))
	*p = v
	return err
}

// Service is a Kubernetes Service as the load balancer sees it: the
// addresses and ports its frontends are made from.
type Service struct {
	Name ServiceName `json:"name" yaml:"name"`
	// Type is the Kubernetes service type (ClusterIP, LoadBalancer, ...).
	Type string `json:"type" yaml:"type"`
	// Headless services (clusterIP None, or the label
	// service.kubernetes.io/headless) have no frontends.
	Headless        bool          `json:"headless,omitempty" yaml:"headless,omitempty"`
	ClusterIPs      []netip.Addr  `json:"clusterIPs,omitempty" yaml:"clusterIPs,omitempty"`
	ExternalIPs     []netip.Addr  `json:"externalIPs,omitempty" yaml:"externalIPs,omitempty"`
	LoadBalancerIPs []netip.Addr  `json:"loadBalancerIPs,omitempty" yaml:"loadBalancerIPs,omitempty"`
	Ports           []ServicePort `json:"ports,omitempty" yaml:"ports,omitempty"`
	// SessionAffinityTimeout is the timeout in seconds of
	// sessionAffinity ClientIP; 0 means no affinity.
	SessionAffinityTimeout uint32 `json:"sessionAffinityTimeout,omitempty" yaml:"sessionAffinityTimeout,omitempty"`
	// ExternalTrafficPolicy governs the NodePort, LoadBalancer and
	// external IP frontends; InternalTrafficPolicy the ClusterIP ones.
	// Local keeps only the backends on this node.
	ExternalTrafficPolicy TrafficPolicy `json:"externalTrafficPolicy,omitempty" yaml:"externalTrafficPolicy,omitempty"`
	InternalTrafficPolicy TrafficPolicy `json:"internalTrafficPolicy,omitempty" yaml:"internalTrafficPolicy,omitempty"`
	// LoadBalancerSourceRanges are the client prefixes a LoadBalancer
	// frontend takes traffic from, outside the node (spec.
	// loadBalancerSourceRanges); empty: any.
	LoadBalancerSourceRanges []netip.Prefix `json:"loadBalancerSourceRanges,omitempty" yaml:"loadBalancerSourceRanges,omitempty"`
	// HealthCheckNodePort is the port on which the agent answers, for a
	// LoadBalancer service with externalTrafficPolicy Local, how many of
	// its endpoints are on this node (spec.healthCheckNodePort); 0: none.
	HealthCheckNodePort uint16 `json:"healthCheckNodePort,omitempty" yaml:"healthCheckNodePort,omitempty"`
	// SourceRangesSet: the spec lists source ranges. With none of them
	// valid, the LoadBalancer frontends take no traffic from outside
	// (fail closed) rather than any.
	SourceRangesSet bool `json:"sourceRangesSet,omitempty" yaml:"sourceRangesSet,omitempty"`
	// Errors lists what could not be turned into frontends: invalid
	// fields, and addresses another service already claims. The rest of
	// the service works.
	Errors []string `json:"errors,omitempty" yaml:"errors,omitempty"`
	// Conflicts lists the frontend addresses another service already
	// uses; they are taken over when that service lets go of them.
	Conflicts []string `json:"conflicts,omitempty" yaml:"conflicts,omitempty"`
}

// Clone returns a shallow copy; the slices are shared and must not be
// modified.
func (s *Service) Clone() *Service {
	c := *s
	return &c
}

// TableHeader implements statedb.TableWritable.
func (*Service) TableHeader() []string {
	return []string{"Name", "Type", "Addresses", "Ports", "TrafficPolicy", "Problems"}
}

// TableRow implements statedb.TableWritable.
func (s *Service) TableRow() []string {
	var addrs []string
	for _, list := range [][]netip.Addr{s.ClusterIPs, s.ExternalIPs, s.LoadBalancerIPs} {
		for _, a := range list {
			addrs = append(addrs, a.String())
		}
	}
	switch {
	case s.Headless && len(addrs) == 0:
		addrs = append(addrs, "None")
	case s.Headless:
		addrs = append(addrs, "(headless)")
	}
	ports := make([]string, len(s.Ports))
	for i, p := range s.Ports {
		ports[i] = strconv.Itoa(int(p.Port))
		if p.NodePort != 0 {
			ports[i] += ":" + strconv.Itoa(int(p.NodePort))
		}
		ports[i] += "/" + p.Protocol.String()
		if p.Name != "" {
			ports[i] = p.Name + ":" + ports[i]
		}
	}
	problems := append(slices.Clone(s.Errors), s.Conflicts...)
	policy := func(p TrafficPolicy) string {
		if p == "" {
			return string(TrafficPolicyCluster)
		}
		return string(p)
	}
	traffic := "Ext=" + policy(s.ExternalTrafficPolicy) + ",Int=" + policy(s.InternalTrafficPolicy)
	if s.HealthCheckNodePort != 0 {
		traffic += ",HealthCheck=" + strconv.Itoa(int(s.HealthCheckNodePort))
	}
	if s.SessionAffinityTimeout != 0 {
		traffic += ",ClientIP=" + strconv.Itoa(int(s.SessionAffinityTimeout)) + "s"
	}
	return []string{s.Name.String(), s.Type, strings.Join(addrs, ","), strings.Join(ports, ","), traffic, strings.Join(problems, "; ")}
}

// FrontendType says where a frontend address comes from.
type FrontendType string

// Frontend types.
const (
	FrontendClusterIP    FrontendType = "ClusterIP"
	FrontendExternalIP   FrontendType = "ExternalIP"
	FrontendLoadBalancer FrontendType = "LoadBalancer"
	// FrontendNodePort is one of the node's own addresses times a
	// service port's nodePort.
	FrontendNodePort FrontendType = "NodePort"
)

// BackendState says whether a backend takes new connections.
type BackendState uint8

// Backend states, from the EndpointSlice conditions.
const (
	// BackendActive: ready. Chosen for new connections.
	BackendActive BackendState = iota
	// BackendTerminating: terminating but still serving. Chosen only when
	// the service has no active backend.
	BackendTerminating
	// BackendNotServing: neither. Never chosen, but its map entry stays
	// while a service lists it, so that established connections survive a
	// readiness flap.
	BackendNotServing
)

// String returns "active", "terminating" or "not-serving".
func (s BackendState) String() string {
	switch s {
	case BackendActive:
		return "active"
	case BackendTerminating:
		return "terminating"
	case BackendNotServing:
		return "not-serving"
	}
	return "state-" + strconv.Itoa(int(s))
}

// MarshalText implements encoding.TextMarshaler.
func (s BackendState) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (s *BackendState) UnmarshalText(b []byte) error {
	for _, v := range []BackendState{BackendActive, BackendTerminating, BackendNotServing} {
		if v.String() == string(b) {
			*s = v
			return nil
		}
	}
	return fmt.Errorf("unknown backend state %q", b)
}

// FrontendBackend is a backend as one frontend uses it.
type FrontendBackend struct {
	Address L4Addr       `json:"address" yaml:"address"`
	State   BackendState `json:"state" yaml:"state"`
}

// Frontend is one address, port and protocol of a service: a cluster IP,
// external IP or load-balancer IP times a service port, or a node address
// times a service port's nodePort. The reconciler writes it into
// lb4_services (slot 0 and one slot per selectable backend), lb4_backends
// and lb4_reverse_nat, or their lb6_* twins for an IPv6 address, and
// derives each cluster IP's wildcard entry (port 0, protocol ANY) from its
// frontends.
type Frontend struct {
	Address  L4Addr       `json:"address" yaml:"address"`
	Service  ServiceName  `json:"service" yaml:"service"`
	Type     FrontendType `json:"type" yaml:"type"`
	PortName string       `json:"portName,omitempty" yaml:"portName,omitempty"`
	// SessionAffinity is the ClientIP affinity timeout in seconds, 0 for
	// none: connections from one client (network namespace) go to the
	// same backend while they come less than this far apart.
	SessionAffinity uint32 `json:"sessionAffinity,omitempty" yaml:"sessionAffinity,omitempty"`
	// Backends are the service's backends for this port, sorted by address.
	Backends []FrontendBackend `json:"backends" yaml:"backends"`
	// ID is the service ID (rev-NAT index) the reconciler gave the
	// frontend; 0 until reconciled.
	ID     uint16            `json:"id" yaml:"id"`
	Status reconciler.Status `json:"status" yaml:"status"`
}

// Clone returns a shallow copy; Backends is shared and must not be modified.
func (f *Frontend) Clone() *Frontend {
	c := *f
	return &c
}

// GetStatus returns the reconciliation status.
func (f *Frontend) GetStatus() reconciler.Status { return f.Status }

// SetStatus sets the reconciliation status and returns the object.
func (f *Frontend) SetStatus(s reconciler.Status) *Frontend {
	f.Status = s
	return f
}

// TableHeader implements statedb.TableWritable.
func (*Frontend) TableHeader() []string {
	return []string{"Address", "Type", "Service", "PortName", "Backends", "ID", "Status"}
}

// frontendRowBackends is how many backends a table row lists before it
// summarises the rest.
const frontendRowBackends = 5

// TableRow implements statedb.TableWritable.
func (f *Frontend) TableRow() []string {
	var bes []string
	for i, b := range f.Backends {
		if i == frontendRowBackends {
			bes = append(bes, fmt.Sprintf("+ %d more", len(f.Backends)-i))
			break
		}
		s := b.Address.String()
		if b.State != BackendActive {
			s += " (" + b.State.String() + ")"
		}
		bes = append(bes, s)
	}
	return []string{
		f.Address.String(), string(f.Type), f.Service.String(), f.PortName,
		strings.Join(bes, ", "), strconv.Itoa(int(f.ID)), StatusText(f.Status),
	}
}

// BackendInstance is what one EndpointSlice of one service says about a
// backend under one port name. A backend serving two ports of a service
// (two service ports with one target port) has an instance for each.
type BackendInstance struct {
	Service ServiceName `json:"service" yaml:"service"`
	// Slice is the name of the EndpointSlice.
	Slice string `json:"slice" yaml:"slice"`
	// PortName is the name of the slice's port, which is the name of the
	// service port it serves.
	PortName string       `json:"portName,omitempty" yaml:"portName,omitempty"`
	State    BackendState `json:"state" yaml:"state"`
}

// Backend is one IP:port/protocol that serves one or more services. It is
// shared: two services (or two slices) naming the same address make one
// backend with two instances.
type Backend struct {
	Address L4Addr `json:"address" yaml:"address"`
	// State is the best state among the instances.
	State BackendState `json:"state" yaml:"state"`
	// Services are the instances, sorted by service, slice and port name.
	Services []BackendInstance `json:"services" yaml:"services"`
}

// TableHeader implements statedb.TableWritable.
func (*Backend) TableHeader() []string {
	return []string{"Address", "State", "Services"}
}

// TableRow implements statedb.TableWritable.
func (b *Backend) TableRow() []string {
	var svcs []string
	for _, inst := range b.Services {
		s := inst.Service.String()
		if inst.PortName != "" {
			s += " (" + inst.PortName + ")"
		}
		if len(svcs) == 0 || svcs[len(svcs)-1] != s {
			svcs = append(svcs, s)
		}
	}
	return []string{b.Address.String(), b.State.String(), strings.Join(svcs, ", ")}
}

func serviceNameFromString(s string) (index.Key, error) {
	n, err := ParseServiceName(s)
	if err != nil {
		return nil, err
	}
	return index.String(n.String()), nil
}

func l4AddrFromString(s string) (index.Key, error) {
	a, err := ParseL4Addr(s)
	if err != nil {
		return nil, err
	}
	return a.Key(), nil
}

// ServiceNameIndex is the primary index of the services table.
var ServiceNameIndex = statedb.Index[*Service, ServiceName]{
	Name:       "name",
	FromObject: func(s *Service) index.KeySet { return index.NewKeySet(index.String(s.Name.String())) },
	FromKey:    func(n ServiceName) index.Key { return index.String(n.String()) },
	FromString: serviceNameFromString,
	Unique:     true,
}

// FrontendAddressIndex is the primary index of the frontends table.
var FrontendAddressIndex = statedb.Index[*Frontend, L4Addr]{
	Name:       "address",
	FromObject: func(f *Frontend) index.KeySet { return index.NewKeySet(f.Address.Key()) },
	FromKey:    L4Addr.Key,
	FromString: l4AddrFromString,
	Unique:     true,
}

// BackendAddressIndex is the primary index of the backends table.
var BackendAddressIndex = statedb.Index[*Backend, L4Addr]{
	Name:       "address",
	FromObject: func(b *Backend) index.KeySet { return index.NewKeySet(b.Address.Key()) },
	FromKey:    L4Addr.Key,
	FromString: l4AddrFromString,
	Unique:     true,
}

// NewServicesTable registers the services table with db.
func NewServicesTable(db *statedb.DB) (statedb.RWTable[*Service], error) {
	return statedb.NewTable(db, ServicesTableName, ServiceNameIndex)
}

// NewFrontendsTable registers the frontends table with db.
func NewFrontendsTable(db *statedb.DB) (statedb.RWTable[*Frontend], error) {
	return statedb.NewTable(db, FrontendsTableName, FrontendAddressIndex)
}

// NewBackendsTable registers the backends table with db.
func NewBackendsTable(db *statedb.DB) (statedb.RWTable[*Backend], error) {
	return statedb.NewTable(db, BackendsTableName, BackendAddressIndex)
}

// Compare orders addresses by IP, port, then protocol.
func (a L4Addr) Compare(b L4Addr) int {
	if c := a.Addr.Compare(b.Addr); c != 0 {
		return c
	}
	if a.Port != b.Port {
		return cmp.Compare(a.Port, b.Port)
	}
	return cmp.Compare(a.Proto, b.Proto)
}
