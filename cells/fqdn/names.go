package fqdn

import (
	"cmp"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/cells/fqdn/pattern"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/tables"
)

// OwnerPrefix starts the owner of a name's addresses in the prefixes table:
// "fqdn/<name>".
const OwnerPrefix = "fqdn/"

// Owner returns the prefixes owner of name's addresses.
func Owner(name string) string { return OwnerPrefix + name }

// nameManager keeps the fqdn-names table (the DNS cache) and the labels of
// its addresses in the prefixes table: every address of a name gets the
// labels of the selectors matching the name, under the name's owner. It is
// the one writer of both; mu serialises the proxy's answers, selector
// changes and garbage collection so that a row and its prefixes agree.
type nameManager struct {
	log        *slog.Logger
	db         *statedb.DB
	table      statedb.RWTable[*tables.FQDNName]
	identities statedb.Table[*tables.Identity]
	prefixes   ipcache.Prefixes
	metrics    *fqdnMetrics

	minTTL        time.Duration
	maxIPsPerName int
	maxIdentities int

	mu sync.Mutex
	// selectors are the FQDN selectors by label ("fqdn:<pattern>").
	selectors map[string]*pattern.Pattern
	// byIP are the names holding each address, the reverse of the
	// table's rows.
	byIP map[netip.Addr]map[string]struct{}
}

func (m *nameManager) link(ip netip.Addr, name string) {
	if m.byIP == nil {
		m.byIP = map[netip.Addr]map[string]struct{}{}
	}
	names := m.byIP[ip]
	if names == nil {
		names = map[string]struct{}{}
		m.byIP[ip] = names
	}
	names[name] = struct{}{}
}

func (m *nameManager) unlink(ip netip.Addr, name string) {
	if names := m.byIP[ip]; names != nil {
		delete(names, name)
		if len(names) == 0 {
			delete(m.byIP, ip)
		}
	}
}

// currentSelectors returns a copy of the selectors.
func (m *nameManager) currentSelectors() map[string]*pattern.Pattern {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.selectors)
}

// matching returns the labels of the selectors matching name, sorted.
func (m *nameManager) matching(name string) tables.Labels {
	var out []string
	for label, p := range m.selectors {
		if p.Match(name) {
			out = append(out, label)
		}
	}
	return tables.NewLabels(out...)
}

// parseSelectorLabel returns the pattern of a selector label
// "fqdn:<pattern>".
func parseSelectorLabel(label string) (*pattern.Pattern, error) {
	text, ok := strings.CutPrefix(label, tables.SourceFQDN+":")
	if !ok {
		return nil, fmt.Errorf("%q is not an FQDN selector", label)
	}
	return pattern.ParsePattern(text)
}

// settled tells, without waiting for the lock, that an answer for name
// with the addresses ips and TTL ttl seen at now would change nothing
// (see observe); false when it would, or when the lock is taken.
func (m *nameManager) settled(name string, ips []netip.Addr, ttl time.Duration, now time.Time) bool {
	if !m.mu.TryLock() {
		return false
	}
	defer m.mu.Unlock()
	labels := m.matching(name)
	if len(labels) == 0 || len(ips) == 0 {
		return true
	}
	return m.settledLocked(name, labels, ips, m.expiry(ttl, now), now)
}

// expiry is when addresses answered with TTL ttl at now expire: a DNS TTL
// counts whole seconds, so an address expires at the end of the second
// its TTL (raised to --tofqdns-min-ttl) ends in, and answers within one
// second give it the same expiry and repeat the row as it is.
func (m *nameManager) expiry(ttl time.Duration, now time.Time) time.Time {
	return ceilSecond(now.Add(max(ttl, m.minTTL)))
}

// settledLocked tells whether name's row already holds ips with labels,
// expiring no earlier than expires, all seen recently enough (unchanged).
func (m *nameManager) settledLocked(name string, labels tables.Labels, ips []netip.Addr, expires, now time.Time) bool {
	old, _, found := m.table.Get(m.db.ReadTxn(), tables.FQDNNameIndex.Query(name))
	return found && unchanged(old, labels, ips, expires, now)
}

// observe records an answer for name with the addresses ips and TTL ttl
// seen at now. It returns whether prefixes changed, and the revision to
// wait for. A name no selector matches records nothing.
func (m *nameManager) observe(name string, ips []netip.Addr, ttl time.Duration, now time.Time) (ipcache.Revision, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	labels := m.matching(name)
	if len(labels) == 0 || len(ips) == 0 {
		return 0, false, nil
	}
	expires := m.expiry(ttl, now)
	if m.settledLocked(name, labels, ips, expires, now) {
		return 0, false, nil
	}

	wtxn := m.db.WriteTxn(m.table)
	defer wtxn.Abort()
	row := &tables.FQDNName{Name: name, Selectors: labels}
	if old, _, found := m.table.Get(wtxn, tables.FQDNNameIndex.Query(name)); found {
		row = old.Clone()
		row.Selectors = labels
	}
	var (
		changes []ipcache.Change
		fresh   []int // indexes in row.IPs of addresses new to the name
	)
	answered := map[netip.Addr]struct{}{}
	index := make(map[netip.Addr]int, len(row.IPs))
	for i, e := range row.IPs {
		index[e.IP] = i
	}
	for _, ip := range ips {
		ip = ip.Unmap()
		answered[ip] = struct{}{}
		if i, ok := index[ip]; ok {
			row.IPs[i].Seen = now
			if expires.After(row.IPs[i].Expires) {
				row.IPs[i].Expires = expires
			}
			continue
		}
		row.IPs = append(row.IPs, tables.FQDNIP{IP: ip, Expires: expires, Seen: now})
		index[ip] = len(row.IPs) - 1
		fresh = append(fresh, len(row.IPs)-1)
	}
	// Too many addresses: the least recently seen go first, never one of
	// this answer unless the answer alone is over the limit.
	var evicted []tables.FQDNIP
	if m.maxIPsPerName > 0 && len(row.IPs) > m.maxIPsPerName {
		order := slices.Clone(row.IPs)
		slices.SortStableFunc(order, func(a, b tables.FQDNIP) int {
			_, aNew := answered[a.IP]
			_, bNew := answered[b.IP]
			if aNew != bNew {
				if aNew {
					return 1
				}
				return -1
			}
			return cmp.Or(a.Seen.Compare(b.Seen), a.Expires.Compare(b.Expires), a.IP.Compare(b.IP))
		})
		evicted = order[:len(order)-m.maxIPsPerName]
		gone := map[netip.Addr]struct{}{}
		for _, e := range evicted {
			gone[e.IP] = struct{}{}
			m.unlink(e.IP, name)
			changes = append(changes, ipcache.Delete(tables.HostPrefix(e.IP), Owner(name)))
		}
		var kept []tables.FQDNIP
		var keptFresh []int
		isFresh := make(map[int]bool, len(fresh))
		for _, i := range fresh {
			isFresh[i] = true
		}
		for i, e := range row.IPs {
			if _, ok := gone[e.IP]; ok {
				continue
			}
			if isFresh[i] {
				keptFresh = append(keptFresh, len(kept))
			}
			kept = append(kept, e)
		}
		row.IPs, fresh = kept, keptFresh
		m.metrics.evicted.Add(float64(len(evicted)))
	}
	if len(fresh) > 0 {
		breaker := m.newBreaker(wtxn)
		for _, i := range fresh {
			ip := row.IPs[i].IP
			m.link(ip, name)
			if !breaker.allow(ip, name, row.Selectors) {
				row.IPs[i].Unlabelled = true
				continue
			}
			changes = append(changes, ipcache.Upsert(tables.HostPrefix(ip), Owner(name), row.Selectors...))
		}
	}
	slices.SortFunc(row.IPs, func(a, b tables.FQDNIP) int { return a.IP.Compare(b.IP) })
	if _, _, err := m.table.Insert(wtxn, row); err != nil {
		return 0, false, fmt.Errorf("insert %s into %s: %w", name, tables.FQDNNamesTableName, err)
	}
	wtxn.Commit()
	if len(changes) == 0 {
		return 0, false, nil
	}
	rev, err := m.prefixes.Update(changes...)
	if err != nil {
		return 0, false, fmt.Errorf("label the addresses of %s: %w", name, err)
	}
	return rev, true, nil
}

// seenResolution is how old a known address's Seen may get before an
// answer holding it again is written to the table: the least recently
// seen addresses of a name are evicted first, and within a second the
// order hardly matters, while writing every answer made each query of a
// popular name a write transaction.
const seenResolution = time.Second

// ceilSecond returns t rounded up to a whole second.
func ceilSecond(t time.Time) time.Time {
	if c := t.Truncate(time.Second); !c.Equal(t) {
		return c.Add(time.Second)
	}
	return t
}

// unchanged tells whether an answer for row's name with the addresses ips
// (labels the selectors matching it, expires its expiry) would leave the
// row as it is, up to seenResolution: all addresses known, none expiring
// later, and the same labels. Then there is nothing to write, and no
// label to wait for.
func unchanged(row *tables.FQDNName, labels tables.Labels, ips []netip.Addr, expires, now time.Time) bool {
	if !row.Selectors.Equal(labels) {
		return false
	}
	for _, ip := range ips {
		i, ok := slices.BinarySearchFunc(row.IPs, ip.Unmap(), func(e tables.FQDNIP, ip netip.Addr) int { return e.IP.Compare(ip) })
		if !ok || expires.After(row.IPs[i].Expires) || now.Sub(row.IPs[i].Seen) >= seenResolution {
			return false
		}
	}
	return true
}

// setSelectors replaces the FQDN selectors and relabels the cached names
// whose matching selectors changed. A name no selector matches any more
// leaves the cache and its owner the prefixes table.
func (m *nameManager) setSelectors(selectors map[string]*pattern.Pattern) (ipcache.Revision, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.selectors = selectors
	wtxn := m.db.WriteTxn(m.table)
	defer wtxn.Abort()
	var (
		changes []ipcache.Change
		gone    []string
	)
	var rows []*tables.FQDNName
	for row := range m.table.All(wtxn) {
		rows = append(rows, row)
	}
	breaker := m.newBreaker(wtxn)
	for _, old := range rows {
		labels := m.matching(old.Name)
		if labels.Equal(old.Selectors) {
			continue
		}
		if len(labels) == 0 {
			if _, _, err := m.table.Delete(wtxn, old); err != nil {
				return 0, err
			}
			for _, e := range old.IPs {
				m.unlink(e.IP, old.Name)
			}
			gone = append(gone, old.Name)
			continue
		}
		row := old.Clone()
		row.Selectors = labels
		for i, e := range row.IPs {
			if breaker.allow(e.IP, row.Name, labels) {
				row.IPs[i].Unlabelled = false
				changes = append(changes, ipcache.Upsert(tables.HostPrefix(e.IP), Owner(row.Name), labels...))
			} else {
				row.IPs[i].Unlabelled = true
				changes = append(changes, ipcache.Delete(tables.HostPrefix(e.IP), Owner(row.Name)))
			}
		}
		if _, _, err := m.table.Insert(wtxn, row); err != nil {
			return 0, err
		}
	}
	wtxn.Commit()
	var rev ipcache.Revision
	if len(changes) > 0 {
		r, err := m.prefixes.Update(changes...)
		if err != nil {
			return 0, fmt.Errorf("relabel names: %w", err)
		}
		rev = r
	}
	for _, name := range gone {
		r, err := m.prefixes.DeleteOwner(Owner(name))
		if err != nil {
			return 0, fmt.Errorf("unlabel %s: %w", name, err)
		}
		rev = r
	}
	return rev, nil
}

// gc removes the addresses expired at now, and names left without any.
// It returns how many addresses it removed.
func (m *nameManager) gc(now time.Time) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	wtxn := m.db.WriteTxn(m.table)
	defer wtxn.Abort()
	var changes []ipcache.Change
	removed := 0
	var rows []*tables.FQDNName
	for row := range m.table.All(wtxn) {
		rows = append(rows, row)
	}
	for _, old := range rows {
		keep := slices.DeleteFunc(slices.Clone(old.IPs), func(e tables.FQDNIP) bool {
			if e.Expires.After(now) {
				return false
			}
			changes = append(changes, ipcache.Delete(tables.HostPrefix(e.IP), Owner(old.Name)))
			m.unlink(e.IP, old.Name)
			return true
		})
		if len(keep) == len(old.IPs) {
			continue
		}
		removed += len(old.IPs) - len(keep)
		if len(keep) == 0 {
			if _, _, err := m.table.Delete(wtxn, old); err != nil {
				return 0, err
			}
			continue
		}
		row := old.Clone()
		row.IPs = keep
		if _, _, err := m.table.Insert(wtxn, row); err != nil {
			return 0, err
		}
	}
	wtxn.Commit()
	if len(changes) > 0 {
		if _, err := m.prefixes.Update(changes...); err != nil {
			return 0, fmt.Errorf("unlabel expired addresses: %w", err)
		}
	}
	return removed, nil
}

// restore puts checkpointed rows back, with their labels: the addresses get
// the label sets, and so the identities, they had.
func (m *nameManager) restore(rows []*tables.FQDNName) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	wtxn := m.db.WriteTxn(m.table)
	defer wtxn.Abort()
	var changes []ipcache.Change
	for _, row := range rows {
		if _, _, err := m.table.Insert(wtxn, row); err != nil {
			return err
		}
		for _, e := range row.IPs {
			m.link(e.IP, row.Name)
			if !e.Unlabelled && len(row.Selectors) > 0 {
				changes = append(changes, ipcache.Upsert(tables.HostPrefix(e.IP), Owner(row.Name), row.Selectors...))
			}
		}
	}
	wtxn.Commit()
	if len(changes) > 0 {
		if _, err := m.prefixes.Update(changes...); err != nil {
			return fmt.Errorf("label restored addresses: %w", err)
		}
	}
	return nil
}

// breaker is the --tofqdns-max-identities circuit breaker over one
// transaction: an address may get a combination of FQDN selector labels
// that some identity already has, or a new one while fewer than the limit
// of identities carry fqdn: labels.
type breaker struct {
	m     *nameManager
	txn   statedb.ReadTxn
	known map[string]struct{} // fqdn: label subsets of identities, by key
	count int                 // identities carrying fqdn: labels, plus admitted ones
}

func (m *nameManager) newBreaker(txn statedb.ReadTxn) *breaker {
	return &breaker{m: m, txn: txn}
}

func fqdnSubset(l tables.Labels) tables.Labels {
	var out []string
	for _, s := range l {
		if strings.HasPrefix(s, tables.SourceFQDN+":") {
			out = append(out, s)
		}
	}
	return tables.NewLabels(out...)
}

// allow reports whether ip may carry labels for name: the combination of
// them with the labels the other names give ip.
func (b *breaker) allow(ip netip.Addr, name string, labels tables.Labels) bool {
	if b.m.maxIdentities <= 0 {
		return true
	}
	if b.known == nil {
		b.known = map[string]struct{}{}
		for id := range b.m.identities.All(b.txn) {
			if sub := fqdnSubset(id.Labels); len(sub) > 0 {
				b.known[sub.Key()] = struct{}{}
				b.count++
			}
		}
	}
	combo := labels
	for otherName := range b.m.byIP[ip] {
		if otherName == name {
			continue
		}
		other, _, found := b.m.table.Get(b.txn, tables.FQDNNameIndex.Query(otherName))
		if !found {
			continue
		}
		i := slices.IndexFunc(other.IPs, func(e tables.FQDNIP) bool { return e.IP == ip })
		if i >= 0 && !other.IPs[i].Unlabelled {
			combo = combo.Union(other.Selectors)
		}
	}
	key := combo.Key()
	if _, ok := b.known[key]; ok {
		return true
	}
	if b.count >= b.m.maxIdentities {
		b.m.metrics.breakerRefused.Inc()
		b.m.log.Warn("FQDN identity limit reached: address stays world",
			"ip", ip, "name", name, "labels", combo.String(), "limit", b.m.maxIdentities)
		return false
	}
	b.known[key] = struct{}{}
	b.count++
	return true
}
