package socketlb_test

import (
	"testing"

	"github.com/apiary-net/apiary/internal/testenv"
)

func TestTCP(t *testing.T)     { runScripts(t, "testdata/tcp.txtar") }
func TestUDP(t *testing.T)     { runScripts(t, "testdata/udp.txtar") }
func TestRestart(t *testing.T) { runScripts(t, "testdata/restart.txtar") }
func TestDisable(t *testing.T) { runScripts(t, "testdata/disable.txtar") }

func TestAffinity(t *testing.T) { runScripts(t, "testdata/affinity.txtar") }

func TestIPv6(t *testing.T) {
	testenv.RequireRoot(t)
	addLoopback(t, "fd00:97::11", "fd00:97::12")
	runScripts(t, "testdata/ipv6.txtar")
}
