package fqdn

import (
	"strings"
	"testing"
)

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name    string
		change  func(*Config)
		wantErr string // empty: valid
	}{
		{"defaults", func(*Config) {}, ""},
		{"four UDP loops", func(c *Config) { c.DNSProxyUDPLoops = 4 }, ""},
		{"no UDP loop", func(c *Config) { c.DNSProxyUDPLoops = 0 }, "--dns-proxy-udp-loops=0 must be between 1 and 64"},
		{"too many UDP loops", func(c *Config) { c.DNSProxyUDPLoops = 65 }, "--dns-proxy-udp-loops=65 must be between 1 and 64"},
		{"no upstream timeout", func(c *Config) { c.DNSUpstreamTimeout = 0 }, "--dns-upstream-timeout=0s must be positive"},
		{"unknown reject response", func(c *Config) { c.DNSRejectResponse = "drop" }, "--dns-reject-response"},
		{"trusted resolvers", func(c *Config) { c.DNSTrustedResolvers = []string{"10.0.0.10", "10.1.0.0/16", "[fd00::53]:53"} }, ""},
		{"a trusted resolver that is no address", func(c *Config) { c.DNSTrustedResolvers = []string{"not-an-ip"} }, `--dns-trusted-resolvers: "not-an-ip"`},
		{"no cluster DNS Service", func(c *Config) { c.DNSClusterService = "" }, ""},
		{"a cluster DNS Service without namespace", func(c *Config) { c.DNSClusterService = "kube-dns" }, `--dns-cluster-service="kube-dns"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := defaultConfig
			tt.change(&c)
			err := c.validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("want valid, got %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("got %v, want an error with %q", err, tt.wantErr)
			}
		})
	}
}
