package ipam

import (
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseDelegate(t *testing.T) {
	for _, tc := range []struct {
		name    string
		conf    string
		want    delegate
		wantErr string
	}{{
		name: "conflist: first plugin with an ipam section",
		conf: `{"cniVersion":"1.0.0","name":"net1","plugins":[
			{"type":"portmap"},
			{"type":"ptp","ipam":{"type":"host-local","ranges":[[{"subnet":"10.1.0.0/16"}]],"dataDir":"/x"}},
			{"type":"bridge","ipam":{"type":"dhcp"}}]}`,
		want: delegate{Plugin: "host-local", Network: "net1", CNIVersion: "1.0.0",
			IPAM: json.RawMessage(`{"dataDir":"/x","ranges":[[{"subnet":"10.1.0.0/16"}]],"type":"host-local"}`)},
	}, {
		name: "single plugin .conf",
		conf: `{"cniVersion":"0.3.1","name":"net2","type":"bridge","ipam":{"type":"static","addresses":[{"address":"10.9.0.5/24"}]}}`,
		want: delegate{Plugin: "static", Network: "net2", CNIVersion: "0.3.1",
			IPAM: json.RawMessage(`{"type":"static","addresses":[{"address":"10.9.0.5/24"}]}`)},
	}, {
		name:    "no ipam section",
		conf:    `{"cniVersion":"1.0.0","name":"net3","plugins":[{"type":"bridge"}]}`,
		wantErr: `no plugin of network "net3" has an ipam section with a type`,
	}, {
		name:    "ipam without type",
		conf:    `{"cniVersion":"1.0.0","name":"net3","plugins":[{"type":"bridge","ipam":{"subnet":"10.0.0.0/8"}}]}`,
		wantErr: "has an ipam section with a type",
	}, {
		name:    "no name",
		conf:    `{"cniVersion":"1.0.0","plugins":[{"type":"bridge","ipam":{"type":"host-local"}}]}`,
		wantErr: "no name",
	}, {
		name:    "empty plugin list",
		conf:    `{"cniVersion":"1.0.0","name":"n","plugins":[]}`,
		wantErr: "no plugins in list",
	}, {
		name:    "plugin type is a path",
		conf:    `{"cniVersion":"1.0.0","name":"n","type":"bridge","ipam":{"type":"../../bin/sh"}}`,
		wantErr: "is not a plugin name",
	}, {
		name:    "not JSON",
		conf:    `cniVersion: 1.0.0`,
		wantErr: "not a JSON object",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := parseDelegate([]byte(tc.conf))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d.Plugin != tc.want.Plugin || d.Network != tc.want.Network || d.CNIVersion != tc.want.CNIVersion || !jsonEqual(d.IPAM, tc.want.IPAM) {
				t.Fatalf("got %+v (ipam %s), want %+v (ipam %s)", d, d.IPAM, tc.want, tc.want.IPAM)
			}
			// What the plugin reads on stdin: the network's name and
			// version and the ipam section, byte for byte in value.
			stdin, err := d.stdin(nil)
			if err != nil {
				t.Fatal(err)
			}
			var got map[string]json.RawMessage
			if err := json.Unmarshal(stdin, &got); err != nil {
				t.Fatal(err)
			}
			if len(got) != 3 || string(got["name"]) != `"`+tc.want.Network+`"` || !jsonEqual(got["ipam"], tc.want.IPAM) {
				t.Errorf("stdin %s", stdin)
			}
		})
	}
}

func TestSupportsCheck(t *testing.T) {
	for v, want := range map[string]bool{"": false, "0.3.1": false, "0.4.0": true, "1.0.0": true, "1.1.0": true, "nonsense": false} {
		if got := (&delegate{CNIVersion: v}).supportsCheck(); got != want {
			t.Errorf("cniVersion %q: CHECK %t, want %t", v, got, want)
		}
	}
}

func TestSameLease(t *testing.T) {
	a := &delegate{Plugin: "host-local", Network: "n", CNIVersion: "0.4.0", IPAM: json.RawMessage(`{"type":"host-local","a":1,"b":2}`)}
	same := &delegate{Plugin: "host-local", Network: "n", CNIVersion: "1.0.0", IPAM: json.RawMessage(`{ "b": 2, "a": 1, "type": "host-local" }`)}
	if !a.sameLease(same) {
		t.Error("the cniVersion or the ipam section's formatting changed the lease")
	}
	for _, other := range []*delegate{
		{Plugin: "host-local", Network: "m", IPAM: a.IPAM},
		{Plugin: "static", Network: "n", IPAM: a.IPAM},
		{Plugin: "host-local", Network: "n", IPAM: json.RawMessage(`{"type":"host-local","a":1,"b":3}`)},
		nil,
	} {
		if a.sameLease(other) {
			t.Errorf("%+v counted as the same lease", other)
		}
	}
}

func TestRecords(t *testing.T) {
	dir := t.TempDir()
	r, err := newRecords(dir)
	if err != nil {
		t.Fatal(err)
	}
	if rec, err := r.load("health"); rec != nil || err != nil {
		t.Fatalf("empty dir: %v, %v", rec, err)
	}
	rec := &record{Kind: "health", ContainerID: "apiary-health", IP: netip.MustParseAddr("10.0.0.2"),
		Delegate: delegate{Plugin: "host-local", Network: "n", CNIVersion: "1.0.0", IPAM: json.RawMessage(`{"type":"host-local"}`)},
		Result:   json.RawMessage(`{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.2/24"}]}`)}
	if err := r.store(rec); err != nil {
		t.Fatal(err)
	}
	got, err := r.load("health")
	if err != nil || got.IP != rec.IP || !got.Delegate.sameLease(&rec.Delegate) {
		t.Fatalf("load: %+v, %v", got, err)
	}
	// Nothing but the record is left behind: no temporary file.
	entries, _ := os.ReadDir(r.dir)
	if len(entries) != 1 || entries[0].Name() != "health.json" {
		t.Errorf("records dir holds %v", entries)
	}
	// The recorded result converts to the network's version for CHECK.
	prev, err := prevResult(got.Result, "0.4.0")
	if err != nil || !strings.Contains(string(prev), `"cniVersion":"0.4.0"`) || !strings.Contains(string(prev), "10.0.0.2/24") {
		t.Errorf("prevResult: %s, %v", prev, err)
	}

	if err := os.WriteFile(filepath.Join(r.dir, "ingress.json"), []byte(`{"kind":"ingress"`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := r.load("ingress"); err == nil {
		t.Error("a torn record loaded")
	}
	if err := r.remove("health"); err != nil {
		t.Fatal(err)
	}
	if r.exists("health") || !r.exists("ingress") {
		t.Error("remove")
	}
}

func TestParseResult(t *testing.T) {
	for _, tc := range []struct {
		version, result string
		ipv6            bool
		want, want6     string
		wantErr         string
	}{
		{"1.0.0", `{"cniVersion":"1.0.0","ips":[{"address":"fd00::5/64"},{"address":"10.0.0.5/24","gateway":"10.0.0.1"}]}`, false, "10.0.0.5", "", ""},
		{"1.0.0", `{"cniVersion":"1.0.0","ips":[{"address":"fd00::5/64"},{"address":"10.0.0.5/24","gateway":"10.0.0.1"}]}`, true, "10.0.0.5", "fd00::5", ""},
		{"0.4.0", `{"cniVersion":"0.4.0","ips":[{"version":"4","address":"10.0.0.6/24"}]}`, false, "10.0.0.6", "", ""},
		{"0.3.1", `{"cniVersion":"0.3.1","ips":[{"version":"4","address":"10.0.0.7/24"}]}`, false, "10.0.0.7", "", ""},
		{"0.3.1", `{"cniVersion":"0.3.1","ips":[{"version":"4","address":"10.0.0.7/24"}]}`, true, "", "", "no IPv6 address, which --enable-ipv6 needs (only [10.0.0.7])"},
		{"1.0.0", `{"cniVersion":"1.0.0","ips":[{"address":"fd00::5/64"}]}`, false, "", "", "no IPv4 address (only [fd00::5])"},
		{"1.0.0", `{"cniVersion":"1.0.0","ips":[]}`, false, "", "", "no IP address"},
		{"1.0.0", `{"cniVersion":"1.0.0","ips":[{"address":"0.0.0.0/0"}]}`, false, "", "", "no IPv4 address"},
		{"1.0.0", `not json`, false, "", "", "invalid character"},
	} {
		ip, ip6, err := parseResult(tc.version, []byte(tc.result), tc.ipv6)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: %v, %v; want error %q", tc.result, ip, err, tc.wantErr)
			}
			continue
		}
		str6 := ""
		if ip6.IsValid() {
			str6 = ip6.String()
		}
		if err != nil || ip.String() != tc.want || str6 != tc.want6 {
			t.Errorf("%s (ipv6 %t): %v %v, %v; want %s %s", tc.result, tc.ipv6, ip, ip6, err, tc.want, tc.want6)
		}
	}
}

// FuzzParseResult feeds arbitrary plugin output to the result parsing the
// ADD path uses: it never panics, an IP it returns is an IPv4 address
// present in the result, and it returns an IPv6 address exactly when asked.
func FuzzParseResult(f *testing.F) {
	for _, seed := range []string{
		`{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.5/24","gateway":"10.0.0.1"}],"dns":{}}`,
		`{"cniVersion":"0.4.0","ips":[{"version":"4","address":"10.0.0.6/24","interface":0}],"interfaces":[{"name":"eth0"}]}`,
		`{"cniVersion":"0.3.1","ips":[{"version":"6","address":"fd00::1/64"}]}`,
		`{"cniVersion":"0.2.0","ip4":{"ip":"10.0.0.8/24"}}`,
		`{"ips":[{"address":"::ffff:10.0.0.9/120"}]}`,
		`{"cniVersion":"1.0.0","ips":[null,{}]}`,
		`null`,
	} {
		f.Add("1.0.0", []byte(seed), false)
		f.Add("0.3.1", []byte(seed), true)
	}
	f.Fuzz(func(t *testing.T, version string, data []byte, ipv6 bool) {
		ip, ip6, err := parseResult(version, data, ipv6)
		if err != nil {
			return
		}
		if !ip.Is4() || ip.IsUnspecified() {
			t.Fatalf("picked %v from %s", ip, data)
		}
		if ipv6 != ip6.IsValid() || ipv6 && (!ip6.Is6() || ip6.Is4In6()) {
			t.Fatalf("picked IPv6 %v (ipv6 %t) from %s", ip6, ipv6, data)
		}
	})
}
