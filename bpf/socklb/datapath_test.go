package socklb

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// The tests run real sockets of the test process, which they move into a
// cgroup with the programs attached (see lb.start), against servers on
// loopback: TCP, connected and unconnected UDP, AF_INET and AF_INET6
// sockets, with IPv4 and IPv6 frontends and IPv4 ones through IPv4-mapped
// addresses.

// TestTranslate sends connections and datagrams to a frontend: both
// backends answer over 30 of them, and the client always sees the
// frontend as its peer (getpeername, recvfrom's source).
func TestTranslate(t *testing.T) {
	l := newLB(t)
	for i, lo := range []string{"127.0.0.1", "::1"} {
		vip, id := vip4, uint32(10*i)
		if i == 1 {
			vip = vip6
		}
		for j, proto := range []int{tcp, udp} {
			a, b := id+uint32(2*j)+1, id+uint32(2*j)+2
			l.backend(a, serve(t, proto, lo, fmt.Sprintf("%d-a", proto)), uint8(proto), bpf.BackendActive)
			l.backend(b, serve(t, proto, lo, fmt.Sprintf("%d-b", proto)), uint8(proto), bpf.BackendActive)
			port := map[int]uint16{tcp: 80, udp: 53}[proto]
			l.service(uint16(a), netip.AddrPortFrom(vip, port), uint8(proto), 0, []uint32{a, b}, nil)
		}
	}
	l.start()

	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			for _, tc := range []struct {
				name  string
				proto int
				port  uint16
				do    func(dst netip.AddrPort) (exchange, error)
			}{
				{"tcp", tcp, 80, func(dst netip.AddrPort) (exchange, error) { return dial(f.sockAF, tcp, dst) }},
				// connect6/connect4 and getpeername.
				{"udp-connected", udp, 53, func(dst netip.AddrPort) (exchange, error) { return dial(f.sockAF, udp, dst) }},
				// sendmsg and recvmsg; the kernel gives an AF_INET6
				// socket's datagram to an IPv4-mapped address to
				// sendmsg4.
				{"udp", udp, 53, func(dst netip.AddrPort) (exchange, error) { return sendTo(f.sockAF, dst) }},
			} {
				t.Run(tc.name, func(t *testing.T) {
					dst := f.at(f.vip, tc.port)
					seen := map[string]int{}
					for range 30 {
						ex, err := tc.do(dst)
						if err != nil {
							t.Fatal(err)
						}
						if ex.peer != dst {
							t.Fatalf("peer %s, want the frontend %s", ex.peer, dst)
						}
						seen[ex.reply]++
					}
					want := []string{fmt.Sprintf("%d-a", tc.proto), fmt.Sprintf("%d-b", tc.proto)}
					if got := slices.Sorted(maps.Keys(seen)); !slices.Equal(got, want) {
						t.Errorf("answers %v, want from both of %v", seen, want)
					}
				})
			}
		})
	}

	// Without the affinity flag the programs leave the affinity maps be.
	for _, m := range []*ebpf.Map{l.Affinity4, l.Affinity6} {
		if n := count(t, m); n != 0 {
			t.Errorf("%s has %d entries, want none", m, n)
		}
	}
}

// TestRefuse checks that connect() and sendmsg() to a frontend without
// backends, or to a port of a service address that no service serves (the
// wildcard entry), fail with ECONNREFUSED, while the served port, a
// frontend with only terminating backends, and an address that is no
// frontend are reached.
func TestRefuse(t *testing.T) {
	l := newLB(t)
	// Per family: .10 has a wildcard and port 80 with a backend, .11 ports
	// 80 and 53/UDP without backends, .12 port 80 with a terminating
	// backend.
	served := map[bool]netip.AddrPort{}
	for i, lo := range []string{"127.0.0.1", "::1"} {
		base := netip.MustParseAddr("10.96.0.10")
		if i == 1 {
			base = netip.MustParseAddr("fd00:96::10")
		}
		id := uint32(10 * i)
		srv := serve(t, tcp, lo, "served")
		served[base.Is4()] = srv
		l.backend(id+1, srv, tcp, bpf.BackendActive)
		l.backend(id+2, serve(t, tcp, lo, "draining"), tcp, bpf.BackendTerminating)
		l.wildcard(base)
		l.service(uint16(id+2), netip.AddrPortFrom(base, 80), tcp, 0, []uint32{id + 1}, nil)
		l.service(uint16(id+3), netip.AddrPortFrom(base.Next(), 80), tcp, 0, nil, nil)
		l.service(uint16(id+4), netip.AddrPortFrom(base.Next(), 53), udp, 0, nil, nil)
		l.service(uint16(id+5), netip.AddrPortFrom(base.Next().Next(), 80), tcp, 0, nil, []uint32{id + 2})
	}
	l.start()

	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			vip, empty, draining := f.vip, f.vip.Next(), f.vip.Next().Next()
			for _, tc := range []struct {
				name string
				do   func() (exchange, error)
				want string // the answer; "" for ECONNREFUSED
			}{
				{"wildcard/tcp", func() (exchange, error) { return dial(f.sockAF, tcp, f.at(vip, 81)) }, ""},
				{"wildcard/udp-connected", func() (exchange, error) { return dial(f.sockAF, udp, f.at(vip, 53)) }, ""},
				{"wildcard/udp", func() (exchange, error) { return sendTo(f.sockAF, f.at(vip, 53)) }, ""},
				{"served", func() (exchange, error) { return dial(f.sockAF, tcp, f.at(vip, 80)) }, "served"},
				{"no-backends/tcp", func() (exchange, error) { return dial(f.sockAF, tcp, f.at(empty, 80)) }, ""},
				{"no-backends/udp-connected", func() (exchange, error) { return dial(f.sockAF, udp, f.at(empty, 53)) }, ""},
				{"no-backends/udp", func() (exchange, error) { return sendTo(f.sockAF, f.at(empty, 53)) }, ""},
				{"terminating", func() (exchange, error) { return dial(f.sockAF, tcp, f.at(draining, 80)) }, "draining"},
				{"not-a-frontend", func() (exchange, error) {
					srv := served[f.vip.Is4()]
					return dial(f.sockAF, tcp, f.at(srv.Addr(), srv.Port()))
				}, "served"},
			} {
				t.Run(tc.name, func(t *testing.T) {
					ex, err := tc.do()
					switch {
					case tc.want == "" && !errors.Is(err, unix.ECONNREFUSED):
						t.Errorf("got %+v, %v; want ECONNREFUSED", ex, err)
					case tc.want != "" && (err != nil || ex.reply != tc.want):
						t.Errorf("got %+v, %v; want an answer from %s", ex, err, tc.want)
					}
				})
			}
		})
	}
}

// TestAffinity checks session affinity: the connections of a network
// namespace stick to the backend chosen first; a remembered backend is
// followed while the entry is younger than the timeout, the backend is
// still the service's (lb_affinity_match) and active, and otherwise a new
// choice is made and remembered.
func TestAffinity(t *testing.T) {
	testenv.RequireRoot(t)
	const timeout = 60 // seconds
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			l := newLB(t)
			ids := map[string]uint32{}
			for i, name := range []string{"a", "b", "c", "d"} {
				ids[name] = uint32(i + 1)
				l.backend(uint32(i+1), serve(t, tcp, f.loopback, name), tcp, bpf.BackendActive)
			}
			rn := bpf.NewBe16(7)
			l.service(7, netip.AddrPortFrom(f.vip, 80), tcp, timeout, []uint32{1, 2, 3, 4}, nil)
			// Backend 9 is valid for the service's affinity, but in no
			// slot: only following an entry leads there.
			e := serve(t, tcp, f.loopback, "e")
			l.backend(9, e, tcp, bpf.BackendActive)
			match9 := bpf.LBAffinityMatchKey{BackendID: 9, RevNat: rn}
			l.put(l.AffinityMatch, match9, uint8(0))
			l.start()

			dst := f.at(f.vip, 80)
			connect := func() string {
				t.Helper()
				ex, err := dial(f.sockAF, tcp, dst)
				if err != nil {
					t.Fatal(err)
				}
				if ex.peer != dst {
					t.Fatalf("peer %s, want the frontend %s", ex.peer, dst)
				}
				return ex.reply
			}
			aff, key := l.Affinity4, any(bpf.LB4AffinityKey{ClientID: netnsCookie(t), RevNat: rn, NetnsCookie: 1})
			if f.vip.Is6() {
				k := bpf.LB6AffinityKey{RevNat: rn, NetnsCookie: 1}
				binary.NativeEndian.PutUint64(k.ClientID[:8], netnsCookie(t))
				aff, key = l.Affinity6, k
			}
			entry := func() bpf.LBAffinityValue {
				t.Helper()
				var v bpf.LBAffinityValue
				if err := aff.Lookup(key, &v); err != nil {
					t.Fatalf("affinity entry %+v: %s", key, err)
				}
				return v
			}
			remember := func(lastUsed uint64, backend uint32) {
				t.Helper()
				l.put(aff, key, bpf.LBAffinityValue{LastUsed: lastUsed, BackendID: backend})
			}
			sticks := func(want string, n int) {
				t.Helper()
				for range n {
					if got := connect(); got != want {
						t.Fatalf("answer from %s, want %s", got, want)
					}
				}
			}

			// 20 connections, one backend: the first connection's.
			t0 := monoNow(t)
			first := connect()
			sticks(first, 19)
			if v := entry(); v.BackendID != ids[first] || v.LastUsed < t0 {
				t.Errorf("entry %+v, want backend %d (%s) used after %d", v, ids[first], first, t0)
			}
			if n := count(t, aff); n != 1 {
				t.Errorf("%s has %d entries, want 1", aff, n)
			}

			// A remembered backend is followed, and the entry refreshed.
			t1 := monoNow(t)
			remember(t1-timeout/2*1e9, 9)
			sticks("e", 1)
			if v := entry(); v.BackendID != 9 || v.LastUsed < t1 {
				t.Errorf("entry %+v after following it, want backend 9 used after %d", v, t1)
			}

			// Expired: a new choice, which the next connections follow.
			remember(monoNow(t)-(timeout+1)*1e9, 9)
			t2 := monoNow(t)
			next := connect()
			if v := entry(); next == "e" || v.BackendID != ids[next] || v.LastUsed < t2 {
				t.Errorf("after an expired entry: answer from %s, entry %+v; want another backend, remembered after %d", next, v, t2)
			}
			sticks(next, 5)

			// Backend 9 no longer matches the service.
			if err := l.AffinityMatch.Delete(match9); err != nil {
				t.Fatal(err)
			}
			remember(monoNow(t), 9)
			if got := connect(); got == "e" {
				t.Error("followed an entry whose affinity match is gone")
			}

			// Backend 9 matches but is not active.
			l.put(l.AffinityMatch, match9, uint8(0))
			l.backend(9, e, tcp, bpf.BackendTerminating)
			remember(monoNow(t), 9)
			if got := connect(); got == "e" {
				t.Error("followed an entry to a terminating backend")
			}

			// Active again, it is followed again.
			l.backend(9, e, tcp, bpf.BackendActive)
			remember(monoNow(t), 9)
			sticks("e", 3)
		})
	}
}

func count(tb testing.TB, m *ebpf.Map) int {
	tb.Helper()
	var n int
	it := m.Iterate()
	var k, v []byte
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		tb.Fatalf("iterate %s: %s", m, err)
	}
	return n
}

// TestXlateEvents: with the translation events' maps, each connect() and
// sendmsg() the programs translate is reported with the frontend asked
// for, the backend chosen, the protocol and the socket's cgroup; a
// connection to an address that is no frontend is not.
func TestXlateEvents(t *testing.T) {
	l := newLB(t)
	evSpec, lostSpec, err := XlateMapSpecs()
	if err != nil {
		t.Fatal(err)
	}
	for _, spec := range []*ebpf.MapSpec{evSpec, lostSpec} {
		m, err := ebpf.NewMap(spec)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		if spec.Type == ebpf.RingBuf {
			l.XlateEvents = m
		} else {
			l.XlateLost = m
		}
	}
	rd, err := ringbuf.NewReader(l.XlateEvents)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rd.Close() })
	tcpBE := serve(t, tcp, "127.0.0.1", "tcp")
	udpBE := serve(t, udp, "::1", "udp")
	plain := serve(t, tcp, "127.0.0.1", "plain")
	l.backend(1, tcpBE, tcp, bpf.BackendActive)
	l.backend(2, udpBE, udp, bpf.BackendActive)
	l.service(1, netip.AddrPortFrom(vip4, 80), tcp, 0, []uint32{1}, nil)
	l.service(2, netip.AddrPortFrom(vip6, 53), udp, 0, []uint32{2}, nil)
	progs := l.load()
	cg := enterCgroup(t)
	attach(t, cg, progs)
	cgID, err := cgroupID(cg)
	if err != nil {
		t.Fatal(err)
	}

	if _, err := dial(unix.AF_INET, tcp, plain); err != nil {
		t.Fatal(err)
	}
	if _, err := dial(unix.AF_INET, tcp, netip.AddrPortFrom(vip4, 80)); err != nil {
		t.Fatal(err)
	}
	if _, err := sendTo(unix.AF_INET6, netip.AddrPortFrom(vip6, 53)); err != nil {
		t.Fatal(err)
	}
	// The programs do not wake the reader for a few events: it polls.
	read := func() (ringbuf.Record, error) {
		deadline := time.Now().Add(5 * time.Second)
		for {
			rd.SetDeadline(time.Now().Add(50 * time.Millisecond))
			rec, err := rd.Read()
			if !errors.Is(err, os.ErrDeadlineExceeded) || time.Now().After(deadline) {
				return rec, err
			}
		}
	}
	for _, want := range []struct {
		fe, be netip.AddrPort
		proto  uint8
	}{
		{netip.AddrPortFrom(vip4, 80), tcpBE, tcp},
		{netip.AddrPortFrom(vip6, 53), udpBE, udp},
	} {
		rec, err := read()
		if err != nil {
			t.Fatalf("the translation of %s: %v", want.fe, err)
		}
		ev, err := DecodeXlateEvent(rec.RawSample)
		if err != nil {
			t.Fatal(err)
		}
		if ev.FrontendAddr() != want.fe || ev.BackendAddr() != want.be || ev.Protocol != want.proto ||
			ev.CgroupID != cgID || ev.SockCookie == 0 || ev.TimeNs == 0 {
			t.Errorf("event %+v (%s -> %s), want %s -> %s proto %d cgroup %d", ev, ev.FrontendAddr(), ev.BackendAddr(),
				want.fe, want.be, want.proto, cgID)
		}
	}
	// Nothing else: the connection to the plain address was not reported.
	rd.SetDeadline(time.Now().Add(100 * time.Millisecond))
	if rec, err := rd.Read(); err == nil {
		ev, _ := DecodeXlateEvent(rec.RawSample)
		t.Errorf("an event more: %s -> %s", ev.FrontendAddr(), ev.BackendAddr())
	}
}

// cgroupID is the ID of the cgroup directory dir (its inode number).
func cgroupID(dir string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}
