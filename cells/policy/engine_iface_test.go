package policy

import (
	"testing"

	"github.com/apiary-net/apiary/tables"
)

// TestEngineNoInterface: an endpoint whose interface cannot be found is
// default deny both ways with no entries, whatever its policies allow, and
// its row says why; found, it is back to its policies.
func TestEngineNoInterface(t *testing.T) {
	e := newEngine(ModeDefault, false, nil)
	e.setSelector("app=web", []uint32{256})
	e.setPolicy("cnp/x", []tables.PolicySpec{spec("app=web", egress(false, []string{tables.AnyPeer}, tcp(443, 0)))}, false, "")
	e.setEndpoint("default/web", endpointRow("default/web", 256, 100))
	out := newTableOutput()
	e.flush(out)
	if got := out.list("default/web"); len(got) != 1 {
		t.Fatalf("entries %v, want the allow", got)
	}

	e.setNoInterface("default/web", "no veth")
	e.flush(out)
	row := out.endpoints["default/web"]
	if row.Ingress != tables.EnforceDefaultDeny || row.Egress != tables.EnforceDefaultDeny || row.ID == 0 ||
		row.Reason != tables.ReasonFailClosed+"no pod interface: no veth" || len(out.list("default/web")) != 0 {
		t.Errorf("without an interface: %+v, entries %v", row, out.list("default/web"))
	}

	e.setNoInterface("default/web", "")
	e.flush(out)
	row = out.endpoints["default/web"]
	if row.Ingress != tables.EnforceOff || row.Egress != tables.EnforceDefaultDeny || row.Reason != "" || len(out.list("default/web")) != 1 {
		t.Errorf("found again: %+v, entries %v", row, out.list("default/web"))
	}
}
