package socketlb_test

import "testing"

func TestTCP(t *testing.T)     { runScripts(t, "testdata/tcp.txtar") }
func TestUDP(t *testing.T)     { runScripts(t, "testdata/udp.txtar") }
func TestRestart(t *testing.T) { runScripts(t, "testdata/restart.txtar") }
func TestDisable(t *testing.T) { runScripts(t, "testdata/disable.txtar") }
