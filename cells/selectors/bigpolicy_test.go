package selectors_test

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/statedb"

	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/tables"
)

// bigCIDRs is the size of the big policy of these tests: several chunks of
// the controller's writes and of the ipcache resolver's.
const bigCIDRs = 5_000

const testTimeout = 2 * time.Minute

// snapshot is every row of the tables a policy changes, as db/show prints
// them.
type snapshot map[string][]string

func (a *agent) snapshot(txn statedb.ReadTxn) snapshot {
	s := snapshot{}
	add := func(name string, row []string) { s[name] = append(s[name], strings.Join(row, " | ")) }
	for r := range a.policies.All(txn) {
		add("policies", r.TableRow())
	}
	for r := range a.selectors.All(txn) {
		add("selectors", r.TableRow())
	}
	for r := range a.prefixTbl.All(txn) {
		add("prefixes", r.TableRow())
	}
	for r := range a.ipcache.All(txn) {
		add("ipcache", r.TableRow())
	}
	for r := range a.identities.All(txn) {
		add("identities", r.TableRow())
	}
	return s
}

// diff describes how s differs from want, a few rows per table.
func (s snapshot) diff(want snapshot) string {
	var b strings.Builder
	for _, table := range []string{"policies", "selectors", "prefixes", "ipcache", "identities"} {
		got, exp := s[table], want[table]
		var extra, missing []string
		for _, r := range got {
			if !slices.Contains(exp, r) {
				extra = append(extra, r)
			}
		}
		for _, r := range exp {
			if !slices.Contains(got, r) {
				missing = append(missing, r)
			}
		}
		if len(extra)+len(missing) > 0 {
			fmt.Fprintf(&b, "%s: %d rows, want %d; extra %q; missing %q\n",
				table, len(got), len(exp), extra[:min(3, len(extra))], missing[:min(3, len(missing))])
		}
	}
	return b.String()
}

func (s snapshot) equal(o snapshot) bool {
	for _, table := range []string{"policies", "selectors", "prefixes", "ipcache", "identities"} {
		if !slices.Equal(s[table], o[table]) {
			return false
		}
	}
	return true
}

// checkPolicyRefs returns an error unless every selector a valid policies
// row names (subjects, peers, and those of its specs) is in the selectors
// table, listing that policy: what each commit of the controller keeps,
// however many chunks a change takes.
func (a *agent) checkPolicyRefs(txn statedb.ReadTxn) error {
	for p := range a.policies.All(txn) {
		if p.Status != tables.PolicyOK {
			continue
		}
		named := append(slices.Clone(p.Subjects), p.Peers...)
		for _, spec := range p.Specs {
			named = append(named, spec.Subject)
			for _, r := range spec.Rules {
				for _, peer := range r.Peers {
					if peer != tables.AnyPeer { // identity 0, not a selector
						named = append(named, peer)
					}
				}
			}
		}
		for _, sel := range named {
			row, _, found := a.selectors.Get(txn, tables.SelectorIndex.Query(sel))
			if !found {
				return fmt.Errorf("policy %s names selector %s, which is not in the table", p.Name, sel)
			}
			if !slices.Contains(row.Policies, p.Name) {
				return fmt.Errorf("policy %s names selector %s, whose policies are %v", p.Name, sel, row.Policies)
			}
		}
	}
	return nil
}

// cidrsApplied reports whether the policy called name (cnp/default/…) has
// exactly the given CIDRs and each of its CIDR selectors selects an
// identity.
func (a *agent) cidrsApplied(name string, cidrs []netip.Prefix) func(statedb.ReadTxn) bool {
	want := make([]string, len(cidrs))
	for i, p := range cidrs {
		want[i] = p.String()
	}
	slices.Sort(want)
	return func(txn statedb.ReadTxn) bool {
		p, _, found := a.policies.Get(txn, tables.PolicyNameIndex.Query(name))
		if !found || !slices.Equal(slices.Sorted(slices.Values(p.CIDRs)), want) {
			return false
		}
		for _, sel := range p.Peers {
			row, _, found := a.selectors.Get(txn, tables.SelectorIndex.Query(sel))
			if !found || strings.HasPrefix(sel, "cidr:") && len(row.Identities) == 0 {
				return false
			}
		}
		return true
	}
}

// withBaseline starts an agent holding a small policy and prefixes of other
// owners, some inside the big policy's CIDRs, and waits until they are
// settled.
func withBaseline(t *testing.T) *agent {
	a := startAgent(t)
	base := cidrPolicy("base", []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")})
	base.Spec.Egress = append(base.Spec.Egress, selectors.EgressRule{ToFQDNs: []selectors.FQDNSelector{{MatchPattern: "*.example.com"}}})
	a.addPolicy(t, base)
	if _, err := a.prefixes.Update(
		// Inside and outside the big policy's first CIDR, 11.0.0.0/16: the
		// one inside changes identity while the policy is there, and gets
		// its old one back (the one outside keeps it alive).
		ipcache.Upsert(netip.MustParsePrefix("11.0.0.5/32"), "fqdn/a.example.com", "fqdn:*.example.com"),
		ipcache.Upsert(netip.MustParsePrefix("12.0.0.5/32"), "fqdn/a.example.com", "fqdn:*.example.com"),
		// A pod inside the big policy's CIDRs keeps its identity.
		ipcache.Upsert(netip.MustParsePrefix("11.0.1.9/32"), "pod/default/web-1", "k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"),
	); err != nil {
		t.Fatal(err)
	}
	selects := func(txn statedb.ReadTxn, sel string, n int) bool {
		row, _, found := a.selectors.Get(txn, tables.SelectorIndex.Query(sel))
		return found && len(row.Identities) == n
	}
	a.waitUntil(t, testTimeout, "baseline", func(txn statedb.ReadTxn) bool {
		return selects(txn, "fqdn:*.example.com", 1) && selects(txn, "cidr:10.0.0.0/8", 1) &&
			selects(txn, "any:app=web, k8s:io.kubernetes.pod.namespace=default", 1)
	})
	return a
}

// TestBigPolicyRoundTrip adds a policy of 5,000 CIDRs, changes half of
// them, and removes it: afterwards the policies, selectors, prefixes,
// ipcache and identities tables are exactly as they were before it came,
// and every commit of the controller on the way (several chunks each)
// kept each selector a policy names in the selectors table.
func TestBigPolicyRoundTrip(t *testing.T) {
	var (
		mu        sync.Mutex
		agentRefs *agent
		chunked   int
		refErr    error
	)
	selectors.SetTestHookCommitted(t, func(table string, chunk, chunks int) {
		mu.Lock()
		defer mu.Unlock()
		if table != "selectors" || agentRefs == nil {
			return
		}
		if chunks > 1 {
			chunked++
		}
		if err := agentRefs.checkPolicyRefs(agentRefs.db.ReadTxn()); err != nil && refErr == nil {
			refErr = fmt.Errorf("after chunk %d of %d: %w", chunk, chunks, err)
		}
	})
	a := withBaseline(t)
	mu.Lock()
	agentRefs = a
	mu.Unlock()
	before := a.snapshot(a.db.ReadTxn())

	cidrs := policyCIDRs(bigCIDRs)
	big := cidrPolicy("big", cidrs)
	a.addPolicy(t, big)
	a.waitUntil(t, testTimeout, "big policy applied", a.cidrsApplied("cnp/default/big", cidrs))
	// The FQDN address inside the policy's /16 now has an identity of its
	// own (with the cidr: label), which the FQDN selector selects too.
	a.waitUntil(t, testTimeout, "FQDN selector follows the relabel", func(txn statedb.ReadTxn) bool {
		row, _, found := a.selectors.Get(txn, tables.SelectorIndex.Query("fqdn:*.example.com"))
		return found && len(row.Identities) == 2
	})

	// Half the CIDRs go, as many new ones come.
	changed := slices.Clone(cidrs[bigCIDRs/2:])
	for i := range bigCIDRs / 2 {
		changed = append(changed, netip.PrefixFrom(netip.AddrFrom4([4]byte{13, byte(i >> 8), byte(i), 0}), 24))
	}
	big = cidrPolicy("big", changed)
	big.ResourceVersion = "2"
	if err := a.fake.Update(cnpResource, big, big.Namespace); err != nil {
		t.Fatal(err)
	}
	a.waitUntil(t, testTimeout, "big policy changed", a.cidrsApplied("cnp/default/big", changed))

	a.deletePolicy(t, big)
	var last snapshot
	a.waitUntil(t, testTimeout, "tables as before the big policy", func(txn statedb.ReadTxn) bool {
		last = a.snapshot(txn)
		return last.equal(before)
	}, func() string { return last.diff(before) })
	// The map too: waitUntil waited for it.

	mu.Lock()
	defer mu.Unlock()
	agentRefs = nil
	if refErr != nil {
		t.Error(refErr)
	}
	// Adding, changing and removing 5,000 CIDRs each took several chunks.
	if chunked < 3*(bigCIDRs/selectors.WriteChunk) {
		t.Errorf("%d commits were part of a chunked change, want at least %d", chunked, 3*(bigCIDRs/selectors.WriteChunk))
	}
}

// TestWritersGetInDuringRemoval removes a policy of 5,000 CIDRs and, right
// after the controller commits the first of several chunks of prefixes and
// then of selectors, has another writer write the same table (the prefixes
// of another owner, as the DNS proxy does; the selectors table's lock).
// Both writers get in while the policy is still half there, and the
// other owner's prefix gets its identity.
func TestWritersGetInDuringRemoval(t *testing.T) {
	var (
		mu       sync.Mutex
		a        *agent
		removing bool
		events   []string
	)
	other := netip.MustParsePrefix("192.0.2.1/32")
	// write runs f on another goroutine and waits for it, bounded.
	write := func(f func()) bool {
		done := make(chan struct{})
		go func() {
			defer close(done)
			f()
		}()
		select {
		case <-done:
			return true
		case <-time.After(30 * time.Second):
			return false
		}
	}
	selectors.SetTestHookCommitted(t, func(table string, chunk, chunks int) {
		mu.Lock()
		defer mu.Unlock()
		if !removing || chunk != 1 || chunks < 2 {
			return
		}
		switch table {
		case "prefixes":
			var err error
			ok := write(func() {
				_, err = a.prefixes.Update(ipcache.Upsert(other, "test/other", "fqdn:other.example.com"))
			})
			left := 0
			for range a.prefixTbl.List(a.db.ReadTxn(), tables.PrefixOwnerIndex.Query(selectors.OwnerPolicy)) {
				left++
			}
			events = append(events, fmt.Sprintf("prefixes written=%v err=%v, policy prefixes left=%d", ok, err, left))
		case "selectors":
			ok := write(func() {
				wtxn := a.db.WriteTxn(a.selectors, a.policies)
				wtxn.Abort()
			})
			events = append(events, fmt.Sprintf("selectors locked=%v, selectors left=%d", ok, a.selectors.NumObjects(a.db.ReadTxn())))
		}
	})
	mu.Lock()
	a = startAgent(t)
	mu.Unlock()
	p := cidrPolicy("big", policyCIDRs(bigCIDRs))
	a.addPolicy(t, p)
	a.waitUntil(t, testTimeout, "big policy applied", a.policyApplied(bigCIDRs))

	mu.Lock()
	removing = true
	mu.Unlock()
	a.deletePolicy(t, p)
	a.waitUntil(t, testTimeout, "big policy removed", func(txn statedb.ReadTxn) bool {
		e, _, found := a.ipcache.Get(txn, tables.IPCachePrefixIndex.Query(other))
		return found && e.Identity != 0 && a.selectors.NumObjects(txn) == 0 && a.ipcache.NumObjects(txn) == 2
	})

	mu.Lock()
	defer mu.Unlock()
	// The first chunk of each kind is all that was left out when they
	// wrote: the rest of the policy was still there.
	want := []string{
		fmt.Sprintf("prefixes written=true err=<nil>, policy prefixes left=%d", bigCIDRs-selectors.WriteChunk),
		fmt.Sprintf("selectors locked=true, selectors left=%d", bigCIDRs+1-(selectors.WriteChunk-1)),
	}
	if !slices.Equal(events, want) {
		t.Errorf("writers during the removal:\n%s\nwant:\n%s", strings.Join(events, "\n"), strings.Join(want, "\n"))
	}
}
