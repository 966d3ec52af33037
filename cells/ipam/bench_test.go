package ipam_test

import (
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkStart times an agent start until both IPs are ready, with the
// real host-local plugin:
//
//	allocate  no records: DEL and ADD for each kind (a first start)
//	check     both recorded: one CHECK per kind (a restart)
//
// The hive's own start and stop are included.
func BenchmarkStart(b *testing.B) {
	for _, tc := range []struct {
		name    string
		restore bool
	}{{"allocate", false}, {"check", true}} {
		b.Run(tc.name, func(b *testing.B) {
			e := newEnv(b)
			e.writeConflist(b, "1.0.0", e.hostLocalIPAM("host-local", "10.40.0.0/16"))
			a := startAgent(b, e.flags(true, true))
			a.waitReady(health, ingress)
			a.stop()
			for b.Loop() {
				if !tc.restore {
					b.StopTimer()
					for _, k := range []string{health, ingress} {
						os.Remove(filepath.Join(e.stateDir, "ipam", k+".json"))
					}
					b.StartTimer()
				}
				a := startAgent(b, e.flags(true, true))
				rows := a.waitReady(health, ingress)
				a.stop()
				want := "allocated"
				if tc.restore {
					want = "checked"
				}
				if rows[health].Action != want {
					b.Fatalf("health IP %s, want %s", rows[health].Action, want)
				}
			}
		})
	}
}
