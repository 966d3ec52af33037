package nodeport

import (
	"strings"
	"testing"
	"time"
)

// TestConfigValidate: flags out of range are refused, naming the flag.
func TestConfigValidate(t *testing.T) {
	for _, tt := range []struct {
		name string
		mod  func(*Config)
		want string // a substring of the error; empty: valid
	}{
		{"defaults", func(*Config) {}, ""},
		{"NAT map too small", func(c *Config) { c.BPFNATMax = 8 }, "--" + NATMaxFlag + "=8"},
		{"NAT map too big", func(c *Config) { c.BPFNATMax = 1<<24 + 1 }, "--" + NATMaxFlag},
		{"TCP timeout", func(c *Config) { c.NATTCPTimeout = time.Millisecond }, "--" + TCPTimeoutFlag},
		{"UDP timeout", func(c *Config) { c.NATUDPTimeout = 0 }, "--" + UDPTimeoutFlag},
		{"attach mode", func(c *Config) { c.NodePortAttach = "xdp" }, "--" + AttachFlag},
		{"tc", func(c *Config) { c.NodePortAttach = "tc" }, ""},
		{"algorithm", func(c *Config) { c.LBAlgorithm = "roundrobin" }, "--" + AlgorithmFlag + `="roundrobin"`},
		{"maglev", func(c *Config) { c.LBAlgorithm = AlgorithmMaglev }, ""},
		{"maglev size not a prime", func(c *Config) { c.LBMaglevTableSize = 16384 }, "--" + MaglevSizeFlag + ": maglev table size 16384 is not a prime"},
		{"maglev size too big", func(c *Config) { c.LBMaglevTableSize = 262139 }, "--" + MaglevSizeFlag + ": maglev table size 262139 is out of range"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := defaultConfig
			tt.mod(&c)
			err := c.validate()
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("unexpected error %v", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("error %v, want one naming %q", err, tt.want)
			}
		})
	}
}

// TestGCInterval: a tenth of the shorter timeout, at least a second.
func TestGCInterval(t *testing.T) {
	for _, tt := range []struct {
		tcp, udp, want time.Duration
	}{
		{6 * time.Hour, time.Minute, 6 * time.Second},
		{time.Minute, time.Hour, 6 * time.Second},
		{2 * time.Second, 2 * time.Second, time.Second},
	} {
		if got := gcInterval(Config{NATTCPTimeout: tt.tcp, NATUDPTimeout: tt.udp}); got != tt.want {
			t.Errorf("gcInterval(%s, %s) = %s, want %s", tt.tcp, tt.udp, got, tt.want)
		}
	}
}
