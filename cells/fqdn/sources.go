package fqdn

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/tables"
)

// Reasons a query is refused before it is looked at, as the refused
// metric labels them.
const (
	// refusedUnknownSource: the client is neither a pod of this node nor
	// the node itself (another node's pod, anything routed in).
	refusedUnknownSource = "unknown-source"
	// refusedSourceBudget: the client already has
	// --dns-proxy-max-inflight-per-source UDP queries waiting for
	// resolvers.
	refusedSourceBudget = "source-inflight"
	// refusedTCPConns: the client already has
	// --dns-proxy-max-tcp-per-source TCP connections open.
	refusedTCPConns = "source-tcp-connections"
)

// nodeAddrsRefresh bounds how often the node's addresses are read again
// when a client is not found: a flood from unknown sources costs one read
// a second.
const nodeAddrsRefresh = time.Second

// sources tells the clients the proxy serves — this node's pods and the
// node itself — from every other source. A pod of this node is an address
// of a row of the endpoints table (the pods the agent runs policy for); the
// node is any address of the host's interfaces (read from the kernel,
// again at most once a second when a client is found nowhere, so an
// address added later is served within a second) and any loopback
// address. Anything else — another node's pod reaching this node's proxy
// port, a pod of this node before the agent knows it — is refused: it
// would get DNS without the rules of any endpoint.
type sources struct {
	db   *statedb.DB                     // nil: no endpoints table
	pods statedb.Table[*tables.Endpoint] // nil: only the node is served
	// nodeAddrs reads the node's addresses; net.InterfaceAddrs, or a
	// test's.
	nodeAddrs func() ([]netip.Addr, error)
	// anyLoopback serves every loopback address (only the node sends
	// from one); tests turn it off to have a loopback client that is not
	// the node.
	anyLoopback bool

	mu     sync.Mutex
	podsAt statedb.Revision
	byAddr map[netip.Addr]struct{} // the pods' addresses
	node   map[netip.Addr]struct{}
	nodeAt time.Time // when node was read, zero before
}

// local tells whether addr is a pod of this node or the node itself.
func (s *sources) local(addr netip.Addr) bool {
	addr = addr.Unmap()
	if s == nil {
		return addr.IsLoopback()
	}
	if addr.IsLoopback() && s.anyLoopback {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pods != nil {
		rtxn := s.db.ReadTxn()
		if rev := s.pods.Revision(rtxn); rev != s.podsAt || s.byAddr == nil {
			s.podsAt = rev
			s.byAddr = map[netip.Addr]struct{}{}
			for ep := range s.pods.All(rtxn) {
				for _, a := range ep.IPs {
					s.byAddr[a.Unmap()] = struct{}{}
				}
			}
		}
		if _, ok := s.byAddr[addr]; ok {
			return true
		}
	}
	if _, ok := s.node[addr]; ok {
		return true
	}
	if time.Since(s.nodeAt) < nodeAddrsRefresh {
		return false
	}
	s.nodeAt = time.Now()
	if addrs, err := s.nodeAddrs(); err == nil {
		s.node = map[netip.Addr]struct{}{}
		for _, a := range addrs {
			s.node[a.Unmap()] = struct{}{}
		}
	}
	_, ok := s.node[addr]
	return ok
}

// interfaceAddrs returns the addresses of the host's interfaces.
func interfaceAddrs() ([]netip.Addr, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("read the node's addresses: %w", err)
	}
	var out []netip.Addr
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil {
			out = append(out, p.Addr())
		}
	}
	return out, nil
}

// throttledWarn logs a warning at most once a second per reason: a
// misbehaving client must not flood the log.
type throttledWarn struct {
	mu   sync.Mutex
	last map[string]time.Time
}

func (w *throttledWarn) warn(log *slog.Logger, reason, msg string, args ...any) {
	w.mu.Lock()
	now := time.Now()
	if w.last == nil {
		w.last = map[string]time.Time{}
	}
	if now.Sub(w.last[reason]) < time.Second {
		w.mu.Unlock()
		return
	}
	w.last[reason] = now
	w.mu.Unlock()
	log.Warn(msg, args...)
}

// refuse counts a query or connection refused for reason and warns (at
// most once a second per reason).
func (p *Proxy) refuse(reason string, client netip.AddrPort, msg string) {
	p.metrics.refused.WithLabelValues(reason).Inc()
	p.warnings.warn(p.log, reason, msg, "client", client, "reason", reason)
}

// budgetListener is the TCP listener with at most max connections open
// per source address: past that a new one is closed at once, so that one
// client cannot take every goroutine and dial of the proxy (each
// connection carries one query to a resolver at a time).
type budgetListener struct {
	net.Listener
	p   *Proxy
	max int

	mu   sync.Mutex
	open map[netip.Addr]int
}

// Accept returns the next connection within its source's budget.
func (l *budgetListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		src := addrPortOf(c.RemoteAddr())
		l.mu.Lock()
		n := l.open[src.Addr()]
		if n >= l.max {
			l.mu.Unlock()
			c.Close()
			l.p.refuse(refusedTCPConns, src, "DNS proxy: a client has too many TCP connections open, closing the new one")
			continue
		}
		l.open[src.Addr()] = n + 1
		l.mu.Unlock()
		return &budgetConn{Conn: c, l: l, src: src.Addr()}, nil
	}
}

// release gives back one connection of src.
func (l *budgetListener) release(src netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open[src]--; l.open[src] <= 0 {
		delete(l.open, src)
	}
}

// budgetConn is a connection counted against its source's budget until
// closed.
type budgetConn struct {
	net.Conn
	l    *budgetListener
	src  netip.Addr
	once sync.Once
}

// Close closes the connection and gives back its place.
func (c *budgetConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.release(c.src) })
	return err
}
