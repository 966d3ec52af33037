package endpoints

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/tables"
)

// A pod address belongs to one pod. Two pods listing the same address (a
// stale pod whose deletion has not arrived yet, a pod file written by
// mistake or on purpose) must not merge their labels into one identity:
// the address would then select neither pod's policies, and a pod could
// take on another's identity by naming its address. So each address has a
// holder, whose labels alone it gets in the ipcache, and the other
// claimants are errors on their endpoints (and the holder's), and in
// health, until the conflict ends.
//
// The holder is the oldest claimant: the pod created first
// (metadata.creationTimestamp), and among pods created in the same second
// (or without a timestamp, as pods of --config-dir may be) the one this
// agent heard of first. A newcomer claiming an address a pod holds is thus
// the error, every agent agrees on the holder of pods from Kubernetes, and
// when the holder lets the address go (deleted, terminated, another
// address) the next oldest claimant gets it.

// claimant is a pod claiming an address, with what orders it.
type claimant struct {
	key     k8s.Key
	created time.Time
	seen    uint64
}

func (a claimant) before(b claimant) bool {
	if !a.created.Equal(b.created) {
		return a.created.Before(b.created)
	}
	return a.seen < b.seen
}

// addressClaims are the claimants of each pod address, the holder first,
// and the addresses with more than one.
type addressClaims struct {
	byAddr     map[netip.Addr][]claimant
	conflicted map[netip.Addr]struct{}
}

func newAddressClaims() addressClaims {
	return addressClaims{byAddr: map[netip.Addr][]claimant{}, conflicted: map[netip.Addr]struct{}{}}
}

// holder returns the pod that holds ip.
func (a *addressClaims) holder(ip netip.Addr) (k8s.Key, bool) {
	if cl := a.byAddr[ip]; len(cl) > 0 {
		return cl[0].key, true
	}
	return k8s.Key{}, false
}

func (a *addressClaims) set(ip netip.Addr, cl []claimant) {
	switch {
	case len(cl) == 0:
		delete(a.byAddr, ip)
	default:
		a.byAddr[ip] = cl
	}
	if len(cl) > 1 {
		a.conflicted[ip] = struct{}{}
	} else {
		delete(a.conflicted, ip)
	}
}

// claim records that the pod s (key) lists ip, and queues the ipcache
// changes if it becomes the holder.
func (c *controller) claim(ip netip.Addr, key k8s.Key, s *podState) {
	cl := c.claims.byAddr[ip]
	prev, hadHolder := c.claims.holder(ip)
	me := claimant{key: key, created: s.pod.CreationTimestamp.Time, seen: s.seen}
	i := 0
	for i < len(cl) && cl[i].before(me) {
		i++
	}
	cl = slices.Insert(slices.Clone(cl), i, me)
	c.claims.set(ip, cl)
	c.claimsChanged(cl)
	if i > 0 {
		c.Log.Warn("A pod claims an address another pod holds: it is not this pod's",
			"pod", key, "address", ip, "holder", cl[0].key)
		return
	}
	if hadHolder {
		c.Log.Warn("An older pod claims an address another pod held: it is the older pod's now",
			"pod", key, "address", ip, "previous", prev)
		c.changes = append(c.changes, ipcache.Delete(tables.HostPrefix(ip), owner(prev)))
	}
	c.changes = append(c.changes, ipcache.Change{Prefix: tables.HostPrefix(ip), Owner: owner(key), Labels: s.labels})
}

// unclaim records that the pod key no longer lists ip, handing it to the
// next claimant if key held it.
func (c *controller) unclaim(ip netip.Addr, key k8s.Key) {
	cl := c.claims.byAddr[ip]
	i := slices.IndexFunc(cl, func(x claimant) bool { return x.key == key })
	if i < 0 {
		return
	}
	c.claimsChanged(cl)
	cl = slices.Delete(slices.Clone(cl), i, i+1)
	c.claims.set(ip, cl)
	if i > 0 {
		return
	}
	c.changes = append(c.changes, ipcache.Delete(tables.HostPrefix(ip), owner(key)))
	if len(cl) > 0 {
		next := cl[0].key
		c.Log.Info("A pod's address goes to the next pod claiming it", "address", ip, "pod", next, "previous", key)
		c.changes = append(c.changes, ipcache.Change{Prefix: tables.HostPrefix(ip), Owner: owner(next), Labels: c.pods[next].labels})
	}
}

// claimsChanged marks the endpoints of the local claimants of an address
// whose claimants changed, when there were several (their errors change).
func (c *controller) claimsChanged(cl []claimant) {
	if len(cl) < 2 {
		return
	}
	for _, x := range cl {
		if c.isLocal(c.pods[x.key]) {
			c.dirty[x.key] = struct{}{}
		}
	}
}

// claimErrors returns what is wrong with the addresses of the pod key, and
// the first address it holds.
func (c *controller) claimErrors(key k8s.Key, s *podState) (errs []string, first netip.Addr, holds bool) {
	for _, ip := range s.ips {
		cl := c.claims.byAddr[ip]
		if len(cl) == 0 {
			continue
		}
		if cl[0].key == key {
			if !holds {
				first, holds = ip, true
			}
			if len(cl) > 1 {
				errs = append(errs, fmt.Sprintf("address %s is claimed by pod %s too (it stays this pod's)", ip, claimantNames(cl[1:])))
			}
			continue
		}
		errs = append(errs, fmt.Sprintf("address %s belongs to pod %s, which claimed it first (not this pod's)", ip, cl[0].key))
	}
	return errs, first, holds
}

func claimantNames(cl []claimant) string {
	names := make([]string, len(cl))
	for i, x := range cl {
		names[i] = x.key.String()
	}
	return strings.Join(names, ", ")
}

// claimsHealth describes the addresses claimed by several pods, "" when
// there are none.
func (c *controller) claimsHealth() string {
	if len(c.claims.conflicted) == 0 {
		return ""
	}
	addrs := slices.SortedFunc(func(yield func(netip.Addr) bool) {
		for ip := range c.claims.conflicted {
			if !yield(ip) {
				return
			}
		}
	}, netip.Addr.Compare)
	const shown = 5
	var parts []string
	for _, ip := range addrs[:min(len(addrs), shown)] {
		parts = append(parts, fmt.Sprintf("%s (%s)", ip, claimantNames(c.claims.byAddr[ip])))
	}
	if len(addrs) > shown {
		parts = append(parts, fmt.Sprintf("and %d more", len(addrs)-shown))
	}
	return fmt.Sprintf("%d addresses claimed by several pods, the first keeps each: %s", len(addrs), strings.Join(parts, ", "))
}
