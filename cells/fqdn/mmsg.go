package fqdn

import (
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// peer is a UDP client's socket address as the kernel gave it (IPv4, or
// IPv6 with its scope), kept to send the reply back to.
type peer struct {
	raw unix.RawSockaddrInet6 // large enough for either family
	len uint32
}

// addrPort returns p's address (an IPv4-mapped one unmapped) and port.
func (p *peer) addrPort() netip.AddrPort {
	b := (*[2]byte)(unsafe.Pointer(&p.raw.Port))
	port := uint16(b[0])<<8 | uint16(b[1])
	switch p.raw.Family {
	case unix.AF_INET:
		r4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(&p.raw))
		return netip.AddrPortFrom(netip.AddrFrom4(r4.Addr), port)
	case unix.AF_INET6:
		return netip.AddrPortFrom(netip.AddrFrom16(p.raw.Addr).Unmap(), port)
	}
	return netip.AddrPort{}
}

// msgBatch is the memory of one recvmmsg or sendmmsg call: a header, an
// address, a buffer and control space for each datagram.
type msgBatch struct {
	hdrs  []unix.Mmsghdr
	iovs  []unix.Iovec
	peers []peer
	bufs  [][]byte // receiving only; sent datagrams are the callers'
	oobs  [][]byte
}

// newMsgBatch returns a batch of n datagrams of up to bufSize bytes (0:
// for sending) with oobSize bytes of control messages each.
func newMsgBatch(n, bufSize, oobSize int) *msgBatch {
	b := &msgBatch{
		hdrs: make([]unix.Mmsghdr, n), iovs: make([]unix.Iovec, n), peers: make([]peer, n),
		oobs: make([][]byte, n),
	}
	for i := range n {
		if bufSize > 0 {
			b.bufs = append(b.bufs, make([]byte, bufSize))
		}
		b.oobs[i] = make([]byte, oobSize)
	}
	return b
}

// point sets datagram i's header to its address, data and control space.
func (b *msgBatch) point(i int, data []byte, namelen uint32, oobLen int) {
	b.iovs[i].Base = unsafe.SliceData(data)
	b.iovs[i].SetLen(len(data))
	h := &b.hdrs[i].Hdr
	h.Name = (*byte)(unsafe.Pointer(&b.peers[i].raw))
	h.Namelen = namelen
	h.Iov = &b.iovs[i]
	h.SetIovlen(1)
	h.Control = nil
	if oobLen > 0 {
		h.Control = &b.oobs[i][0]
	}
	h.SetControllen(oobLen)
	h.Flags = 0
	b.hdrs[i].Len = 0
}

// recv reads up to a batch of datagrams from the non-blocking socket fd.
func (b *msgBatch) recv(fd int) (int, error) {
	for i := range b.hdrs {
		b.point(i, b.bufs[i], unix.SizeofSockaddrInet6, len(b.oobs[i]))
	}
	n, _, errno := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(fd), uintptr(unsafe.Pointer(&b.hdrs[0])), uintptr(len(b.hdrs)), unix.MSG_DONTWAIT, 0, 0)
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// message returns the i-th datagram recv read: its data, sender, the
// address it was sent to (with pktinfo asked for; else invalid), and
// whether it was longer than the buffer.
func (b *msgBatch) message(i int) (data []byte, from peer, dst netip.Addr, truncated bool) {
	h := &b.hdrs[i]
	from = b.peers[i]
	from.len = h.Hdr.Namelen
	if n := int(h.Hdr.Controllen); n > 0 {
		dst = pktinfoDst(b.oobs[i][:n])
	}
	return b.bufs[i][:h.Len], from, dst, h.Hdr.Flags&unix.MSG_TRUNC != 0
}

// set makes datagram i of a sending batch data, to p, from src when src
// is valid (the socket is bound to an unspecified address).
func (b *msgBatch) set(i int, data []byte, p peer, src netip.Addr) {
	b.peers[i] = p
	b.point(i, data, p.len, putPktinfo(b.oobs[i], src))
}

// send sends the first n datagrams set on the non-blocking socket fd and
// returns how many the kernel took; an error means it took none.
func (b *msgBatch) send(fd, n int) (int, error) {
	sent, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(fd), uintptr(unsafe.Pointer(&b.hdrs[0])), uintptr(n), unix.MSG_DONTWAIT, 0, 0)
	for i := range n {
		b.iovs[i].Base = nil // the replies are garbage now
	}
	if errno != 0 {
		return 0, errno
	}
	return int(sent), nil
}

// pktinfoSpace is the control space a datagram's destination address
// takes, either family.
var pktinfoSpace = max(unix.CmsgSpace(unix.SizeofInet4Pktinfo), unix.CmsgSpace(unix.SizeofInet6Pktinfo))

// pktinfoDst returns the destination address IP_PKTINFO or IPV6_PKTINFO
// gave in the control messages oob (IPv4-mapped unmapped), invalid if
// neither is there.
func pktinfoDst(oob []byte) netip.Addr {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return netip.Addr{}
	}
	for _, m := range msgs {
		switch {
		case m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_PKTINFO && len(m.Data) >= unix.SizeofInet4Pktinfo:
			info := (*unix.Inet4Pktinfo)(unsafe.Pointer(&m.Data[0]))
			return netip.AddrFrom4(info.Addr)
		case m.Header.Level == unix.IPPROTO_IPV6 && m.Header.Type == unix.IPV6_PKTINFO && len(m.Data) >= unix.SizeofInet6Pktinfo:
			info := (*unix.Inet6Pktinfo)(unsafe.Pointer(&m.Data[0]))
			return netip.AddrFrom16(info.Addr).Unmap()
		}
	}
	return netip.Addr{}
}

// putPktinfo writes into oob the control message that sends a datagram
// from src and returns its length; nothing for an invalid src.
func putPktinfo(oob []byte, src netip.Addr) int {
	if !src.IsValid() || len(oob) < pktinfoSpace {
		return 0
	}
	clear(oob)
	h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
	data := unsafe.Pointer(&oob[unix.CmsgLen(0)])
	if src.Is4() {
		h.Level, h.Type = unix.IPPROTO_IP, unix.IP_PKTINFO
		h.SetLen(unix.CmsgLen(unix.SizeofInet4Pktinfo))
		(*unix.Inet4Pktinfo)(data).Spec_dst = src.As4()
		return unix.CmsgSpace(unix.SizeofInet4Pktinfo)
	}
	h.Level, h.Type = unix.IPPROTO_IPV6, unix.IPV6_PKTINFO
	h.SetLen(unix.CmsgLen(unix.SizeofInet6Pktinfo))
	(*unix.Inet6Pktinfo)(data).Addr = src.As16()
	return unix.CmsgSpace(unix.SizeofInet6Pktinfo)
}
