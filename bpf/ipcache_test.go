package bpf_test

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

func TestIPCacheLayout(t *testing.T) {
	if err := bpf.CheckLayout[bpf.IPCacheKey, bpf.IPCacheValue](bpf.IPCacheMapSpec(16)); err != nil {
		t.Fatal(err)
	}
}

func TestIPCacheKeyEncoding(t *testing.T) {
	for _, c := range []struct {
		prefix string
		want   []byte
	}{
		{"10.1.2.0/24", []byte{56, 0, 0, 0, 0, 0, 0, 1, 10, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
		// Host bits are cleared, so one network has one key.
		{"10.1.2.3/24", []byte{56, 0, 0, 0, 0, 0, 0, 1, 10, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
		{"0.0.0.0/0", []byte{32, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
		{"::ffff:192.0.2.1/128", []byte{64, 0, 0, 0, 0, 0, 0, 1, 192, 0, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
		{"fd00::1/128", []byte{160, 0, 0, 0, 0, 0, 0, 2, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}},
	} {
		k := bpf.NewIPCacheKey(netip.MustParsePrefix(c.prefix))
		got, err := binary.Append(nil, binary.LittleEndian, k)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, c.want) {
			t.Errorf("%s: key % x, want % x", c.prefix, got, c.want)
		}
		p, err := k.Prefix()
		if err != nil {
			t.Fatal(err)
		}
		if want := netip.MustParsePrefix(c.prefix); p.Bits() != want.Bits() && !want.Addr().Is4In6() {
			t.Errorf("%s: round trip gave %s", c.prefix, p)
		}
	}
	if _, err := (bpf.IPCacheKey{PrefixLen: 99, Family: 1}).Prefix(); err == nil {
		t.Error("a /67 IPv4 key decoded without error")
	}
	if _, err := (bpf.IPCacheKey{PrefixLen: 40, Family: 3}).Prefix(); err == nil {
		t.Error("family 3 decoded without error")
	}
}

// TestIPCacheMapLookup checks the layout against the kernel: a lookup of a
// full-length key finds the longest prefix holding it, and never one of
// the other family.
func TestIPCacheMapLookup(t *testing.T) {
	dir := testenv.BPFPinDir(t)
	m, err := bpf.OpenPinnedMap(nil, bpf.IPCacheMapSpec(64), dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	put := func(p string, id uint32) {
		if err := m.Put(bpf.NewIPCacheKey(netip.MustParsePrefix(p)), bpf.IPCacheValue{Identity: id}); err != nil {
			t.Fatal(err)
		}
	}
	put("10.0.0.0/8", 100)
	put("10.1.0.0/16", 200)
	put("::/0", 600)
	for _, c := range []struct {
		addr string
		want uint32
	}{
		{"10.1.2.3", 200}, {"10.2.0.1", 100}, {"fd00::1", 600}, {"11.0.0.1", 0},
	} {
		var v bpf.IPCacheValue
		err := m.Lookup(bpf.NewIPCacheKey(netip.MustParsePrefix(c.addr+"/"+map[bool]string{true: "32", false: "128"}[netip.MustParseAddr(c.addr).Is4()])), &v)
		if c.want == 0 {
			if err == nil {
				t.Errorf("%s: found identity %d, want no entry", c.addr, v.Identity)
			}
			continue
		}
		if err != nil || v.Identity != c.want {
			t.Errorf("%s: identity %d (%v), want %d", c.addr, v.Identity, err, c.want)
		}
	}
}

// TestIPCacheKeyString: errors name a key by its prefix.
func TestIPCacheKeyString(t *testing.T) {
	k := bpf.NewIPCacheKey(netip.MustParsePrefix("10.1.2.0/24"))
	other := k
	other.ClusterID = 7
	for _, c := range []struct {
		key  bpf.IPCacheKey
		want string
	}{
		{k, "10.1.2.0/24"},
		{other, "10.1.2.0/24@7"},
		{bpf.IPCacheKey{Family: 9, PrefixLen: 40}, "ipcache key of family 9, length 40"},
	} {
		if got := c.key.String(); got != c.want {
			t.Errorf("%q, want %q", got, c.want)
		}
	}
}
