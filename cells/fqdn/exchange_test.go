package fqdn

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeResolver answers each datagram on a loopback UDP socket as answer
// says (nil: no answer), and reports where each query came from.
func fakeResolver(t testing.TB, network, addr string, answer func(q []byte) [][]byte) (netip.AddrPort, <-chan netip.AddrPort) {
	t.Helper()
	pc, err := net.ListenPacket(network, addr)
	if err != nil {
		t.Skipf("listen on %s %s: %v", network, addr, err)
	}
	t.Cleanup(func() { pc.Close() })
	from := make(chan netip.AddrPort, 16)
	go func() {
		buf := make([]byte, 512)
		for {
			n, src, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			from <- src.(*net.UDPAddr).AddrPort()
			for _, d := range answer(buf[:n]) {
				pc.WriteTo(d, src)
			}
		}
	}()
	return pc.LocalAddr().(*net.UDPAddr).AddrPort(), from
}

// withID returns the query q as a reply with ID id and a marker byte.
func withID(q []byte, id uint16, marker byte) []byte {
	r := append([]byte(nil), q...)
	binary.BigEndian.PutUint16(r, id)
	return append(r, marker)
}

func TestUDPExchange(t *testing.T) {
	query := []byte{0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0}
	tests := []struct {
		name     string
		network  string
		addr     string
		answer   func(q []byte) [][]byte
		want     byte // the marker of the reply taken
		deadline bool // no reply: the deadline passes
		mapped   bool // ask the resolver's IPv4 address mapped to IPv6
	}{
		{"reply", "udp4", "127.0.0.1:0", func(q []byte) [][]byte { return [][]byte{withID(q, 0x1234, 'a')} }, 'a', false, false},
		{"IPv6", "udp6", "[::1]:0", func(q []byte) [][]byte { return [][]byte{withID(q, 0x1234, 'a')} }, 'a', false, false},
		{"IPv4-mapped", "udp4", "127.0.0.1:0", func(q []byte) [][]byte { return [][]byte{withID(q, 0x1234, 'a')} }, 'a', false, true},
		{"another ID first", "udp4", "127.0.0.1:0", func(q []byte) [][]byte {
			return [][]byte{withID(q, 0x4321, 'x'), {0x12}, withID(q, 0x1234, 'a')}
		}, 'a', false, false},
		{"no reply", "udp4", "127.0.0.1:0", func([]byte) [][]byte { return nil }, 0, true, false},
		{"only other IDs", "udp4", "127.0.0.1:0", func(q []byte) [][]byte { return [][]byte{withID(q, 0x4321, 'x')} }, 0, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			up, _ := fakeResolver(t, tt.network, tt.addr, tt.answer)
			if tt.mapped {
				up = netip.AddrPortFrom(netip.AddrFrom16(up.Addr().As16()), up.Port())
			}
			buf := make([]byte, 513)
			n, err := udpExchange(up, query, buf, time.Now().Add(200*time.Millisecond))
			if tt.deadline {
				if !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("got %d bytes, error %v; want the deadline exceeded", n, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if n != len(query)+1 || buf[n-1] != tt.want {
				t.Fatalf("got %q, want the reply marked %q", buf[:n], tt.want)
			}
		})
	}
}

// Each query leaves from a socket of its own: its source port is the
// kernel's random pick, not one a spoofer could learn from an earlier
// query.
func TestUDPExchangeSourcePorts(t *testing.T) {
	up, from := fakeResolver(t, "udp4", "127.0.0.1:0", func(q []byte) [][]byte { return [][]byte{q} })
	ports := map[uint16]bool{}
	for range 4 {
		if _, err := udpExchange(up, []byte{0, 1, 1, 0}, make([]byte, 512), time.Now().Add(time.Second)); err != nil {
			t.Fatal(err)
		}
		ports[(<-from).Port()] = true
	}
	if len(ports) < 2 {
		t.Fatalf("4 queries left from ports %v, want a new one for each", ports)
	}
}

// BenchmarkUDPExchange: one query's exchange with a resolver on loopback
// (an in-test echo), from a socket of its own: udpExchange against what
// net.Dial, Write, Read and Close do. cpu-us/op is the process's CPU time
// (both ends), less sensitive than ns/op to other load on the machine.
//
//	go test -run '^$' -bench UDPExchange -benchtime 20000x ./cells/fqdn/
func BenchmarkUDPExchange(b *testing.B) {
	query := []byte{0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0}
	for _, bm := range []struct {
		name     string
		exchange func(up netip.AddrPort, buf []byte) error
	}{
		{"udpExchange", func(up netip.AddrPort, buf []byte) error {
			_, err := udpExchange(up, query, buf, time.Now().Add(time.Second))
			return err
		}},
		{"net.Dial", func(up netip.AddrPort, buf []byte) error {
			conn, err := net.Dial("udp", up.String())
			if err != nil {
				return err
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(time.Second))
			if _, err := conn.Write(query); err != nil {
				return err
			}
			_, err = conn.Read(buf)
			return err
		}},
	} {
		b.Run(bm.name, func(b *testing.B) {
			up, from := fakeResolver(b, "udp4", "127.0.0.1:0", func(q []byte) [][]byte { return [][]byte{q} })
			go func() {
				for range from {
				}
			}()
			buf := make([]byte, 513)
			before := cpuTime(b)
			for b.Loop() {
				if err := bm.exchange(up, buf); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64((cpuTime(b)-before).Microseconds())/float64(b.N), "cpu-us/op")
		})
	}
}

// cpuTime returns the CPU time the process used so far.
func cpuTime(tb testing.TB) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
