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

// Owner returns the prefixes owner of the addresses of the fqdn-names row
// with the key key (see tables.FQDNKey): "fqdn/<name>" for trusted
// answers, "fqdn/<name>@<endpoint>" for one endpoint's untrusted ones.
func Owner(key string) string { return OwnerPrefix + key }

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
	maxIPsPerPod  int
	maxIdentities int

	mu sync.Mutex
	// selectors are the FQDN selectors by label ("fqdn:<pattern>").
	selectors map[string]*pattern.Pattern
	// byIP are the rows (by key) holding each address, the reverse of
	// the table's rows.
	byIP map[netip.Addr]map[string]struct{}
	// podIPs counts the addresses of the rows each endpoint's answers
	// brought (FQDNIP.By), for --tofqdns-max-ips-per-pod.
	podIPs map[string]int
}

// count adds delta to the addresses endpoint by brought.
func (m *nameManager) count(by string, delta int) {
	if by == "" {
		return
	}
	if m.podIPs == nil {
		m.podIPs = map[string]int{}
	}
	if m.podIPs[by] += delta; m.podIPs[by] <= 0 {
		delete(m.podIPs, by)
	}
}

// rowLabels returns the labels the addresses of name's row for endpoint
// get: those of the selectors matching name, each made the endpoint's
// own (see tables.EndpointFQDNLabel) for an endpoint's untrusted answers.
func (m *nameManager) rowLabels(name, endpoint string) tables.Labels {
	labels := m.matching(name)
	if endpoint == "" || len(labels) == 0 {
		return labels
	}
	out := make([]string, len(labels))
	for i, l := range labels {
		out[i] = tables.EndpointFQDNLabel(l, endpoint)
	}
	return tables.NewLabels(out...)
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
// (for endpoint alone when not empty) with the addresses ips and TTL ttl
// seen at now would change nothing (see observe); false when it would, or
// when the lock is taken.
func (m *nameManager) settled(name, endpoint string, ips []netip.Addr, ttl time.Duration, now time.Time) bool {
	if !m.mu.TryLock() {
		return false
	}
	defer m.mu.Unlock()
	labels := m.rowLabels(name, endpoint)
	if len(labels) == 0 || len(ips) == 0 {
		return true
	}
	return m.settledLocked(tables.FQDNKey(name, endpoint), labels, ips, m.expiry(ttl, now), now)
}

// expiry is when addresses answered with TTL ttl at now expire: a DNS TTL
// counts whole seconds, so an address expires at the end of the second
// its TTL (raised to --tofqdns-min-ttl) ends in, and answers within one
// second give it the same expiry and repeat the row as it is.
func (m *nameManager) expiry(ttl time.Duration, now time.Time) time.Time {
	return ceilSecond(now.Add(max(ttl, m.minTTL)))
}

// settledLocked tells whether the row with the key key already holds ips
// with labels, expiring no earlier than expires, all seen recently enough
// (unchanged).
func (m *nameManager) settledLocked(key string, labels tables.Labels, ips []netip.Addr, expires, now time.Time) bool {
	old, _, found := m.table.Get(m.db.ReadTxn(), tables.FQDNNameIndex.Query(key))
	return found && unchanged(old, labels, ips, expires, now)
}

// observe records an answer for name with the addresses ips and TTL ttl
// seen at now, which endpoint by asked for ("": the node, or a query to
// the proxy itself). With endpoint empty the answer came from a resolver
// the node trusts and labels its addresses for every pod; otherwise
// (endpoint is by) for that endpoint alone. It returns whether prefixes
// changed, the revision to wait for, and the addresses refused because by
// brought --tofqdns-max-ips-per-pod already. A name no selector matches
// records nothing.
func (m *nameManager) observe(name, endpoint, by string, ips []netip.Addr, ttl time.Duration, now time.Time) (ipcache.Revision, bool, []netip.Addr, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	labels := m.rowLabels(name, endpoint)
	if len(labels) == 0 || len(ips) == 0 {
		return 0, false, nil, nil
	}
	key := tables.FQDNKey(name, endpoint)
	expires := m.expiry(ttl, now)
	if m.settledLocked(key, labels, ips, expires, now) {
		return 0, false, nil, nil
	}

	wtxn := m.db.WriteTxn(m.table)
	defer wtxn.Abort()
	row := &tables.FQDNName{Name: name, Endpoint: endpoint, Selectors: labels}
	if old, _, found := m.table.Get(wtxn, tables.FQDNNameIndex.Query(key)); found {
		row = old.Clone()
		row.Selectors = labels
	}
	var (
		changes []ipcache.Change
		fresh   []int // indexes in row.IPs of addresses new to the name
		refused []netip.Addr
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
		// An endpoint's answers bring at most --tofqdns-max-ips-per-pod
		// addresses, so that no pod fills the ipcache (its resolver may
		// answer any number of names with any number of addresses).
		if by != "" && m.maxIPsPerPod > 0 && m.podIPs[by] >= m.maxIPsPerPod {
			refused = append(refused, ip)
			continue
		}
		m.count(by, 1)
		row.IPs = append(row.IPs, tables.FQDNIP{IP: ip, Expires: expires, Seen: now, By: by})
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
			m.unlink(e.IP, key)
			m.count(e.By, -1)
			changes = append(changes, ipcache.Delete(tables.HostPrefix(e.IP), Owner(key)))
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
			m.link(ip, key)
			if !breaker.allow(ip, key, row.Selectors) {
				row.IPs[i].Unlabelled = true
				continue
			}
			changes = append(changes, ipcache.Upsert(tables.HostPrefix(ip), Owner(key), row.Selectors...))
		}
	}
	if len(refused) > 0 {
		m.metrics.podRefused.Add(float64(len(refused)))
	}
	if len(row.IPs) == 0 {
		// Every address refused: nothing to keep.
		return 0, false, refused, nil
	}
	slices.SortFunc(row.IPs, func(a, b tables.FQDNIP) int { return a.IP.Compare(b.IP) })
	if _, _, err := m.table.Insert(wtxn, row); err != nil {
		return 0, false, refused, fmt.Errorf("insert %s into %s: %w", key, tables.FQDNNamesTableName, err)
	}
	wtxn.Commit()
	if len(changes) == 0 {
		return 0, false, refused, nil
	}
	rev, err := m.prefixes.Update(changes...)
	if err != nil {
		return 0, false, refused, fmt.Errorf("label the addresses of %s: %w", key, err)
	}
	return rev, true, refused, nil
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
		labels := m.rowLabels(old.Name, old.Endpoint)
		if labels.Equal(old.Selectors) {
			continue
		}
		if len(labels) == 0 {
			if _, _, err := m.table.Delete(wtxn, old); err != nil {
				return 0, err
			}
			for _, e := range old.IPs {
				m.unlink(e.IP, old.Key())
				m.count(e.By, -1)
			}
			gone = append(gone, old.Key())
			continue
		}
		row := old.Clone()
		row.Selectors = labels
		for i, e := range row.IPs {
			if breaker.allow(e.IP, row.Key(), labels) {
				row.IPs[i].Unlabelled = false
				changes = append(changes, ipcache.Upsert(tables.HostPrefix(e.IP), Owner(row.Key()), labels...))
			} else {
				row.IPs[i].Unlabelled = true
				changes = append(changes, ipcache.Delete(tables.HostPrefix(e.IP), Owner(row.Key())))
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
	for _, key := range gone {
		r, err := m.prefixes.DeleteOwner(Owner(key))
		if err != nil {
			return 0, fmt.Errorf("unlabel %s: %w", key, err)
		}
		rev = r
	}
	return rev, nil
}

// dropEndpoints removes the rows of the untrusted answers of the
// endpoints live does not hold (they are gone), and their labels. It
// returns how many rows it removed.
func (m *nameManager) dropEndpoints(live func(endpoint string) bool) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	// Read first: most passes find nothing, and need no write.
	var gone []*tables.FQDNName
	for row := range m.table.All(m.db.ReadTxn()) {
		if row.Endpoint != "" && !live(row.Endpoint) {
			gone = append(gone, row)
		}
	}
	if len(gone) == 0 {
		return 0, nil
	}
	wtxn := m.db.WriteTxn(m.table)
	defer wtxn.Abort()
	for _, row := range gone {
		if _, _, err := m.table.Delete(wtxn, row); err != nil {
			return 0, err
		}
		for _, e := range row.IPs {
			m.unlink(e.IP, row.Key())
			m.count(e.By, -1)
		}
	}
	wtxn.Commit()
	for _, row := range gone {
		if _, err := m.prefixes.DeleteOwner(Owner(row.Key())); err != nil {
			return 0, fmt.Errorf("unlabel %s: %w", row.Key(), err)
		}
	}
	return len(gone), nil
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
			changes = append(changes, ipcache.Delete(tables.HostPrefix(e.IP), Owner(old.Key())))
			m.unlink(e.IP, old.Key())
			m.count(e.By, -1)
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
			m.link(e.IP, row.Key())
			m.count(e.By, 1)
			if !e.Unlabelled && len(row.Selectors) > 0 {
				changes = append(changes, ipcache.Upsert(tables.HostPrefix(e.IP), Owner(row.Key()), row.Selectors...))
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

// allow reports whether ip may carry labels for the row with the key name:
// the combination of them with the labels the other rows give ip.
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
