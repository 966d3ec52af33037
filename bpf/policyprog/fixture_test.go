package policyprog

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/internal/testenv"
	"github.com/apiary-net/apiary/reconcilers"
	"github.com/apiary-net/apiary/tables"
)

// testEndpoint is the endpoint ID of the tests' pod cgroup.
const testEndpoint = 7

// datapath is the programs attached to a cgroup of the test's own, with
// fresh maps, and a pod cgroup below it:
//
//	root/           the programs are attached here
//	root/pod/       the endpoint, once registered
//	root/pod/app/   where the pod's processes run (a container)
//	root/other/     a cgroup in no endpoint
type datapath struct {
	t                     testing.TB
	maps                  Maps
	progs                 map[string]*ebpf.Program
	root, pod, app, other string
	// gen is what putEndpoint last wrote to policy_endpoints_gen.
	gen uint64
	// events reads policy_events, once a test asks for one.
	events *ringbuf.Reader
	// eventsRead counts the events a benchmark's reader read.
	eventsRead atomic.Uint64
	// start is when the datapath was made (CLOCK_MONOTONIC): no event is
	// older.
	start uint64
}

func newDatapath(t testing.TB) *datapath {
	t.Helper()
	return newDatapathEvents(t, bpf.DefaultPolicyEventsSize)
}

// newTestMap creates an unpinned map of spec, closed when the test ends.
func newTestMap(t testing.TB, spec *ebpf.MapSpec) *ebpf.Map {
	t.Helper()
	spec = spec.Copy()
	spec.Pinning = ebpf.PinNone
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatalf("create map %s: %s", spec.Name, err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// newDatapathEvents is newDatapath with a policy_events of eventsSize
// bytes.
func newDatapathEvents(t testing.TB, eventsSize uint32) *datapath {
	t.Helper()
	return newDatapathBudget(t, eventsSize, EventBudget{})
}

// newDatapathBudget is newDatapathEvents with the endpoints' event budget
// (its map made here).
func newDatapathBudget(t testing.TB, eventsSize uint32, budget EventBudget) *datapath {
	t.Helper()
	testenv.RequireRoot(t)
	budget.Map = newTestMap(t, bpf.PolicyEventBudgetMapSpec(64))
	newMap := func(spec *ebpf.MapSpec) *ebpf.Map { return newTestMap(t, spec) }
	d := &datapath{t: t, maps: Maps{
		Policy:    newMap(bpf.PolicyMapSpec(1024)),
		Endpoints: newMap(bpf.PolicyEndpointsMapSpec(64)),
		// With it, the programs cache each cgroup's walk, as in the
		// agent; putEndpoint moves it as the agent does.
		EndpointsGen: newMap(bpf.PolicyEndpointsGenMapSpec()),
		Sock:         newMap(sockSpec(t)),
		Stats:        newMap(bpf.PolicyStatsMapSpec()),
		IPCache:      newMap(bpf.IPCacheMapSpec(1024)),
		Prefixes:     newMap(bpf.PolicyPrefixesMapSpec(1024)),
		Events:       newMap(bpf.PolicyEventsMapSpec(eventsSize)),
		Budget:       budget,
		DNSSock:      newMap(dnsSockSpec(t)),
		DNSOrigin:    newMap(bpf.DNSOriginMapSpec()),
		DNSConfig:    newMap(bpf.DNSConfigMapSpec()),

		DNSOriginLost: newMap(bpf.DNSOriginLostMapSpec()),
	}, start: monotonicNow(t), gen: 1}
	// The agent's counter starts at 1: 0 turns the cache off.
	if err := d.maps.EndpointsGen.Put(uint32(0), d.gen); err != nil {
		t.Fatal(err)
	}
	progs, err := Load(d.maps)
	if err != nil {
		t.Fatal(err)
	}
	d.progs = progs
	t.Cleanup(func() {
		for _, p := range progs {
			p.Close()
		}
	})
	d.root = testenv.Cgroup(t)
	d.pod = mkCgroup(t, d.root, "pod")
	d.app = mkCgroup(t, d.pod, "app")
	d.other = mkCgroup(t, d.root, "other")
	d.attach()
	return d
}

// attach attaches every hook, in order, to the root cgroup, until the test
// ends.
func (d *datapath) attach() {
	for _, h := range Hooks {
		lk, err := link.AttachCgroup(link.CgroupOptions{Path: d.root, Attach: h.Attach, Program: d.progs[h.Program]})
		if err != nil {
			d.t.Fatalf("attach %s: %s", h.Name, err)
		}
		d.t.Cleanup(func() { lk.Close() })
	}
}

// mkCgroup creates the cgroup dir/name and removes it when the test ends
// (before dir, since cleanups run last first).
func mkCgroup(t testing.TB, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.Mkdir(p, 0o755); err != nil {
		t.Fatalf("create cgroup: %s", err)
	}
	t.Cleanup(func() {
		// A child that has just exited may still be counted in it.
		deadline := time.Now().Add(2 * time.Second)
		for {
			err := os.Remove(p)
			if err == nil || errors.Is(err, os.ErrNotExist) {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("remove cgroup %s: %s", p, err)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	return p
}

// cgroupID returns the ID of a cgroup v2 directory: its inode number.
func cgroupID(t testing.TB, dir string) uint64 {
	t.Helper()
	st, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	return st.Sys().(*syscall.Stat_t).Ino
}

// endpoint makes the pod cgroup the test endpoint, with flags
// (bpf.PolicyEnforce*, bpf.PolicyAudit*, bpf.PolicyPodTree), written as the
// agent writes the endpoint-policy row that has them.
func (d *datapath) endpoint(flags uint32) {
	d.t.Helper()
	row := &tables.EndpointPolicy{ID: testEndpoint, Ingress: tables.EnforceOff, Egress: tables.EnforceOff,
		Audit: flags&bpf.PolicyAudit != 0, AuditDefaultIngress: flags&bpf.PolicyAuditDefaultIngress != 0,
		AuditDefaultEgress: flags&bpf.PolicyAuditDefaultEgress != 0, PodTree: flags&bpf.PolicyPodTree != 0}
	if flags&bpf.PolicyEnforceIngress != 0 {
		row.Ingress = tables.EnforceDefaultDeny
	}
	if flags&bpf.PolicyEnforceEgress != 0 {
		row.Egress = tables.EnforceDefaultDeny
	}
	if flags&bpf.PolicyDNS != 0 {
		row.DNS = []tables.DNSRule{{Pattern: "*"}}
	}
	v := reconcilers.EndpointValue(row)
	if v.Flags != flags {
		d.t.Fatalf("no endpoint-policy row makes the flags %#x (the nearest makes %#x)", flags, v.Flags)
	}
	if flags&bpf.PolicyDNS != 0 {
		d.origins(testEndpoint)
	}
	if err := d.putEndpoint(cgroupID(d.t, d.pod), v); err != nil {
		d.t.Fatal(err)
	}
}

// putEndpoint writes cgroup cg's policy_endpoints entry and then moves
// the counter of policy_endpoints_gen, as the agent does.
func (d *datapath) putEndpoint(cg uint64, v bpf.PolicyEndpointValue) error {
	if err := d.maps.Endpoints.Put(cg, v); err != nil {
		return err
	}
	d.gen++
	return d.maps.EndpointsGen.Put(uint32(0), d.gen)
}

// origins gives endpoint ID id its map in dns_origin, as the agent does
// for an endpoint with DNS rules, and returns it.
func (d *datapath) origins(id uint32) *ebpf.Map {
	d.t.Helper()
	var m *ebpf.Map
	if err := d.maps.DNSOrigin.Lookup(id, &m); err == nil {
		d.t.Cleanup(func() { m.Close() })
		return m
	}
	m = newTestMap(d.t, bpf.DNSOriginInnerSpec())
	if err := d.maps.DNSOrigin.Put(id, m); err != nil {
		d.t.Fatal(err)
	}
	return m
}

// identity gives addr the identity id in the ipcache.
func (d *datapath) identity(addr string, id uint32) {
	d.t.Helper()
	a := netip.MustParseAddr(addr)
	k := bpf.NewIPCacheKey(netip.PrefixFrom(a, a.BitLen()))
	if err := d.maps.IPCache.Put(k, bpf.IPCacheValue{Identity: id}); err != nil {
		d.t.Fatal(err)
	}
}

// rule is a policy entry of the test endpoint.
type rule struct {
	identity uint32
	dir      uint8 // bpf.PolicyIngress, bpf.PolicyEgress
	proto    uint8 // 0: any
	port     uint16
	portBits int
	deny     bool
	audit    bool   // with deny: only audits
	cookie   uint32 // 1 when 0
	final    bool   // decides alone (bpf.PolicyFlagFinal)
	pass     bool   // decides nothing (bpf.PolicyFlagPass)
	endpoint uint32 // the entry's endpoint (or policy set) ID; testEndpoint when 0
}

func (d *datapath) rules(rules ...rule) {
	d.t.Helper()
	for _, r := range rules {
		if r.audit && !r.deny {
			d.t.Fatalf("rule %+v: only a deny entry audits", r)
		}
		dir := tables.DirIngress
		if r.dir == bpf.PolicyEgress {
			dir = tables.DirEgress
		}
		// The key and value the agent writes for the table entry.
		k, v := reconcilers.PolicyKeyOf(&tables.PolicyEntry{
			EndpointID: cmp.Or(r.endpoint, testEndpoint), Identity: r.identity, Direction: dir,
			Protocol: r.proto, Port: r.port, PortBits: uint8(r.portBits),
			Deny: r.deny, Audit: r.audit, Cookie: max(r.cookie, 1), Final: r.final, Pass: r.pass,
		})
		if err := d.maps.Policy.Put(k, v); err != nil {
			d.t.Fatalf("put %s: %s", k, err)
		}
	}
}

// stats returns policy_stats summed over the CPUs.
func (d *datapath) stats() (s [bpf.PolicyStatsEntries]uint64) {
	d.t.Helper()
	for i := range s {
		var perCPU []uint64
		if err := d.maps.Stats.Lookup(uint32(i), &perCPU); err != nil {
			d.t.Fatal(err)
		}
		for _, n := range perCPU {
			s[i] += n
		}
	}
	return s
}

// lost returns how many events found policy_events full.
func (d *datapath) lost() uint64 {
	d.t.Helper()
	return d.stats()[bpf.PolicyStatsLost]
}

// stat returns one count of stats.
func stat(s [bpf.PolicyStatsEntries]uint64, dir uint8, verdict int) uint64 {
	return s[int(dir)*bpf.PolicyVerdicts+verdict]
}

// sockSpec is the spec of policy_sk, from the object.
// dnsSockSpec returns the spec of dns_sk, from the object.
func dnsSockSpec(t testing.TB) *ebpf.MapSpec {
	t.Helper()
	spec, err := Spec()
	if err != nil {
		t.Fatal(err)
	}
	ms, err := bpf.DNSSockMapSpec(spec)
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

func sockSpec(t testing.TB) *ebpf.MapSpec {
	t.Helper()
	spec, err := Spec()
	if err != nil {
		t.Fatal(err)
	}
	ms, err := bpf.PolicySockMapSpec(spec)
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

// servers answer pings (see serve) on each "proto addr:port" until the
// test ends; they run in the test process, in no endpoint.
func servers(t testing.TB, specs ...[2]string) {
	t.Helper()
	for _, s := range specs {
		c, err := startServer(s[0], s[1])
		if err != nil {
			t.Fatalf("serve %s %s: %s", s[0], s[1], err)
		}
		t.Cleanup(func() { c.Close() })
	}
}

// reader returns the reader of policy_events, made at the first call.
func (d *datapath) reader() *ringbuf.Reader {
	d.t.Helper()
	if d.events == nil {
		r, err := ringbuf.NewReader(d.maps.Events)
		if err != nil {
			d.t.Fatalf("read %s: %s", bpf.PolicyEventsMap, err)
		}
		d.t.Cleanup(func() { r.Close() })
		d.events = r
	}
	return d.events
}

// eventWait bounds how long nextEvent waits for an event. The programs
// report a decision before the syscall or the packet that caused it goes
// on, so an event a test expects is there at once; the wait only bounds a
// failure.
const eventWait = 2 * time.Second

// eventPoll is how often a reader looks at policy_events: the programs
// wake it only once an eighth of the ring waits, so it must poll, as the
// agent does.
const eventPoll = 10 * time.Millisecond

// nextEvent returns the next event of policy_events, failing the test
// when none comes. Its time is checked, then cleared, so that tests can
// compare whole events.
func (d *datapath) nextEvent() bpf.PolicyEvent {
	d.t.Helper()
	r := d.reader()
	var rec ringbuf.Record
	for deadline := time.Now().Add(eventWait); ; {
		r.SetDeadline(time.Now().Add(eventPoll))
		err := r.ReadInto(&rec)
		if err == nil {
			break
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) || time.Now().After(deadline) {
			d.t.Fatalf("no event in %s: %s", bpf.PolicyEventsMap, err)
		}
	}
	e, err := bpf.ParsePolicyEvent(rec.RawSample)
	if err != nil {
		d.t.Fatal(err)
	}
	if now := monotonicNow(d.t); e.TimeNs < d.start || e.TimeNs > now {
		d.t.Errorf("event at %d ns, not between the start of the test (%d) and now (%d)", e.TimeNs, d.start, now)
	}
	e.TimeNs = 0
	return e
}

// expectEvents reads the next events and compares them with want, in
// order.
func (d *datapath) expectEvents(what string, want ...bpf.PolicyEvent) {
	d.t.Helper()
	for i, w := range want {
		if got := d.nextEvent(); got != w {
			d.t.Errorf("%s: event %d:\n got  %s\n want %s", what, i+1, fmtEvent(got), fmtEvent(w))
		}
	}
}

// noEvents checks that nothing is left to read in policy_events.
func (d *datapath) noEvents(what string) {
	d.t.Helper()
	if n := d.reader().AvailableBytes(); n != 0 {
		d.t.Errorf("%s: %d bytes of events left, want none; next: %s", what, n, fmtEvent(d.nextEvent()))
	}
}

// event is an event the test expects: local and remote are "addr:port",
// "addr" (port 0) or "" (0.0.0.0:0); the direction follows from the hook.
type event struct {
	hook          uint8 // bpf.PolicyHook*
	local, remote string
	proto         uint8
	identity      uint32
	verdict       uint8 // bpf.PolicyVerdict*
	reason        uint8 // bpf.PolicyReason*
	cookie        uint32
}

func (w event) policyEvent() bpf.PolicyEvent {
	e := bpf.PolicyEvent{
		EndpointID:     testEndpoint,
		RemoteIdentity: w.identity,
		Cookie:         w.cookie,
		Protocol:       w.proto,
		Direction:      bpf.PolicyEgress,
		Verdict:        w.verdict,
		Reason:         w.reason,
		Hook:           w.hook,
		Family:         4,
	}
	if w.hook == bpf.PolicyHookIngress {
		e.Direction = bpf.PolicyIngress
	}
	e.LocalAddr, e.LocalPort = addrPort(w.local, w.remote)
	e.RemoteAddr, e.RemotePort = addrPort(w.remote, w.local)
	if r, _ := netip.ParseAddrPort(w.remote); r.Addr().Is6() && !r.Addr().Is4In6() {
		e.Family = 6
	} else if a, err := netip.ParseAddr(w.remote); err == nil && a.Is6() {
		e.Family = 6
	}
	return e
}

// addrPort returns the address and port of s as an event holds them: IPv6
// as is, IPv4 mapped. An empty s is the unspecified address of the other
// side's family.
func addrPort(s, other string) ([16]byte, bpf.Be16) {
	if s == "" {
		if a, err := netip.ParseAddr(other); err == nil && a.Is6() {
			return [16]byte{}, bpf.Be16{}
		}
		if ap, err := netip.ParseAddrPort(other); err == nil && ap.Addr().Is6() {
			return [16]byte{}, bpf.Be16{}
		}
		return netip.IPv4Unspecified().As16(), bpf.Be16{}
	}
	if a, err := netip.ParseAddr(s); err == nil {
		return a.As16(), bpf.Be16{}
	}
	ap := netip.MustParseAddrPort(s)
	return ap.Addr().As16(), bpf.NewBe16(ap.Port())
}

// fmtEvent formats an event for failures.
func fmtEvent(e bpf.PolicyEvent) string {
	return fmt.Sprintf("hook %d dir %d ep %d %s -> %s proto %d identity %d verdict %d reason %d cookie %d family %d pad %v",
		e.Hook, e.Direction, e.EndpointID, e.Local(), e.Remote(),
		e.Protocol, e.RemoteIdentity, e.Verdict, e.Reason, e.Cookie, e.Family, e.Pad)
}

// monotonicNow is bpf_ktime_get_ns() of now.
func monotonicNow(t testing.TB) uint64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return uint64(ts.Nano())
}
