//go:build cluster

package cluster

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"
)

// TestBenchScrape: the Prometheus text kube-proxy serves is read by
// series, labels included, comments and unparsable lines skipped.
func TestBenchScrape(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `# HELP kubeproxy_network_programming_duration_seconds In Cluster Network Programming Latency in seconds
# TYPE kubeproxy_network_programming_duration_seconds histogram
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="0.25"} 1
kubeproxy_network_programming_duration_seconds_sum{ip_family="IPv4"} 0.123
kubeproxy_network_programming_duration_seconds_count{ip_family="IPv4"} 1
kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1.7644e+09
garbage
process_start_time_seconds 1.76e+09
`)
	}))
	defer srv.Close()
	m, err := scrape(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]float64{
		"kubeproxy_network_programming_duration_seconds_sum" + kpV4:   0.123,
		"kubeproxy_network_programming_duration_seconds_count" + kpV4: 1,
		"kubeproxy_sync_proxy_rules_last_timestamp_seconds" + kpV4:    1.7644e+09,
		"process_start_time_seconds":                                  1.76e+09,
	} {
		if got, ok := m[key]; !ok || got != want {
			t.Errorf("%s = %v (%v), want %v", key, got, ok, want)
		}
	}
	if len(m) != 5 {
		t.Errorf("%d series, want 5: %v", len(m), m)
	}
}

// TestBenchHelpers: fake endpoint addresses, medians, the start time of
// a process read from /proc.
func TestBenchHelpers(t *testing.T) {
	for _, tc := range []struct {
		i    int
		want string
	}{{0, "10.160.0.0"}, {255, "10.160.0.255"}, {256, "10.160.1.0"}, {100009, "10.161.134.169"}} {
		if got := benchAddr(tc.i).String(); got != tc.want {
			t.Errorf("benchAddr(%d) = %s, want %s", tc.i, got, tc.want)
		}
	}
	if got := medianDur([]time.Duration{3, 1, 2}); got != 2 {
		t.Errorf("median of 3, 1, 2 = %v", got)
	}
	if got := fmtDur([]time.Duration{2 * time.Second, time.Second, 3 * time.Second}); got != "**2s** (1s–3s)" {
		t.Errorf("fmtDur = %q", got)
	}
	start, err := processStart(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 0 || d > 10*time.Minute {
		t.Errorf("this process started %s ago, per /proc", d)
	}
	report := benchReport(benchConfig{services: 10, endpoints: 2, runs: 1, changes: 1, loadFor: time.Second, workers: 1},
		[]*benchResult{{name: "kube-proxy nftables", noAnswer: true}, {name: "apiary", rate: []float64{100}}}, "1 1 1", "2 2 2")
	if !strings.HasPrefix(report, "| what | input | apiary | kube-proxy nftables |") || !strings.Contains(report, "no answer") {
		t.Errorf("report:\n%s", report)
	}
}
