package policy

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/apiary-net/apiary/tables"
)

// tableOutput applies the engine's output to maps, as the tables would
// hold it.
type tableOutput struct {
	entries   map[string]*tables.PolicyEntry
	endpoints map[string]*tables.EndpointPolicy
	writes    int
}

func newTableOutput() *tableOutput {
	return &tableOutput{entries: map[string]*tables.PolicyEntry{}, endpoints: map[string]*tables.EndpointPolicy{}}
}

func (o *tableOutput) upsertEntry(e *tables.PolicyEntry) { o.entries[e.Key()] = e; o.writes++ }
func (o *tableOutput) deleteEntry(e *tables.PolicyEntry) { delete(o.entries, e.Key()); o.writes++ }
func (o *tableOutput) upsertEndpoint(e *tables.EndpointPolicy) {
	o.endpoints[e.Name] = e
}
func (o *tableOutput) deleteEndpoint(name string) { delete(o.endpoints, name) }

// list returns the entries of an endpoint as "identity dir port verdict".
func (o *tableOutput) list(ep string) []string {
	var out []string
	for _, e := range o.entries {
		if e.Endpoint != ep {
			continue
		}
		v := "allow"
		if e.Deny {
			v = "deny"
		}
		out = append(out, fmt.Sprintf("%d %s %s %s", e.Identity, e.Direction,
			tables.PortPrefixString(e.Protocol, e.Port, e.PortBits), v))
	}
	slices.Sort(out)
	return out
}

func endpointRow(name string, id uint32, cgroup uint64, ports ...tables.NamedPort) *tables.Endpoint {
	return &tables.Endpoint{Name: name, Identity: id, CgroupID: cgroup, Cgroup: "pod" + name, NamedPorts: ports}
}

func egress(deny bool, peers []string, ports ...tables.PortRule) tables.PolicyRule {
	return tables.PolicyRule{Direction: tables.DirEgress, Deny: deny, Peers: peers, Ports: ports}
}

func ingress(deny bool, peers []string, ports ...tables.PortRule) tables.PolicyRule {
	return tables.PolicyRule{Direction: tables.DirIngress, Deny: deny, Peers: peers, Ports: ports}
}

func tcp(port, end uint16) tables.PortRule {
	return tables.PortRule{Protocol: tables.ProtoTCP, Port: port, EndPort: end}
}

func spec(subject string, rules ...tables.PolicyRule) tables.PolicySpec {
	s := tables.PolicySpec{Subject: subject, Rules: rules}
	for _, r := range rules {
		if r.Direction == tables.DirIngress {
			s.Ingress, s.DefaultDenyIngress = true, true
		} else {
			s.Egress, s.DefaultDenyEgress = true, true
		}
	}
	return s
}

func TestEngine(t *testing.T) {
	const web, db, world = 256, 257, 2
	tests := []struct {
		name     string
		specs    map[string][]tables.PolicySpec
		sels     map[string][]uint32
		mode     string
		want     []string
		wantIn   string
		wantOut  string
		endpoint *tables.Endpoint
	}{
		{
			name:    "unselected endpoint: nothing enforced",
			sels:    map[string][]uint32{"app=web": {web}},
			specs:   map[string][]tables.PolicySpec{"cnp/x": {spec("app=other", egress(false, []string{"app=db"}))}},
			wantIn:  tables.EnforceOff,
			wantOut: tables.EnforceOff,
		},
		{
			name:    "egress allow to a selector on a port",
			sels:    map[string][]uint32{"app=web": {web}, "app=db": {db}},
			specs:   map[string][]tables.PolicySpec{"cnp/x": {spec("app=web", egress(false, []string{"app=db"}, tcp(5432, 0)))}},
			want:    []string{"257 egress TCP/5432 allow"},
			wantIn:  tables.EnforceOff,
			wantOut: tables.EnforceDefaultDeny,
		},
		{
			name:    "port range as prefixes",
			sels:    map[string][]uint32{"app=web": {web}, "app=db": {db}},
			specs:   map[string][]tables.PolicySpec{"cnp/x": {spec("app=web", egress(false, []string{"app=db"}, tcp(8080, 8083)))}},
			want:    []string{"257 egress TCP/8080-8083 allow"},
			wantIn:  tables.EnforceOff,
			wantOut: tables.EnforceDefaultDeny,
		},
		{
			name: "deny of the same identity wins over a longer allow",
			sels: map[string][]uint32{"app=web": {web}, "app=db": {db}},
			specs: map[string][]tables.PolicySpec{
				"cnp/allow": {spec("app=web", egress(false, []string{"app=db"}, tcp(80, 0)))},
				"cnp/deny":  {spec("app=web", egress(true, []string{"app=db"}))},
			},
			want:    []string{"257 egress ANY deny", "257 egress TCP/80 deny"},
			wantIn:  tables.EnforceOff,
			wantOut: tables.EnforceDefaultDeny,
		},
		{
			name:    "entity all and ports without peers: identity 0",
			sels:    map[string][]uint32{"app=web": {web}},
			specs:   map[string][]tables.PolicySpec{"cnp/x": {spec("app=web", ingress(false, []string{tables.AnyPeer}, tcp(80, 0)))}},
			want:    []string{"0 ingress TCP/80 allow"},
			wantIn:  tables.EnforceDefaultDeny,
			wantOut: tables.EnforceOff,
		},
		{
			name: "enableDefaultDeny off: allow all but the denies",
			sels: map[string][]uint32{"app=web": {web}, "world": {world}},
			specs: map[string][]tables.PolicySpec{"cnp/x": {{
				Subject: "app=web", Egress: true,
				Rules: []tables.PolicyRule{egress(true, []string{"world"})},
			}}},
			want:    []string{"0 egress ANY allow", "2 egress ANY deny"},
			wantIn:  tables.EnforceOff,
			wantOut: tables.EnforceDefaultAllow,
		},
		{
			name:     "named port of the endpoint itself on ingress",
			sels:     map[string][]uint32{"app=web": {web}, "app=db": {db}},
			specs:    map[string][]tables.PolicySpec{"cnp/x": {spec("app=web", ingress(false, []string{"app=db"}, tables.PortRule{Protocol: tables.ProtoAny, Name: "http"}))}},
			endpoint: endpointRow("default/web", web, 100, tables.NamedPort{Name: "http", Port: 8080, Protocol: "TCP"}),
			want:     []string{"257 ingress TCP/8080 allow"},
			wantIn:   tables.EnforceDefaultDeny,
			wantOut:  tables.EnforceOff,
		},
		{
			name:    "always: unselected endpoint denies all",
			mode:    ModeAlways,
			sels:    map[string][]uint32{},
			wantIn:  tables.EnforceDefaultDeny,
			wantOut: tables.EnforceDefaultDeny,
		},
		{
			name:    "never: nothing",
			mode:    ModeNever,
			sels:    map[string][]uint32{"app=web": {web}, "app=db": {db}},
			specs:   map[string][]tables.PolicySpec{"cnp/x": {spec("app=web", egress(false, []string{"app=db"}, tcp(5432, 0)))}},
			wantIn:  tables.EnforceOff,
			wantOut: tables.EnforceOff,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			mode := tc.mode
			if mode == "" {
				mode = ModeDefault
			}
			e := newEngine(mode, false, nil)
			for _, name := range slices.Sorted(maps.Keys(tc.sels)) {
				e.setSelector(name, tc.sels[name])
			}
			for name, specs := range tc.specs {
				e.setPolicy(name, specs, false, "")
			}
			ep := tc.endpoint
			if ep == nil {
				ep = endpointRow("default/web", web, 100)
			}
			e.setEndpoint(ep.Name, ep)
			out := newTableOutput()
			e.flush(out)
			if got := out.list(ep.Name); !slices.Equal(got, tc.want) {
				t.Errorf("entries:\n got %s\nwant %s", strings.Join(got, "; "), strings.Join(tc.want, "; "))
			}
			row := out.endpoints[ep.Name]
			if row == nil {
				t.Fatal("no endpoint-policy row")
			}
			if row.Ingress != tc.wantIn || row.Egress != tc.wantOut {
				t.Errorf("enforcement in %s out %s, want in %s out %s", row.Ingress, row.Egress, tc.wantIn, tc.wantOut)
			}
			if row.Entries != len(tc.want) {
				t.Errorf("row says %d entries, want %d", row.Entries, len(tc.want))
			}
		})
	}
}

// TestEngineIncremental: a selector gaining and losing an identity adds
// and removes only that identity's entries; an unchanged flush writes
// nothing; a removed policy restores allow-all.
func TestEngineIncremental(t *testing.T) {
	e := newEngine(ModeDefault, false, nil)
	e.setSelector("app=web", []uint32{256})
	e.setSelector("fqdn:*.example.com", nil)
	e.setPolicy("cnp/x", []tables.PolicySpec{spec("app=web", egress(false, []string{"fqdn:*.example.com"}, tcp(443, 0)))}, false, "")
	e.setEndpoint("default/web", endpointRow("default/web", 256, 100))
	e.setEndpoint("default/web2", endpointRow("default/web2", 256, 101))
	out := newTableOutput()
	e.flush(out)
	if n := len(out.entries); n != 0 {
		t.Fatalf("%d entries before the selector selects anything", n)
	}
	if out.endpoints["default/web"].Egress != tables.EnforceDefaultDeny {
		t.Fatalf("egress %s", out.endpoints["default/web"].Egress)
	}

	out.writes = 0
	e.setSelector("fqdn:*.example.com", []uint32{16777217})
	e.flush(out)
	if got, want := out.list("default/web"), []string{"16777217 egress TCP/443 allow"}; !slices.Equal(got, want) {
		t.Fatalf("after the identity: %v, want %v", got, want)
	}
	if out.writes != 2 {
		t.Errorf("%d entry writes for one identity on two endpoints, want 2", out.writes)
	}

	out.writes = 0
	e.flush(out)
	if out.writes != 0 {
		t.Errorf("unchanged flush wrote %d entries", out.writes)
	}

	e.setSelector("fqdn:*.example.com", []uint32{})
	e.flush(out)
	if n := len(out.entries); n != 0 {
		t.Errorf("%d entries after the identity left the selector", n)
	}

	e.setPolicy("cnp/x", nil, false, "")
	e.flush(out)
	if row := out.endpoints["default/web"]; row.Egress != tables.EnforceOff || len(row.Policies) != 0 {
		t.Errorf("after the policy went: %+v", row)
	}
	e.setEndpoint("default/web", nil)
	e.flush(out)
	if _, ok := out.endpoints["default/web"]; ok {
		t.Error("row of a deleted endpoint stays")
	}
}

// TestEngineRestoredIDs: an endpoint whose cgroup had an ID in the map
// before a restart gets it back; new ones get IDs after the restored.
func TestEngineRestoredIDs(t *testing.T) {
	e := newEngine(ModeDefault, false, map[uint64]uint32{200: 7})
	e.setEndpoint("a/new", endpointRow("a/new", 256, 100))
	e.setEndpoint("a/old", endpointRow("a/old", 256, 200))
	e.setEndpoint("a/nocgroup", endpointRow("a/nocgroup", 256, 0))
	out := newTableOutput()
	e.flush(out)
	for name, want := range map[string]uint32{"a/old": 7, "a/new": 8, "a/nocgroup": 0} {
		if got := out.endpoints[name].ID; got != want {
			t.Errorf("%s: ID %d, want %d", name, got, want)
		}
	}
}

func TestRangePrefixes(t *testing.T) {
	for _, tc := range []struct {
		first, last uint16
		n           int
	}{
		{1, 65535, 16}, {1024, 65535, 6}, {10000, 20000, 11}, {1, 1023, 10}, {0, 1023, 1}, {80, 80, 1}, {0, 65535, 1},
	} {
		got := rangePrefixes(6, tc.first, tc.last)
		if len(got) != tc.n {
			t.Errorf("%d-%d: %d prefixes, want %d: %v", tc.first, tc.last, len(got), tc.n, got)
		}
		// Exactly the range: every port inside is covered once, none
		// outside.
		for _, p := range []uint32{uint32(tc.first), uint32(tc.last), uint32(tc.first) - 1, uint32(tc.last) + 1, (uint32(tc.first) + uint32(tc.last)) / 2} {
			if p > 65535 {
				continue
			}
			n := 0
			for _, pk := range got {
				if pk.covers(portKey{proto: 6, port: uint16(p), bits: 16}) {
					n++
				}
			}
			inside := p >= uint32(tc.first) && p <= uint32(tc.last)
			if (inside && n != 1) || (!inside && n != 0) {
				t.Errorf("%d-%d: port %d covered %d times", tc.first, tc.last, p, n)
			}
		}
	}
}

// TestEngineAudit: the denies of an audited policy (apiary.io/audit) are
// audited entries, unless a policy that is not audited denies the same;
// a direction whose default deny only audited policies make is audited;
// entries carry the cookie of their first policy.
func TestEngineAudit(t *testing.T) {
	e := newEngine(ModeDefault, false, nil)
	e.setSelector("app=web", []uint32{256})
	e.setSelector("app=db", []uint32{257})
	e.setSelector("app=cache", []uint32{258})
	e.setPolicy("cnp/try", []tables.PolicySpec{spec("app=web",
		egress(true, []string{"app=db"}), egress(true, []string{"app=cache"}))}, true, "")
	e.setEndpoint("default/web", endpointRow("default/web", 256, 100))
	out := newTableOutput()
	e.flush(out)
	check := func(what string, id uint32, wantDeny, wantAudit bool, wantPolicy string) {
		t.Helper()
		for _, en := range out.entries {
			if en.Identity == id {
				if en.Deny != wantDeny || en.Audit != wantAudit || en.Cookie != policyCookie(wantPolicy) {
					t.Errorf("%s: %+v, want deny %t audit %t cookie of %s", what, en, wantDeny, wantAudit, wantPolicy)
				}
				return
			}
		}
		t.Errorf("%s: no entry of identity %d", what, id)
	}
	check("audited deny", 257, true, true, "cnp/try")
	if row := out.endpoints["default/web"]; !row.AuditDefaultEgress || row.AuditDefaultIngress {
		t.Errorf("default deny of only an audited policy: %+v", row)
	}

	e.setPolicy("cnp/enforced", []tables.PolicySpec{spec("app=web", egress(true, []string{"app=cache"}))}, false, "")
	e.flush(out)
	check("audited deny beside an enforced one", 258, true, false, "cnp/enforced")
	check("audited deny alone", 257, true, true, "cnp/try")
	if row := out.endpoints["default/web"]; row.AuditDefaultEgress {
		t.Errorf("default deny of an enforced policy too: %+v", row)
	}
}

// failClosedSpec is what an invalid policy's row carries: its subject
// default deny in the directions it has rules in, no rules.
func failClosedSpec(subject string, in, out bool) tables.PolicySpec {
	return tables.PolicySpec{Subject: subject, Ingress: in, Egress: out, DefaultDenyIngress: in, DefaultDenyEgress: out}
}

// TestEngineFailClosed: an invalid policy's fail-closed specs keep the
// endpoints it selects default deny in its directions, whatever the valid
// policies allow there, and the endpoint's row says which policy and why;
// an endpoint without a cgroup is shown as not enforced, with the reason.
func TestEngineFailClosed(t *testing.T) {
	const web, db = 256, 257
	const bad, good = "cnp/default/bad", "cnp/default/good"
	const badErr = "egress[0].toPorts[0].rules.http: not supported"
	tests := []struct {
		name             string
		specs            map[string][]tables.PolicySpec
		invalid          map[string]string // policy → error
		audit            map[string]bool
		endpoint         *tables.Endpoint
		want             []string
		wantIn, wantOut  string
		wantFailIn       []string
		wantFailOut      []string
		wantReason       string
		wantAuditDefault bool
	}{
		{
			name:    "the only egress policy invalid: egress default deny, no entries",
			specs:   map[string][]tables.PolicySpec{bad: {failClosedSpec("app=web", false, true)}},
			invalid: map[string]string{bad: badErr},
			wantIn:  tables.EnforceOff, wantOut: tables.EnforceDefaultDeny,
			wantFailOut: []string{bad},
			wantReason:  "fail closed: " + bad + ": " + badErr,
		},
		{
			name: "beside a valid policy: its allows stay, the invalid one's are gone",
			specs: map[string][]tables.PolicySpec{
				bad:  {failClosedSpec("app=web", true, true)},
				good: {spec("app=web", egress(false, []string{"app=db"}, tcp(5432, 0)))},
			},
			invalid: map[string]string{bad: badErr},
			want:    []string{"257 egress TCP/5432 allow"},
			wantIn:  tables.EnforceDefaultDeny, wantOut: tables.EnforceDefaultDeny,
			wantFailIn: []string{bad}, wantFailOut: []string{bad},
			wantReason: "fail closed: " + bad + ": " + badErr,
		},
		{
			name: "an invalid policy that turned a direction's default deny off: deny",
			specs: map[string][]tables.PolicySpec{
				bad:  {failClosedSpec("app=web", false, true)},
				good: {{Subject: "app=web", Egress: true, Rules: []tables.PolicyRule{egress(true, []string{"app=db"})}}},
			},
			invalid: map[string]string{bad: badErr},
			want:    []string{"257 egress ANY deny"},
			wantIn:  tables.EnforceOff, wantOut: tables.EnforceDefaultDeny,
			wantFailOut: []string{bad},
			wantReason:  "fail closed: " + bad + ": " + badErr,
		},
		{
			name:    "an audited invalid policy: its default deny is audited",
			specs:   map[string][]tables.PolicySpec{bad: {failClosedSpec("app=web", false, true)}},
			invalid: map[string]string{bad: badErr},
			audit:   map[string]bool{bad: true},
			wantIn:  tables.EnforceOff, wantOut: tables.EnforceDefaultDeny,
			wantFailOut: []string{bad}, wantAuditDefault: true,
			wantReason: "fail closed: " + bad + ": " + badErr,
		},
		{
			name:    "not selected: nothing",
			specs:   map[string][]tables.PolicySpec{bad: {failClosedSpec("app=db", false, true)}},
			invalid: map[string]string{bad: badErr},
			wantIn:  tables.EnforceOff, wantOut: tables.EnforceOff,
		},
		{
			name:     "no cgroup: not enforced, with the reason",
			specs:    map[string][]tables.PolicySpec{good: {spec("app=web", egress(false, []string{"app=db"}))}},
			endpoint: &tables.Endpoint{Name: "default/web", Identity: web, CgroupError: `UID "a b" cannot name a kubelet cgroup`},
			wantIn:   tables.EnforceOff, wantOut: tables.EnforceDefaultDeny,
			wantReason: `not enforced: UID "a b" cannot name a kubelet cgroup`,
		},
		{
			name:     "no cgroup yet",
			endpoint: &tables.Endpoint{Name: "default/web", Identity: web},
			wantIn:   tables.EnforceOff, wantOut: tables.EnforceOff,
			wantReason: "not enforced: no cgroup yet",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEngine(ModeDefault, false, nil)
			e.setSelector("app=web", []uint32{web})
			e.setSelector("app=db", []uint32{db})
			for name, specs := range tc.specs {
				e.setPolicy(name, specs, tc.audit[name], tc.invalid[name])
			}
			ep := tc.endpoint
			if ep == nil {
				ep = endpointRow("default/web", web, 100)
			}
			e.setEndpoint(ep.Name, ep)
			out := newTableOutput()
			e.flush(out)
			if got := out.list(ep.Name); !slices.Equal(got, tc.want) {
				t.Errorf("entries:\n got %s\nwant %s", strings.Join(got, "; "), strings.Join(tc.want, "; "))
			}
			row := out.endpoints[ep.Name]
			if row.Ingress != tc.wantIn || row.Egress != tc.wantOut {
				t.Errorf("enforcement in %s out %s, want in %s out %s", row.Ingress, row.Egress, tc.wantIn, tc.wantOut)
			}
			if !slices.Equal(row.FailClosedIngress, tc.wantFailIn) || !slices.Equal(row.FailClosedEgress, tc.wantFailOut) {
				t.Errorf("fail closed in %q out %q, want %q %q", row.FailClosedIngress, row.FailClosedEgress, tc.wantFailIn, tc.wantFailOut)
			}
			if row.Reason != tc.wantReason {
				t.Errorf("reason %q, want %q", row.Reason, tc.wantReason)
			}
			if row.AuditDefaultEgress != tc.wantAuditDefault {
				t.Errorf("audited default deny %t, want %t", row.AuditDefaultEgress, tc.wantAuditDefault)
			}
			if tc.wantReason == "" && row.ID == 0 {
				t.Errorf("no endpoint ID: %+v", row)
			}
		})
	}

	// Fixed: the same policy valid again clears the row's reason.
	e := newEngine(ModeDefault, false, nil)
	e.setSelector("app=web", []uint32{web})
	e.setPolicy(bad, []tables.PolicySpec{failClosedSpec("app=web", false, true)}, false, badErr)
	e.setEndpoint("default/web", endpointRow("default/web", web, 100))
	out := newTableOutput()
	e.flush(out)
	e.setPolicy(bad, []tables.PolicySpec{spec("app=web", egress(false, []string{tables.AnyPeer}))}, false, "")
	e.flush(out)
	if row := out.endpoints["default/web"]; row.Reason != "" || len(row.FailClosedEgress) != 0 || row.Entries != 1 {
		t.Errorf("after the fix: %+v", row)
	}
}

// TestEngineDNS: an endpoint's row lists the names the DNS rules of its
// egress allow rules allow, each once with the first policy (by name) that
// allows it; a deny rule's, or another endpoint's, are not its; the row
// changes when a policy's DNS rules do.
func TestEngineDNS(t *testing.T) {
	dns := func(r tables.PolicyRule, names ...string) tables.PolicyRule { r.DNS = names; return r }
	udp53 := tables.PortRule{Protocol: tables.ProtoUDP, Port: 53}
	e := newEngine(ModeDefault, false, nil)
	e.setSelector("app=web", []uint32{256})
	e.setSelector("app=db", []uint32{257})
	e.setSelector("k8s-app=kube-dns", []uint32{300})
	e.setPolicy("cnp/a", []tables.PolicySpec{spec("app=web",
		dns(egress(false, []string{"k8s-app=kube-dns"}, udp53), "*.example.com", "api.example.org"))}, false, "")
	e.setPolicy("cnp/b", []tables.PolicySpec{spec("app=web",
		dns(egress(false, []string{"k8s-app=kube-dns"}, udp53), "*.example.com", "b.example.net"),
		dns(egress(true, []string{"app=db"}, udp53), "denied.example"))}, false, "")
	e.setEndpoint("default/web", endpointRow("default/web", 256, 100))
	e.setEndpoint("default/db", endpointRow("default/db", 257, 101))
	out := newTableOutput()
	e.flush(out)
	show := func(row *tables.EndpointPolicy) string { return fmt.Sprint(row.DNS) }
	if got, want := show(out.endpoints["default/web"]), "[{*.example.com cnp/a} {api.example.org cnp/a} {b.example.net cnp/b}]"; got != want {
		t.Errorf("web's DNS rules: %s, want %s", got, want)
	}
	if got := out.endpoints["default/db"].DNS; got != nil {
		t.Errorf("db's DNS rules: %v, want none", got)
	}

	e.setPolicy("cnp/a", nil, false, "")
	e.flush(out)
	if got, want := show(out.endpoints["default/web"]), "[{*.example.com cnp/b} {b.example.net cnp/b}]"; got != want {
		t.Errorf("web's DNS rules without cnp/a: %s, want %s", got, want)
	}
}

// TestWithEndpointFQDN: an endpoint's rule naming an FQDN selector also
// names that endpoint's own selector of the pattern; other peers alone
// are kept as they are.
func TestWithEndpointFQDN(t *testing.T) {
	for _, tt := range []struct {
		peers, want []string
	}{
		{nil, nil},
		{[]string{"cidr:10.0.0.0/8"}, []string{"cidr:10.0.0.0/8"}},
		{[]string{"fqdn:*.example.com"}, []string{"fqdn:*.example.com", "fqdn:*.example.com@default/a"}},
		{[]string{"cidr:10.0.0.0/8", "fqdn:a.com", "fqdn:b.com"}, []string{"cidr:10.0.0.0/8", "fqdn:a.com", "fqdn:b.com", "fqdn:a.com@default/a", "fqdn:b.com@default/a"}},
	} {
		in := slices.Clone(tt.peers)
		if got := withEndpointFQDN(in, "default/a"); !slices.Equal(got, tt.want) {
			t.Errorf("withEndpointFQDN(%v) = %v, want %v", tt.peers, got, tt.want)
		}
		if !slices.Equal(in, tt.peers) {
			t.Errorf("withEndpointFQDN changed its input %v to %v", tt.peers, in)
		}
	}
}
