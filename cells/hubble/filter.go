package hubble

import (
	"fmt"
	"net/netip"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"

	flowpb "github.com/cilium/cilium/api/v1/flow"
)

// match reports whether f passes a filter (every field set in it matches).
type match func(f *flowpb.Flow) bool

// filterList is the OR of its filters; an empty list matches every flow
// as an allow list and none as a deny list.
type filterList []match

func (l filterList) any(f *flowpb.Flow) bool {
	return slices.ContainsFunc(l, func(m match) bool { return m(f) })
}

// compileFilters turns the request's filters into matchers, rejecting
// what apiary cannot evaluate with a clear error rather than answering
// with flows the filter would not have let through.
func compileFilters(ffs []*flowpb.FlowFilter) (filterList, error) {
	var out filterList
	for _, ff := range ffs {
		m, err := compileFilter(ff)
		if err != nil {
			return nil, err
		}
		out = append(out, m)
	}
	return out, nil
}

func compileFilter(ff *flowpb.FlowFilter) (match, error) {
	if err := unsupported(ff); err != nil {
		return nil, err
	}
	var ms []match
	add := func(m match) { ms = append(ms, m) }

	for _, ips := range []struct {
		vals []string
		get  func(*flowpb.Flow) string
	}{
		{ff.SourceIp, func(f *flowpb.Flow) string { return f.GetIP().GetSource() }},
		{ff.DestinationIp, func(f *flowpb.Flow) string { return f.GetIP().GetDestination() }},
	} {
		if len(ips.vals) == 0 {
			continue
		}
		prefixes, err := parsePrefixes(ips.vals)
		if err != nil {
			return nil, err
		}
		get := ips.get
		add(func(f *flowpb.Flow) bool {
			a, err := netip.ParseAddr(get(f))
			return err == nil && slices.ContainsFunc(prefixes, func(p netip.Prefix) bool { return p.Contains(a) })
		})
	}
	for _, pods := range []struct {
		vals []string
		get  func(*flowpb.Flow) (ns, name string)
	}{
		{ff.SourcePod, func(f *flowpb.Flow) (string, string) { return f.GetSource().GetNamespace(), f.GetSource().GetPodName() }},
		{ff.DestinationPod, func(f *flowpb.Flow) (string, string) {
			return f.GetDestination().GetNamespace(), f.GetDestination().GetPodName()
		}},
		{ff.SourceService, func(f *flowpb.Flow) (string, string) {
			return f.GetSourceService().GetNamespace(), f.GetSourceService().GetName()
		}},
		{ff.DestinationService, func(f *flowpb.Flow) (string, string) {
			return f.GetDestinationService().GetNamespace(), f.GetDestinationService().GetName()
		}},
	} {
		if len(pods.vals) == 0 {
			continue
		}
		type nameFilter struct{ ns, prefix string }
		var nfs []nameFilter
		for _, v := range pods.vals {
			if v == "" {
				return nil, fmt.Errorf("invalid pod or service filter: empty name")
			}
			ns, prefix, ok := strings.Cut(v, "/")
			if !ok {
				ns, prefix = "default", v
			}
			nfs = append(nfs, nameFilter{ns, prefix})
		}
		get := pods.get
		add(func(f *flowpb.Flow) bool {
			ns, name := get(f)
			if ns == "" && name == "" {
				return false
			}
			return slices.ContainsFunc(nfs, func(n nameFilter) bool {
				return (n.ns == "" || n.ns == ns) && strings.HasPrefix(name, n.prefix)
			})
		})
	}
	for _, wls := range []struct {
		vals []*flowpb.Workload
		get  func(*flowpb.Flow) *flowpb.Endpoint
	}{
		{ff.SourceWorkload, (*flowpb.Flow).GetSource},
		{ff.DestinationWorkload, (*flowpb.Flow).GetDestination},
	} {
		if len(wls.vals) == 0 {
			continue
		}
		// As the reference: an empty kind or name matches any.
		vals, get := wls.vals, wls.get
		add(func(f *flowpb.Flow) bool {
			return slices.ContainsFunc(get(f).GetWorkloads(), func(w *flowpb.Workload) bool {
				return slices.ContainsFunc(vals, func(want *flowpb.Workload) bool {
					return (want.GetName() == "" || want.GetName() == w.GetName()) &&
						(want.GetKind() == "" || want.GetKind() == w.GetKind())
				})
			})
		})
	}
	for _, lbls := range []struct {
		vals []string
		get  func(*flowpb.Flow) *flowpb.Endpoint
	}{
		{ff.SourceLabel, (*flowpb.Flow).GetSource},
		{ff.DestinationLabel, (*flowpb.Flow).GetDestination},
	} {
		if len(lbls.vals) == 0 {
			continue
		}
		var sels []labelSelector
		for _, v := range lbls.vals {
			s, err := parseLabelSelector(v)
			if err != nil {
				return nil, err
			}
			sels = append(sels, s)
		}
		get := lbls.get
		add(func(f *flowpb.Flow) bool {
			l := get(f).GetLabels()
			return slices.ContainsFunc(sels, func(s labelSelector) bool { return s.matches(l) })
		})
	}
	for _, ids := range []struct {
		vals []uint32
		get  func(*flowpb.Flow) *flowpb.Endpoint
	}{
		{ff.SourceIdentity, (*flowpb.Flow).GetSource},
		{ff.DestinationIdentity, (*flowpb.Flow).GetDestination},
	} {
		if len(ids.vals) == 0 {
			continue
		}
		vals, get := ids.vals, ids.get
		add(func(f *flowpb.Flow) bool { return slices.Contains(vals, get(f).GetIdentity()) })
	}
	for _, names := range []struct {
		vals []string
		get  func(*flowpb.Flow) []string
	}{
		{ff.SourceFqdn, (*flowpb.Flow).GetSourceNames},
		{ff.DestinationFqdn, (*flowpb.Flow).GetDestinationNames},
	} {
		if len(names.vals) == 0 {
			continue
		}
		pats, get := names.vals, names.get
		for _, p := range pats {
			if _, err := path.Match(p, ""); err != nil {
				return nil, fmt.Errorf("invalid FQDN pattern %q: %w", p, err)
			}
		}
		add(func(f *flowpb.Flow) bool {
			return slices.ContainsFunc(get(f), func(n string) bool {
				return slices.ContainsFunc(pats, func(p string) bool { ok, _ := path.Match(strings.TrimSuffix(p, "."), n); return ok })
			})
		})
	}
	for _, ports := range []struct {
		vals []string
		get  func(*flowpb.Flow) (uint32, bool)
	}{
		{ff.SourcePort, func(f *flowpb.Flow) (uint32, bool) { s, _, ok := ports(f); return s, ok }},
		{ff.DestinationPort, func(f *flowpb.Flow) (uint32, bool) { _, d, ok := ports(f); return d, ok }},
	} {
		if len(ports.vals) == 0 {
			continue
		}
		var want []uint32
		for _, v := range ports.vals {
			n, err := strconv.ParseUint(v, 10, 16)
			if err != nil {
				return nil, fmt.Errorf("invalid port %q: %w", v, err)
			}
			want = append(want, uint32(n))
		}
		get := ports.get
		add(func(f *flowpb.Flow) bool { p, ok := get(f); return ok && slices.Contains(want, p) })
	}
	if len(ff.Verdict) > 0 {
		add(func(f *flowpb.Flow) bool { return slices.Contains(ff.Verdict, f.GetVerdict()) })
	}
	if len(ff.DropReasonDesc) > 0 {
		add(func(f *flowpb.Flow) bool { return slices.Contains(ff.DropReasonDesc, f.GetDropReasonDesc()) })
	}
	if len(ff.TrafficDirection) > 0 {
		add(func(f *flowpb.Flow) bool { return slices.Contains(ff.TrafficDirection, f.GetTrafficDirection()) })
	}
	if len(ff.IpVersion) > 0 {
		add(func(f *flowpb.Flow) bool { return slices.Contains(ff.IpVersion, f.GetIP().GetIpVersion()) })
	}
	if len(ff.Reply) > 0 {
		add(func(f *flowpb.Flow) bool {
			return f.GetIsReply() != nil && slices.Contains(ff.Reply, f.GetIsReply().GetValue())
		})
	}
	if len(ff.Encrypted) > 0 {
		// Nothing apiary forwards is encrypted by it.
		add(func(*flowpb.Flow) bool { return slices.Contains(ff.Encrypted, false) })
	}
	if len(ff.EventType) > 0 {
		types := ff.EventType
		add(func(f *flowpb.Flow) bool {
			et := f.GetEventType()
			return et != nil && slices.ContainsFunc(types, func(t *flowpb.EventTypeFilter) bool {
				return (t.GetType() == 0 || t.GetType() == et.GetType()) && (!t.GetMatchSubType() || t.GetSubType() == et.GetSubType())
			})
		})
	}
	if len(ff.Protocol) > 0 {
		var protos []string
		for _, p := range ff.Protocol {
			p = strings.ToLower(p)
			switch p {
			case "icmp", "icmpv4", "icmpv6", "tcp", "udp", "sctp", "vrrp", "igmp", "dns", "http", "kafka":
			default:
				return nil, fmt.Errorf("unknown protocol: %q", p)
			}
			protos = append(protos, p)
		}
		add(func(f *flowpb.Flow) bool {
			return slices.ContainsFunc(protos, func(p string) bool { return hasProtocol(f, p) })
		})
	}
	if len(ff.DnsQuery) > 0 {
		var res []*regexp.Regexp
		for _, q := range ff.DnsQuery {
			re, err := regexp.Compile(q)
			if err != nil {
				return nil, fmt.Errorf("invalid DNS query pattern %q: %w", q, err)
			}
			res = append(res, re)
		}
		add(func(f *flowpb.Flow) bool {
			d := f.GetL7().GetDns()
			return d != nil && slices.ContainsFunc(res, func(re *regexp.Regexp) bool { return re.MatchString(d.GetQuery()) })
		})
	}
	if len(ff.NodeName) > 0 {
		pats := ff.NodeName
		for _, p := range pats {
			if _, err := path.Match(p, ""); err != nil {
				return nil, fmt.Errorf("invalid node name pattern %q: %w", p, err)
			}
		}
		add(func(f *flowpb.Flow) bool {
			return slices.ContainsFunc(pats, func(p string) bool {
				// "<cluster>/<node>": apiary's one cluster is "default".
				if c, n, ok := strings.Cut(p, "/"); ok {
					if ok, _ := path.Match(c, "default"); !ok {
						return false
					}
					p = n
				}
				ok, _ := path.Match(p, f.GetNodeName())
				return ok
			})
		})
	}
	// HTTP and TCP-flag filters are valid requests, but apiary's flows
	// carry neither: nothing matches them.
	if len(ff.HttpStatusCode)+len(ff.HttpMethod)+len(ff.HttpPath)+len(ff.HttpUrl)+len(ff.HttpHeader)+len(ff.TcpFlags) > 0 {
		add(func(*flowpb.Flow) bool { return false })
	}
	return func(f *flowpb.Flow) bool {
		for _, m := range ms {
			if !m(f) {
				return false
			}
		}
		return true
	}, nil
}

// unsupported rejects the filter fields apiary's flows cannot answer.
func unsupported(ff *flowpb.FlowFilter) error {
	for _, u := range []struct {
		set  bool
		name string
	}{
		{len(ff.Uuid) > 0, "uuid"},
		{len(ff.SourceIpXlated) > 0, "source_ip_xlated"},
		{len(ff.SourceClusterName)+len(ff.DestinationClusterName) > 0, "cluster name"},
		{len(ff.Interface) > 0, "interface"},
		{len(ff.NodeLabels) > 0, "node labels"},
		{len(ff.TraceId)+len(ff.IpTraceId) > 0, "trace ID"},
		{ff.Experimental != nil && ff.Experimental.CelExpression != nil, "CEL expression"},
	} {
		if u.set {
			return fmt.Errorf("filtering by %s is not supported by apiary", u.name)
		}
	}
	return nil
}

func parsePrefixes(vals []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, v := range vals {
		if strings.Contains(v, "/") {
			p, err := netip.ParsePrefix(v)
			if err != nil {
				return nil, fmt.Errorf("invalid CIDR %q: %w", v, err)
			}
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(v)
		if err != nil {
			return nil, fmt.Errorf("invalid IP %q: %w", v, err)
		}
		out = append(out, netip.PrefixFrom(a, a.BitLen()))
	}
	return out, nil
}

func ports(f *flowpb.Flow) (src, dst uint32, ok bool) {
	l4 := f.GetL4()
	switch {
	case l4.GetTCP() != nil:
		return l4.GetTCP().GetSourcePort(), l4.GetTCP().GetDestinationPort(), true
	case l4.GetUDP() != nil:
		return l4.GetUDP().GetSourcePort(), l4.GetUDP().GetDestinationPort(), true
	case l4.GetSCTP() != nil:
		return l4.GetSCTP().GetSourcePort(), l4.GetSCTP().GetDestinationPort(), true
	}
	return 0, 0, false
}

func hasProtocol(f *flowpb.Flow, p string) bool {
	l4, l7 := f.GetL4(), f.GetL7()
	switch p {
	case "icmp":
		return l4.GetICMPv4() != nil || l4.GetICMPv6() != nil
	case "icmpv4":
		return l4.GetICMPv4() != nil
	case "icmpv6":
		return l4.GetICMPv6() != nil
	case "tcp":
		return l4.GetTCP() != nil
	case "udp":
		return l4.GetUDP() != nil
	case "sctp":
		return l4.GetSCTP() != nil
	case "dns":
		return l7.GetDns() != nil
	}
	return false
}

// labelSelector is a comma-separated list of requirements on a flow
// endpoint's labels: "key=value", "key!=value", "key" or "!key". A key
// without a source ("app", or "any:app") matches the key of any source;
// "k8s:app" only the k8s one.
type labelSelector []labelReq

type labelReq struct {
	source, key, value string
	op                 string // "=", "!=", "exists", "!exists"
}

func parseLabelSelector(s string) (labelSelector, error) {
	var sel labelSelector
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			return nil, fmt.Errorf("invalid label selector %q: empty requirement", s)
		}
		var r labelReq
		switch {
		case strings.Contains(part, "!="):
			r.key, r.value, _ = strings.Cut(part, "!=")
			r.op = "!="
		case strings.Contains(part, "=="):
			r.key, r.value, _ = strings.Cut(part, "==")
			r.op = "="
		case strings.Contains(part, "="):
			r.key, r.value, _ = strings.Cut(part, "=")
			r.op = "="
		case strings.HasPrefix(part, "!"):
			r.key, r.op = part[1:], "!exists"
		default:
			r.key, r.op = part, "exists"
		}
		if strings.ContainsAny(r.key, " ()") || r.key == "" {
			return nil, fmt.Errorf("invalid label selector %q: apiary takes key=value, key!=value, key and !key", s)
		}
		if src, key, ok := strings.Cut(r.key, ":"); ok {
			r.source, r.key = src, key
		}
		if r.source == "any" {
			r.source = ""
		}
		sel = append(sel, r)
	}
	return sel, nil
}

func (s labelSelector) matches(labels []string) bool {
	for _, r := range s {
		found, value := false, ""
		for _, l := range labels {
			src, kv, ok := strings.Cut(l, ":")
			if !ok {
				src, kv = "", l
			}
			k, v, _ := strings.Cut(kv, "=")
			if k == r.key && (r.source == "" || r.source == src) {
				found, value = true, v
				break
			}
		}
		switch r.op {
		case "=":
			if !found || value != r.value {
				return false
			}
		case "!=":
			if found && value == r.value {
				return false
			}
		case "exists":
			if !found {
				return false
			}
		case "!exists":
			if found {
				return false
			}
		}
	}
	return true
}
