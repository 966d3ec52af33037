package policy

import (
	"testing"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/tables"
)

// TestVerdictReason: the datapath says "default deny"; the endpoint's row
// tells whether an invalid policy keeps that direction denied, and the
// verdict then names it.
func TestVerdictReason(t *testing.T) {
	db := statedb.New()
	endpoints, err := tables.NewEndpointPolicyTable(db)
	if err != nil {
		t.Fatal(err)
	}
	identities, err := tables.NewIdentitiesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	policies, err := tables.NewPoliciesTable(db)
	if err != nil {
		t.Fatal(err)
	}
	sels, err := tables.NewSelectorsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	const bad, good = "cnp/default/bad", "cnp/default/good"
	// Endpoint 3 shares two allows of policy set 7: UDP 53 to every pod
	// (by two policies) and TCP 8000-8255 to the web pods (by a third).
	const dnsA, dnsB, webAll = "netpol/ns/dns-b", "netpol/ns/dns-a", "netpol/ns/web"
	shared := []tables.SharedRule{
		{Policy: dnsA, Direction: tables.DirEgress, Peer: "every-pod", Protocol: 17, Port: 53, PortBits: 16},
		{Policy: dnsB, Direction: tables.DirEgress, Peer: "every-pod", Protocol: 17, Port: 53, PortBits: 16},
		{Policy: webAll, Direction: tables.DirEgress, Peer: "web", Protocol: 6, Port: 8000, PortBits: 8},
	}
	wtxn := db.WriteTxn(endpoints, policies, sels)
	for _, sel := range []*tables.Selector{{Selector: "every-pod", Identities: []uint32{1000, 1001}}, {Selector: "web", Identities: []uint32{1001}}} {
		if _, _, err := sels.Insert(wtxn, sel); err != nil {
			t.Fatal(err)
		}
	}
	for _, row := range []*tables.EndpointPolicy{
		{Name: "default/web", ID: 1, FailClosedEgress: []string{bad}},
		{Name: "default/db", ID: 2},
		{Name: "ns/client", ID: 3, SharedRules: shared},
	} {
		if _, _, err := endpoints.Insert(wtxn, row); err != nil {
			t.Fatal(err)
		}
	}
	const tiered, pass, accept = "clusternetpol/t", "clusternetpol/t/pass-beta", "clusternetpol/t/ingress[1]"
	if _, _, err := policies.Insert(wtxn, &tables.Policy{Name: tiered, Specs: []tables.PolicySpec{{Rules: []tables.PolicyRule{
		{Tier: tables.TierAdmin, Pass: true, Label: pass}, {Tier: tables.TierAdmin, Index: 1, Label: accept},
	}}}}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := policies.Insert(wtxn, &tables.Policy{Name: good}); err != nil {
		t.Fatal(err)
	}
	wtxn.Commit()
	r := &eventReader{
		db: db, identities: identities, endpoints: endpoints, policies: policies, selectors: sels,
		endpointRows: map[uint32]*tables.EndpointPolicy{}, policyNames: map[uint32]string{},
	}
	for _, tc := range []struct {
		name                   string
		ev                     bpf.PolicyEvent
		wantEndpoint           string
		wantReason, wantPolicy string
	}{
		{"fail-closed direction", bpf.PolicyEvent{EndpointID: 1, Direction: bpf.PolicyEgress, Verdict: bpf.PolicyVerdictDenied, Reason: bpf.PolicyReasonDefaultDeny},
			"default/web", ReasonFailClosed, bad},
		{"the other direction", bpf.PolicyEvent{EndpointID: 1, Direction: bpf.PolicyIngress, Verdict: bpf.PolicyVerdictDenied, Reason: bpf.PolicyReasonDefaultDeny},
			"default/web", ReasonDefaultDeny, ""},
		{"an endpoint without invalid policies", bpf.PolicyEvent{EndpointID: 2, Direction: bpf.PolicyEgress, Verdict: bpf.PolicyVerdictDenied, Reason: bpf.PolicyReasonDefaultDeny},
			"default/db", ReasonDefaultDeny, ""},
		{"an entry decided", bpf.PolicyEvent{EndpointID: 1, Direction: bpf.PolicyEgress, Cookie: policyCookie(good), Reason: bpf.PolicyReasonEntry},
			"default/web", ReasonPolicy, good},
		{"a ClusterNetworkPolicy rule", bpf.PolicyEvent{EndpointID: 2, Direction: bpf.PolicyIngress, Cookie: policyCookie(accept), Reason: bpf.PolicyReasonEntry},
			"default/db", ReasonPolicy, accept},
		{"a policy after a Pass", bpf.PolicyEvent{EndpointID: 2, Direction: bpf.PolicyIngress, Cookie: policyCookie(pass + passArrow + good), Reason: bpf.PolicyReasonEntry},
			"default/db", ReasonPolicy, pass + passArrow + good},
		{"a default deny after a Pass", bpf.PolicyEvent{EndpointID: 2, Direction: bpf.PolicyIngress, Verdict: bpf.PolicyVerdictDenied, Cookie: policyCookie(pass), Reason: bpf.PolicyReasonDefaultDeny},
			"default/db", ReasonDefaultDeny, pass},
		{"a policy set's allow: the endpoint's first policy of the rule", bpf.PolicyEvent{EndpointID: 3, Direction: bpf.PolicyEgress,
			Cookie: policyCookie(tables.PolicySetName(7)), Reason: bpf.PolicyReasonEntry, Protocol: 17, RemotePort: bpf.NewBe16(53), RemoteIdentity: 1000},
			"ns/client", ReasonPolicy, dnsB},
		{"a policy set's allow of another port and peer", bpf.PolicyEvent{EndpointID: 3, Direction: bpf.PolicyEgress,
			Cookie: policyCookie(tables.PolicySetName(7)), Reason: bpf.PolicyReasonEntry, Protocol: 6, RemotePort: bpf.NewBe16(8080), RemoteIdentity: 1001},
			"ns/client", ReasonPolicy, webAll},
		{"a policy set's allow, a peer the rule does not select", bpf.PolicyEvent{EndpointID: 3, Direction: bpf.PolicyEgress,
			Cookie: policyCookie(tables.PolicySetName(7)), Reason: bpf.PolicyReasonEntry, Protocol: 6, RemotePort: bpf.NewBe16(8080), RemoteIdentity: 1000},
			"ns/client", ReasonPolicy, ""},
		{"an unknown endpoint", bpf.PolicyEvent{EndpointID: 9, Direction: bpf.PolicyEgress, Verdict: bpf.PolicyVerdictDenied, Reason: bpf.PolicyReasonDefaultDeny},
			"endpoint 9", ReasonDefaultDeny, ""},
	} {
		v := r.verdict(tc.ev)
		if v.Endpoint != tc.wantEndpoint || v.Reason != tc.wantReason || v.Policy != tc.wantPolicy {
			t.Errorf("%s: endpoint %q reason %q policy %q, want %q %q %q", tc.name, v.Endpoint, v.Reason, v.Policy,
				tc.wantEndpoint, tc.wantReason, tc.wantPolicy)
		}
	}

	// Verdicts of ClusterNetworkPolicy rules count for their policy; after
	// a Pass, for the policy that decided.
	for name, want := range map[string]string{accept: tiered, pass + passArrow + good: good, pass + passArrow + accept: tiered, good: good} {
		if got := r.countedPolicy(name); got != want {
			t.Errorf("verdict of %q counted for %q, want %q", name, got, want)
		}
	}

	// The row changes (the policy fixed): the next verdict follows.
	wtxn = db.WriteTxn(endpoints)
	endpoints.Insert(wtxn, &tables.EndpointPolicy{Name: "default/web", ID: 1})
	wtxn.Commit()
	v := r.verdict(bpf.PolicyEvent{EndpointID: 1, Direction: bpf.PolicyEgress, Verdict: bpf.PolicyVerdictDenied, Reason: bpf.PolicyReasonDefaultDeny})
	if v.Reason != ReasonDefaultDeny || v.Policy != "" {
		t.Errorf("after the fix: reason %q policy %q", v.Reason, v.Policy)
	}
}
