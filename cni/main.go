// Command apiary-cni is a chained CNI plugin: listed after the plugin that
// makes a pod's interface (ptp, bridge, …), it attaches apiary's interface
// programs (policy_from_pod, policy_to_pod) to the host side of the pod's
// veth before any of the pod's containers runs, with an entry in
// policy_ifaces that denies the pod both ways until the agent classifies
// it. A pod created while the agent is down is thus judged at the packet
// level from its first frame; the agent, when it finds the pod, writes the
// pod's own entry and keeps the links.
//
// The plugin loads no program of its own: it uses the ones the agent pins
// under --bpf-pin-dir (bpf/podiface). Without them ADD fails, so that the
// pod does not start unenforced, unless the netconf says "failOpen": true.
// See docs/policy.md ("The CNI plugin").
//
// Netconf keys besides the standard ones:
//
//	bpfPinDir  the agent's --bpf-pin-dir [/sys/fs/bpf/apiary]
//	attach     auto | tcx | tc, as the agent's --policy-interface-attach [auto]
//	failOpen   let the pod start unenforced when the agent's programs are not pinned [false]
package main

import (
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"
)

// supported are the CNI versions whose results list interfaces.
var supported = version.PluginSupports("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

func main() {
	skel.PluginMainFuncs(skel.CNIFuncs{Add: cmdAdd, Del: cmdDel, Check: cmdCheck}, supported,
		"apiary-cni: apiary's packet-level policy on a pod's interface from its creation")
}
