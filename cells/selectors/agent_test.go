package selectors_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/tables"
)

// agent is a started hive of the identity, ipcache and selectors cells on
// real pinned maps, with a fake clientset that policies are created in.
type agent struct {
	db         *statedb.DB
	fake       *k8sfake.Clients
	prefixes   ipcache.Prefixes
	policies   statedb.Table[*tables.Policy]
	selectors  statedb.Table[*tables.Selector]
	prefixTbl  statedb.Table[*tables.PrefixLabels]
	ipcache    statedb.Table[*tables.IPCacheEntry]
	identities statedb.Table[*tables.Identity]
	txns       *txnRecorder
}

func startAgent(tb testing.TB, args ...string) *agent {
	tb.Helper()
	testenv.RequireRoot(tb)
	a := &agent{fake: k8sfake.New(), txns: &txnRecorder{}} //nolint:staticcheck // CRDs need the untyped tracker
	h := hive.NewWithOptions(core.HiveOptions(),
		infra.Cell, k8sfake.NewCell(a.fake),
		cell.DecorateAll(func(m statedb.Metrics) statedb.Metrics {
			a.txns.Metrics = m
			return a.txns
		}),
		identity.Cell, ipcache.Cell, selectors.Cell,
		cell.Invoke(func(db *statedb.DB, p ipcache.Prefixes,
			pol statedb.Table[*tables.Policy], sel statedb.Table[*tables.Selector],
			pfx statedb.Table[*tables.PrefixLabels], ipc statedb.Table[*tables.IPCacheEntry],
			ids statedb.Table[*tables.Identity]) {
			a.db, a.prefixes, a.policies, a.selectors, a.prefixTbl, a.ipcache, a.identities = db, p, pol, sel, pfx, ipc, ids
		}))
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	flags := append([]string{
		"--api-addr=127.0.0.1:0", "--bpf-pin-dir=" + testenv.BPFPinDir(tb), "--state-dir=" + tb.TempDir(),
		"--config-dir=" + tb.TempDir(), "--node-name=test", "--node-ips=192.168.1.10",
	}, args...)
	if err := fs.Parse(flags); err != nil {
		tb.Fatal(err)
	}
	log := hivetest.Logger(tb)
	if err := h.Start(log, context.Background()); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { h.Stop(log, context.Background()) })
	return a
}

var cnpResource = selectors.GroupVersion.WithResource("ciliumnetworkpolicies")

// cidrPolicy returns a CiliumNetworkPolicy of pods app=web in default whose
// egress names the prefixes in toCIDR.
func cidrPolicy(name string, cidrs []netip.Prefix) *selectors.CiliumNetworkPolicy {
	to := make([]string, len(cidrs))
	for i, p := range cidrs {
		to[i] = p.String()
	}
	return &selectors.CiliumNetworkPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: "cilium.io/v2", Kind: "CiliumNetworkPolicy"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: &selectors.Rule{
			EndpointSelector: &selectors.EndpointSelector{MatchLabels: map[string]string{"app": "web"}},
			Egress:           []selectors.EgressRule{{ToCIDR: to}},
		},
	}
}

func (a *agent) addPolicy(tb testing.TB, p *selectors.CiliumNetworkPolicy) {
	tb.Helper()
	if err := a.fake.Create(cnpResource, p, p.Namespace); err != nil {
		tb.Fatal(err)
	}
}

func (a *agent) updatePolicy(tb testing.TB, p *selectors.CiliumNetworkPolicy) {
	tb.Helper()
	if err := a.fake.Update(cnpResource, p, p.Namespace); err != nil {
		tb.Fatal(err)
	}
}

func (a *agent) deletePolicy(tb testing.TB, p *selectors.CiliumNetworkPolicy) {
	tb.Helper()
	if err := a.fake.Delete(cnpResource, p.Namespace, p.Name); err != nil {
		tb.Fatal(err)
	}
}

// waitUntil waits until cond holds of a snapshot of the database, checking
// it again whenever one of the selectors, policies, ipcache or identities
// tables changes, then until the ipcache map holds what the prefixes
// table says. On timeout, explain (if given) says what is missing.
func (a *agent) waitUntil(tb testing.TB, timeout time.Duration, what string, cond func(statedb.ReadTxn) bool, explain ...func() string) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		rtxn := a.db.ReadTxn()
		ws := statedb.NewWatchSet()
		for _, w := range []<-chan struct{}{
			watchAll(rtxn, a.selectors), watchAll(rtxn, a.policies),
			watchAll(rtxn, a.ipcache), watchAll(rtxn, a.identities),
		} {
			ws.Add(w)
		}
		if cond(rtxn) {
			break
		}
		if _, err := ws.Wait(ctx, 0); err != nil {
			for _, e := range explain {
				tb.Log(e())
			}
			tb.Fatalf("%s: not within %s", what, timeout)
		}
	}
	if err := a.prefixes.Wait(ctx, a.prefixTbl.Revision(a.db.ReadTxn())); err != nil {
		tb.Fatalf("%s: %v", what, err)
	}
}

func watchAll[Obj any](txn statedb.ReadTxn, t statedb.Table[Obj]) <-chan struct{} {
	_, w := t.AllWatch(txn)
	return w
}

// policyApplied reports whether every CIDR selector of the big policy
// selects an identity, in a state with n CIDRs from policies.
func (a *agent) policyApplied(n int) func(statedb.ReadTxn) bool {
	return func(txn statedb.ReadTxn) bool {
		// n CIDR selectors and the subject's.
		if a.selectors.NumObjects(txn) != n+1 || a.policies.NumObjects(txn) != 1 {
			return false
		}
		for s := range a.selectors.All(txn) {
			if len(s.Identities) == 0 && strings.HasPrefix(s.Selector, "cidr:") {
				return false
			}
		}
		return true
	}
}

// policyShrunk reports whether the big policy is down to its first n
// CIDRs: their selectors select identities, and no other policy prefix,
// ipcache entry or local identity is left.
func (a *agent) policyShrunk(n int) func(statedb.ReadTxn) bool {
	applied := a.policyApplied(n)
	return func(txn statedb.ReadTxn) bool {
		return applied(txn) && a.ipcache.NumObjects(txn) == n+1 &&
			a.identities.NumObjects(txn) == len(identity.Reserved())+n
	}
}

// policyGone reports whether nothing of a policy is left: no policy,
// selector, policy prefix or local identity.
func (a *agent) policyGone(txn statedb.ReadTxn) bool {
	if a.selectors.NumObjects(txn) != 0 || a.policies.NumObjects(txn) != 0 || a.ipcache.NumObjects(txn) != 1 {
		return false
	}
	for range a.prefixTbl.List(txn, tables.PrefixOwnerIndex.Query(selectors.OwnerPolicy)) {
		return false
	}
	return a.identities.NumObjects(txn) == len(identity.Reserved())
}

// policyCIDRs returns n distinct IPv4 prefixes of lengths /16 to /32, some
// nested in others, as ipcache's benchmarks use.
func policyCIDRs(n int) []netip.Prefix {
	seen := map[netip.Prefix]struct{}{}
	out := make([]netip.Prefix, 0, n)
	for i := 0; len(out) < n; i++ {
		base := uint32(0x0B000000) + uint32(i)<<8 // 11.0.0.0 + i*256
		bits := 24 + i%9
		if i%100 == 0 {
			bits = 16 + (i/100)%8
		}
		addr := netip.AddrFrom4([4]byte{byte(base >> 24), byte(base >> 16), byte(base >> 8), byte(i % 7)})
		p := netip.PrefixFrom(addr, bits).Masked()
		if _, ok := seen[p]; ok {
			continue
		}
		seen[p] = struct{}{}
		out = append(out, p)
	}
	return out
}

// txnRecorder passes statedb's metrics on and records the longest write
// transaction: how long its tables were locked against other writers.
type txnRecorder struct {
	statedb.Metrics
	mu      sync.Mutex
	longest time.Duration
	tables  string
}

func (r *txnRecorder) WriteTxnDuration(handle string, tables []string, d time.Duration) {
	r.Metrics.WriteTxnDuration(handle, tables, d)
	r.mu.Lock()
	defer r.mu.Unlock()
	if d > r.longest {
		r.longest, r.tables = d, strings.Join(tables, "+")
	}
}

// take returns the longest write transaction since the last call and the
// tables it locked.
func (r *txnRecorder) take() (time.Duration, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	d, t := r.longest, r.tables
	r.longest, r.tables = 0, ""
	return d, t
}

// cpuTime is the CPU time the process has used, user and system.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(fmt.Sprintf("getrusage: %v", err))
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
