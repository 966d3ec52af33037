//go:build cluster

package cluster

import (
	"context"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/miekg/dns"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// clusterDomain is the cluster's DNS domain, as the kubelet writes it into
// pods' search lists.
const clusterDomain = "cluster.local"

// serveClusterDNS answers the cluster's Service names on the node's
// address (UDP and TCP port 53) from the API server, in place of the
// cluster DNS add-on (CoreDNS) that test/cluster does not run:
// <service>.<namespace>.svc.cluster.local is the Service's cluster IPs, or
// the ready addresses of its EndpointSlices when it is headless. Anything
// else is NXDOMAIN. It is the test's, not the product's: the Services suite
// reaches Services by name.
func (n *node) serveClusterDNS() {
	t := n.t
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
		resp := new(dns.Msg)
		resp.SetReply(req)
		resp.Authoritative = true
		if len(req.Question) == 1 {
			q := req.Question[0]
			ips, found := n.resolveService(q.Name)
			if !found {
				resp.Rcode = dns.RcodeNameError
			}
			for _, ip := range ips {
				switch {
				case q.Qtype == dns.TypeA && ip.Is4():
					resp.Answer = append(resp.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 5}, A: net.IP(ip.AsSlice())})
				case q.Qtype == dns.TypeAAAA && ip.Is6():
					resp.Answer = append(resp.Answer, &dns.AAAA{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeAAAA, Class: dns.ClassINET, Ttl: 5}, AAAA: net.IP(ip.AsSlice())})
				}
			}
		}
		w.WriteMsg(resp)
	})
	addr := net.JoinHostPort(nodeIP, "53")
	for _, proto := range []string{"udp", "tcp"} {
		srv := &dns.Server{Addr: addr, Net: proto, Handler: handler}
		started := make(chan error, 1)
		srv.NotifyStartedFunc = func() { started <- nil }
		go func() { started <- srv.ListenAndServe() }()
		if err := <-started; err != nil {
			t.Fatalf("cluster DNS on %s/%s: %v", addr, proto, err)
		}
		t.Cleanup(func() { srv.Shutdown() })
	}
}

// resolveService returns the addresses of a Service's DNS name, and
// whether the name is a Service's.
func (n *node) resolveService(name string) ([]netip.Addr, bool) {
	labels := strings.Split(strings.TrimSuffix(strings.ToLower(name), "."), ".")
	suffix := append([]string{"svc"}, strings.Split(clusterDomain, ".")...)
	if len(labels) != 2+len(suffix) || strings.Join(labels[2:], ".") != strings.Join(suffix, ".") {
		return nil, false
	}
	svcName, ns := labels[0], labels[1]
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	svc, err := n.cs.CoreV1().Services(ns).Get(ctx, svcName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) || err != nil {
		return nil, false
	}
	var out []netip.Addr
	if svc.Spec.ClusterIP != corev1.ClusterIPNone {
		for _, raw := range svc.Spec.ClusterIPs {
			if ip, err := netip.ParseAddr(raw); err == nil {
				out = append(out, ip)
			}
		}
		return out, true
	}
	slices, err := n.cs.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + svcName})
	if err != nil {
		return nil, true
	}
	for _, s := range slices.Items {
		for _, ep := range s.Endpoints {
			if ep.Conditions.Ready != nil && !*ep.Conditions.Ready {
				continue
			}
			for _, raw := range ep.Addresses {
				if ip, err := netip.ParseAddr(raw); err == nil {
					out = append(out, ip)
				}
			}
		}
	}
	return out, true
}
