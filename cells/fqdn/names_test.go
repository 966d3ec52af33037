package fqdn

import (
	"net/netip"
	"testing"
	"time"

	"github.com/apiary-net/apiary/tables"
)

func TestCeilSecond(t *testing.T) {
	base := time.Date(2026, 11, 26, 5, 0, 0, 0, time.UTC)
	for _, tt := range []struct{ in, want time.Time }{
		{base, base},
		{base.Add(time.Nanosecond), base.Add(time.Second)},
		{base.Add(999 * time.Millisecond), base.Add(time.Second)},
	} {
		if got := ceilSecond(tt.in); !got.Equal(tt.want) {
			t.Errorf("ceilSecond(%s) = %s, want %s", tt.in, got, tt.want)
		}
	}
}

// An answer that repeats what the row has is not written; anything it
// would change is.
func TestUnchanged(t *testing.T) {
	now := time.Date(2026, 11, 26, 5, 0, 0, 0, time.UTC)
	a, b, c := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2"), netip.MustParseAddr("192.0.2.3")
	labels := tables.NewLabels("fqdn:*.example.com")
	expires := now.Add(time.Minute)
	row := &tables.FQDNName{Name: "www.example.com.", Selectors: labels, IPs: []tables.FQDNIP{
		{IP: a, Expires: expires, Seen: now},
		{IP: b, Expires: expires, Seen: now.Add(-time.Second)},
	}}
	tests := []struct {
		name    string
		labels  tables.Labels
		ips     []netip.Addr
		expires time.Time
		now     time.Time
		want    bool
	}{
		{"same answer", labels, []netip.Addr{a}, expires, now.Add(500 * time.Millisecond), true},
		{"mapped address", labels, []netip.Addr{netip.AddrFrom16(a.As16())}, expires, now, true},
		{"shorter TTL", labels, []netip.Addr{a}, expires.Add(-time.Second), now, true},
		{"longer TTL", labels, []netip.Addr{a}, expires.Add(time.Second), now, false},
		{"new address", labels, []netip.Addr{a, c}, expires, now, false},
		{"seen a second ago", labels, []netip.Addr{a, b}, expires, now, false},
		{"seen long enough ago", labels, []netip.Addr{a}, expires, now.Add(seenResolution), false},
		{"other labels", tables.NewLabels("fqdn:www.example.com"), []netip.Addr{a}, expires, now, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := unchanged(row, tt.labels, tt.ips, tt.expires, tt.now); got != tt.want {
				t.Fatalf("unchanged = %v, want %v", got, tt.want)
			}
		})
	}
}
