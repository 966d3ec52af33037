package socklb

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
)

// floodSockets is how many other UDP sockets reach the service between a
// socket's datagram and its reply: more than an LRU of the fixture's
// size (1024) holds, which is what the reverse translations were before
// they became per socket.
const floodSockets = 3000

// TestRevNatFlood: a UDP socket sends to a frontend; before its backend
// answers, thousands of other UDP sockets of the same cgroup (a pod
// opening sockets in a loop) send to the frontend too. The first socket's
// reply still comes from the frontend: each socket's reverse translation
// is its own (socket storage), so no other socket can push it out
// (issue 35 item 11). Both families.
func TestRevNatFlood(t *testing.T) {
	l := newLB(t)
	backends := map[int]*net.UDPConn{}
	for i, lo := range []string{"127.0.0.1", "::1"} {
		c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(lo), 0)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		id := uint32(100 + i)
		vip := []netip.Addr{vip4, vip6}[i]
		l.backend(id, c.LocalAddr().(*net.UDPAddr).AddrPort(), udp, bpf.BackendActive)
		l.service(uint16(id), netip.AddrPortFrom(vip, 53), udp, 0, []uint32{id}, nil)
		backends[[]int{unix.AF_INET, unix.AF_INET6}[i]] = c
	}
	l.start()

	for _, f := range families[:2] {
		t.Run(f.name, func(t *testing.T) {
			be := backends[f.sockAF]
			fe := f.at(f.vip, 53)
			client, err := socket(f.sockAF, udp)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(client)
			if err := unix.Sendto(client, []byte("first"), 0, sockaddr(f.sockAF, fe)); err != nil {
				t.Fatalf("send to %s: %v", fe, err)
			}
			from := readFrom(t, be)

			for range floodSockets {
				fd, err := socket(f.sockAF, udp)
				if err != nil {
					t.Fatal(err)
				}
				err = unix.Sendto(fd, []byte("flood"), 0, sockaddr(f.sockAF, fe))
				unix.Close(fd)
				if err != nil {
					t.Fatalf("flood send to %s: %v", fe, err)
				}
			}

			if _, err := be.WriteToUDPAddrPort([]byte("reply"), from); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 64)
			var src unix.Sockaddr
			if _, err := testenv.IgnoringEINTR(func() (n int, err error) {
				n, src, err = unix.Recvfrom(client, buf, 0)
				return n, err
			}); err != nil {
				t.Fatalf("the reply after %d other sockets: %v", floodSockets, err)
			}
			if got := addrPortOf(src); got != fe {
				t.Errorf("the reply after %d other sockets came from %s, want the frontend %s", floodSockets, got, fe)
			}
		})
	}
}

// readFrom reads one datagram ("first") at the backend and returns its
// source, skipping the flood's.
func readFrom(t *testing.T, c *net.UDPConn) netip.AddrPort {
	t.Helper()
	buf := make([]byte, 64)
	c.SetReadDeadline(time.Now().Add(ioTimeout))
	for {
		n, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			t.Fatalf("the backend received nothing: %v", err)
		}
		if string(buf[:n]) == "first" {
			return from
		}
	}
}

// addrPortOf returns the address of a socket address, IPv4-mapped ones
// unmapped.
func addrPortOf(sa unix.Sockaddr) netip.AddrPort {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port))
	}
	return netip.AddrPort{}
}
