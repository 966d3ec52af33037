package policy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf/ringbuf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/apiary-net/apiary/bpf"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/tables"
)

// eventsPoll is how often the reader looks for events the programs did
// not wake it for: the latency of `apiary monitor` on a quiet node.
const eventsPoll = 250 * time.Millisecond

type eventsParams struct {
	cell.In

	Log        *slog.Logger
	Config     Config
	Jobs       job.Group
	Registry   prometheus.Registerer
	DB         *statedb.DB
	Identities statedb.Table[*tables.Identity]
	Endpoints  statedb.RWTable[*tables.EndpointPolicy]
	Policies   statedb.Table[*tables.Policy]
	Monitor    *Monitor
	Counter    *verdictCounter
	Attacher   *attacher
}

// registerEvents starts the reader of policy_events once the programs are
// attached: verdicts to the monitor, the verdict counters and the
// policies' counts.
func registerEvents(p eventsParams) error {
	verdicts := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "policy", Name: "verdicts_total",
		Help: "Connections and flows the policy programs decided, by direction, verdict (audited: would have been denied) and the policy whose entry decided (empty: default deny or no policy); from the verdict events, so events lost are not counted",
	}, []string{"direction", "verdict", "policy"})
	if err := p.Registry.Register(verdicts); err != nil {
		return err
	}
	a := p.Attacher
	r := &eventReader{
		log: p.Log, db: p.DB, identities: p.Identities, endpoints: p.Endpoints, policies: p.Policies,
		monitor: p.Monitor, counter: p.Counter, verdicts: verdicts, lost: a.lost,
	}
	p.Jobs.Add(job.OneShot("events", func(ctx context.Context, _ cell.Health) error {
		if p.Config.EnablePolicy == ModeNever {
			return nil
		}
		rd, err := a.eventsReader(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		return r.run(ctx, rd)
	}))
	return nil
}

// eventReader turns the datapath's verdict events into Verdicts for the
// monitor, the per-policy counts of the policies table and the
// apiary_policy_verdicts_total metric.
type eventReader struct {
	log        *slog.Logger
	db         *statedb.DB
	identities statedb.Table[*tables.Identity]
	endpoints  statedb.Table[*tables.EndpointPolicy]
	policies   statedb.Table[*tables.Policy]
	monitor    *Monitor
	counter    *verdictCounter
	verdicts   *prometheus.CounterVec
	// lost reads the datapath's count of events lost, which the monitor
	// reports to its subscribers (refreshed at most once a second while
	// events flow: events are lost only then).
	lost     func() uint64
	lostRead time.Time

	// Caches rebuilt from the tables: the endpoints' rows by ID when the
	// table has changed, the policies' names when an event names a cookie
	// the cache lacks.
	endpointRows map[uint32]*tables.EndpointPolicy
	endpointsRev statedb.Revision
	policyNames  map[uint32]string
	// ruleOwners are the policies of the ClusterNetworkPolicy rules'
	// labels, rebuilt with policyNames.
	ruleOwners map[string]string
	// monoToWall converts the events' CLOCK_MONOTONIC times.
	monoToWall time.Duration
}

// run reads events from rd until ctx ends.
func (r *eventReader) run(ctx context.Context, rd *ringbuf.Reader) error {
	r.endpointRows, r.policyNames = map[uint32]*tables.EndpointPolicy{}, map[uint32]string{}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return fmt.Errorf("read the monotonic clock: %w", err)
	}
	r.monoToWall = time.Duration(time.Now().UnixNano() - ts.Nano())
	stop := context.AfterFunc(ctx, func() { rd.Close() })
	defer stop()
	for {
		// The programs wake the reader only once the ring is an eighth
		// full (a wake-up per event would cost every connection a
		// syscall's worth of work): below that, it polls.
		rd.SetDeadline(time.Now().Add(eventsPoll))
		rec, err := rd.Read()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		}
		if errors.Is(err, ringbuf.ErrClosed) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read %s: %w", bpf.PolicyEventsMap, err)
		}
		ev, err := bpf.ParsePolicyEvent(rec.RawSample)
		if err != nil {
			r.log.Warn("Skipping a policy event", "error", err)
			continue
		}
		r.handle(ev)
	}
}

func (r *eventReader) handle(ev bpf.PolicyEvent) {
	if now := time.Now(); now.Sub(r.lostRead) >= time.Second {
		r.lostRead = now
		r.monitor.lost.Store(r.lost())
	}
	v := r.verdict(ev)
	r.monitor.Publish(v)
	r.verdicts.WithLabelValues(v.Direction, v.Verdict, v.Policy).Inc()
	if v.Policy == "" {
		return
	}
	var c tables.VerdictCounts
	switch v.Verdict {
	case VerdictAllowed:
		c.Allowed = 1
	case VerdictDenied:
		c.Denied = 1
	default:
		c.Audited = 1
	}
	r.counter.Add(r.countedPolicy(v.Policy), c)
}

// countedPolicy returns the policy whose row counts a verdict that names
// name: the policy of a ClusterNetworkPolicy rule's label, that of the
// rule or policy that decided after a Pass ("<pass> → <decider>").
func (r *eventReader) countedPolicy(name string) string {
	if i := strings.LastIndex(name, passArrow); i >= 0 {
		name = name[i+len(passArrow):]
	}
	if owner, ok := r.ruleOwners[name]; ok {
		return owner
	}
	return name
}

// verdict decodes ev.
func (r *eventReader) verdict(ev bpf.PolicyEvent) Verdict {
	row := r.endpointRow(ev.EndpointID)
	v := Verdict{
		Time:           time.Unix(0, int64(ev.TimeNs)+int64(r.monoToWall)).UTC(),
		Type:           VerdictTypePolicy,
		Endpoint:       "endpoint " + strconv.FormatUint(uint64(ev.EndpointID), 10),
		Direction:      tables.DirIngress,
		Proto:          protoName(ev.Protocol),
		RemoteIdentity: ev.RemoteIdentity,
		RemoteLabels:   []string{},
		Verdict:        VerdictAllowed,
		Reason:         ReasonPolicy,
		Layer:          LayerSocket,
	}
	if ev.Hook == bpf.PolicyHookFromPod || ev.Hook == bpf.PolicyHookToPod {
		v.Layer = LayerInterface
	}
	switch {
	case ev.EndpointID == 0:
		v.Endpoint = "unclassified"
	case row != nil:
		v.Endpoint = row.Name
	}
	local, remote := ev.Local().String(), ev.Remote().String()
	v.Src, v.Dst = remote, local
	if ev.Direction == bpf.PolicyEgress {
		v.Direction = tables.DirEgress
		v.Src, v.Dst = local, remote
	}
	switch ev.Verdict {
	case bpf.PolicyVerdictDenied:
		v.Verdict = VerdictDenied
	case bpf.PolicyVerdictAudited:
		v.Verdict = VerdictAudited
	}
	switch ev.Reason {
	case bpf.PolicyReasonDefaultDeny:
		v.Reason = ReasonDefaultDeny
		// A default deny after an Admin tier Pass names the Pass.
		v.Policy = r.policyName(ev.Cookie)
		// The datapath cannot tell a default deny that an invalid policy
		// keeps from another; the endpoint's row can.
		if row != nil {
			failClosed := row.FailClosedIngress
			if v.Direction == tables.DirEgress {
				failClosed = row.FailClosedEgress
			}
			if len(failClosed) > 0 {
				v.Reason, v.Policy = ReasonFailClosed, failClosed[0]
			}
		}
	case bpf.PolicyReasonNoPolicy:
		v.Reason = ReasonNoPolicy
	case bpf.PolicyReasonUnclassified:
		v.Reason = ReasonUnclassified
	case bpf.PolicyReasonSpoofed:
		v.Reason = ReasonSpoofed
	case bpf.PolicyReasonDNSProxy:
		v.Reason = ReasonDNSProxy
	case bpf.PolicyReasonDNSBypass:
		v.Reason = ReasonDNSBypass
	case bpf.PolicyReasonUnparsable:
		v.Reason = ReasonUnparsable
	case bpf.PolicyReasonNotRouter:
		v.Reason = ReasonNotRouter
	default:
		v.Policy = r.policyName(ev.Cookie)
	}
	if id, _, found := r.identities.Get(r.db.ReadTxn(), tables.IdentityIDIndex.Query(ev.RemoteIdentity)); found {
		v.RemoteLabels = id.Labels
	}
	return v
}

// endpointRow returns the endpoint-policy row of the endpoint ID, nil for
// one the agent no longer knows.
func (r *eventReader) endpointRow(id uint32) *tables.EndpointPolicy {
	rtxn := r.db.ReadTxn()
	if rev := r.endpoints.Revision(rtxn); rev != r.endpointsRev {
		r.endpointsRev = rev
		clear(r.endpointRows)
		for ep := range r.endpoints.All(rtxn) {
			if ep.ID != 0 {
				r.endpointRows[ep.ID] = ep
			}
		}
	}
	return r.endpointRows[id]
}

func (r *eventReader) policyName(cookie uint32) string {
	if cookie == 0 {
		return ""
	}
	if name, ok := r.policyNames[cookie]; ok {
		return name
	}
	clear(r.policyNames)
	if r.ruleOwners == nil {
		r.ruleOwners = map[string]string{}
	}
	clear(r.ruleOwners)
	r.policyNames[policyCookie(LocalhostEntryPolicy)] = LocalhostEntryPolicy
	// The entries of ClusterNetworkPolicy rules name the rule, and those
	// decided after an Admin tier Pass name the Pass and what decided:
	// "<pass rule> → <policy or Baseline rule>" (see decideTiered).
	var names, passes []string
	for p := range r.policies.All(r.db.ReadTxn()) {
		names = append(names, p.Name)
		for _, s := range p.Specs {
			for _, rule := range s.Rules {
				if rule.Label == "" {
					continue
				}
				names = append(names, rule.Label)
				r.ruleOwners[rule.Label] = p.Name
				if rule.Pass && rule.Tier == tables.TierAdmin {
					passes = append(passes, rule.Label)
				}
			}
		}
	}
	for _, n := range names {
		r.policyNames[policyCookie(n)] = n
	}
	if _, ok := r.policyNames[cookie]; !ok {
		for _, p := range passes {
			for _, n := range names {
				if label := p + passArrow + n; policyCookie(label) == cookie {
					r.policyNames[cookie] = label
				}
			}
		}
	}
	return r.policyNames[cookie]
}

// protoName names the protocols policy knows, and ICMP.
func protoName(p uint8) string {
	if p == unix.IPPROTO_ICMP {
		return "ICMP"
	}
	return tables.Proto(p).String()
}
