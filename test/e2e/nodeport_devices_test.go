package e2e

import (
	"fmt"
	"os"
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

// npDevice is one row of the nodeport-devices table.
type npDevice struct {
	Name, Attach, Error, SNATAddr string
	Ifindex                       int
}

func (s *npSetup) device(t *testing.T, name string) (npDevice, string) {
	t.Helper()
	var rows []npDevice
	if err := s.a.dump("nodeport-devices", &rows); err != nil {
		return npDevice{}, err.Error()
	}
	for _, r := range rows {
		if r.Name == name {
			return r, fmt.Sprintf("%+v", r)
		}
	}
	return npDevice{}, fmt.Sprintf("no row for %s in %+v", name, rows)
}

// TestNodePortDevicesFollowed: the agent follows its external devices
// live. A device named in --devices that does not exist yet has a row
// saying so; once it appears the programs are on it (a client behind it
// reaches a node port), and its SNAT address follows its addresses; when
// it goes, its row says so again and the other devices keep working.
func TestNodePortDevicesFollowed(t *testing.T) {
	late := fmt.Sprintf("e2e%s%d", "npx", os.Getpid()%100000) // makeNPNetns's name
	s := setupNodePort(t, "", "auto", "--devices="+late)
	testenv.Eventually(t, waitTimeout, late+" missing", func() (bool, string) {
		r, got := s.device(t, late)
		return r.Error != "" && r.Attach == "", got
	})

	x := makeNPNetns(t, "npx", "10.241.3.1", "10.241.3.2", "fd00:f4::1", "fd00:f4::2")
	testenv.Eventually(t, waitTimeout, late+" attached once it exists", func() (bool, string) {
		r, got := s.device(t, late)
		return r.Attach == "tcx" && r.Error == "" && r.SNATAddr == "10.241.3.1", got
	})
	testenv.Eventually(t, waitTimeout, "a client behind "+late+" reaches the node port", func() (bool, string) {
		got := x.run(t, connectEnv+"="+npNode4+":30081")
		return got == "ok: hello 10.241.3.2", got
	})

	ipCmd(t, "addr", "flush", "dev", late, "scope", "global", "to", "10.241.3.0/24")
	ipCmd(t, "addr", "add", "10.241.3.9/24", "dev", late)
	testenv.Eventually(t, waitTimeout, "the SNAT address follows "+late+"'s address", func() (bool, string) {
		r, got := s.device(t, late)
		return r.Attach == "tcx" && r.SNATAddr == "10.241.3.9", got
	})

	ipCmd(t, "link", "del", late)
	testenv.Eventually(t, waitTimeout, late+" gone", func() (bool, string) {
		r, got := s.device(t, late)
		return r.Error != "" && r.Attach == "", got
	})
	if got := s.client.run(t, connectEnv+"="+npNode4+":30081"); got != "ok: hello "+npClient4 {
		t.Errorf("the first device after another went: %q", got)
	}
}
