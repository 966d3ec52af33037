package main

import (
	"github.com/cilium/hive/cell"

	"github.com/apiary-net/apiary/cells/clusternetpolstatus"
	"github.com/apiary-net/apiary/cells/clusternodes"
	"github.com/apiary-net/apiary/cells/cnichain"
	"github.com/apiary-net/apiary/cells/ct"
	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/cells/hubble"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/identitymode"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/ipam"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/lb"
	"github.com/apiary-net/apiary/cells/nodeport"
	"github.com/apiary-net/apiary/cells/policy"
	"github.com/apiary-net/apiary/cells/proxyhealth"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/cells/socketlb"
)

// ControlPlane lists the agent's features. Including a cell switches its
// feature on.
var ControlPlane = cell.Group(
	ct.Cell,       // conntrack maps: sizing, resize keeping connections, GC
	ipam.Cell,     // agent IPs (health, ingress) through the delegated CNI IPAM plugin
	lb.Cell,       // load balancing: services, frontends, backends → lb4_*, lb6_* maps
	socketlb.Cell, // socket LB: cgroup connect/sendmsg/recvmsg hooks of both families on the lb maps (--enable-socket-lb)
	// kube-proxy's health endpoint and Services' healthCheckNodePorts (--kube-proxy-healthz-addr, --enable-health-check-node-port)
	proxyhealth.Cell,
	nodeport.Cell, // north-south LB: tc programs on the external devices for NodePort, LoadBalancer, external IPs (--enable-nodeport)
	// --identity-management-mode: agent numbers, or the operator's Identities and temporary numbers
	identitymode.Cell,
	identity.Cell, // security identities: allocator, checkpoint in --state-dir
	ipcache.Cell,  // prefix labels → identities → ipcache map
	// Node objects: the nodes table, other nodes' addresses → reserved:remote-node
	clusternodes.Cell,
	selectors.Cell, // CiliumNetworkPolicies: policies, selectors, policy CIDR prefixes
	// ClusterNetworkPolicies' status conditions (Ready-On-Node-<node>) → the objects, clusternetpol-status
	clusternetpolstatus.Cell,
	fqdn.Cell,      // DNS proxy: addresses of names FQDN selectors match → prefixes (fqdn-names)
	endpoints.Cell, // pods: security labels of pod IPs, endpoints of this node, their cgroups
	policy.Cell,    // policy enforcement: per-endpoint entries → policy maps, cgroup programs (--enable-policy)
	cnichain.Cell,  // apiary-cni chained into the node's CNI configuration (--cni-chaining-mode)
	hubble.Cell,    // Hubble's observer gRPC API over the verdict stream (--enable-hubble)
)

// agentCells is the whole agent:
//   - infra.Cell: statedb, health, jobs, metrics, the HTTP API, the
//     node's config, bpffs, the cgroup root and the input sources
//     (Kubernetes, --config-dir);
//   - the Kubernetes client (tests swap in a fake one);
//   - the control plane.
func agentCells(k8sClient cell.Cell) []cell.Cell {
	return []cell.Cell{infra.Cell, k8sClient, ControlPlane}
}
