// Package fqdn implements DNS-based policy: a DNS proxy that answers the
// queries policy enforcement intercepts from pods with DNS rules
// (Interceptor), refusing names the rules do not allow and forwarding the
// others to the resolver the pod asked, and for every answer whose name
// matches FQDN selectors (toFQDNs matchName/matchPattern) labels the
// answer's addresses with those selectors' labels ("fqdn:<pattern>", owner
// "fqdn/<name>" in the prefixes table) before the answer reaches the
// client — for every pod when a resolver the node trusts answered, for the
// pod that asked alone ("fqdn:<pattern>@<ns>/<pod>") otherwise, and at most
// --tofqdns-max-ips-per-pod addresses per pod. IPs with the same selectors
// share one identity. The cell owns the
// fqdn-names table, the DNS cache, which it expires, garbage-collects and
// checkpoints to --state-dir. See docs/fqdn.md.
package fqdn

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/miekg/dns"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/cells/fqdn/pattern"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/internal/tablefile"
	"github.com/apiary-net/apiary/tables"
)

// Cell provides the DNS proxy (*Proxy), the read-only fqdn-names table and
// the fqdn/query script command.
var Cell = cell.Module(
	"fqdn",
	"DNS proxy and the addresses of the names FQDN selectors match",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(
		tables.NewFQDNNamesTable,
		newFQDNMetrics,
		newNameManager,
	),
	cell.Provide(
		statedb.RWTable[*tables.FQDNName].ToTable,
		newProxy,
		scriptCommands,
	),
	// The proxy is requested here, not only by the script commands that use
	// it: a constructor nothing in the agent asks for is never run.
	cell.Invoke(func(*Proxy) {}),
	cell.Invoke(registerJobs),
)

// Config is the fqdn cell's configuration.
type Config struct {
	// DNSProxyAddr is where the DNS proxy listens (UDP and TCP); empty
	// disables it.
	DNSProxyAddr string
	// DNSUpstream is the resolver the proxy forwards to, host:port;
	// empty: the first nameserver of /etc/resolv.conf.
	DNSUpstream string
	// DNSUpstreamTimeout bounds one exchange with the upstream.
	DNSUpstreamTimeout time.Duration
	// ToFQDNsProxyResponseMaxDelay bounds how long an answer is held
	// until the ipcache map has its addresses.
	ToFQDNsProxyResponseMaxDelay time.Duration
	// ToFQDNsMinTTL raises shorter TTLs, in seconds.
	ToFQDNsMinTTL int
	// ToFQDNsMaxIPsPerName caps the addresses kept per name.
	ToFQDNsMaxIPsPerName int
	// ToFQDNsMaxIPsPerPod caps the (name, address) pairs one endpoint's
	// answers may bring into the DNS cache, and so the ipcache entries
	// it can make; 0 is no limit.
	ToFQDNsMaxIPsPerPod int
	// ToFQDNsGCInterval is how often expired addresses are removed.
	ToFQDNsGCInterval time.Duration
	// ToFQDNsMaxIdentities caps the identities carrying fqdn: labels that
	// new selector combinations may create; 0 is no limit.
	ToFQDNsMaxIdentities int
	// DNSIntercept sends the DNS of endpoints with a DNS rule to the
	// proxy; off (or without a proxy), their DNS is denied.
	DNSIntercept bool
	// DNSRejectResponse is how a query no DNS rule allows is answered:
	// RejectRefused or RejectNXDomain.
	DNSRejectResponse string
	// DNSProxyUDPLoops is how many goroutines serve UDP queries, each on a
	// socket of its own sharing the port.
	DNSProxyUDPLoops int
	// DNSProxyMaxInflightPerSource bounds the UDP queries of one client
	// address waiting for resolvers at once; past it that client alone
	// gets SERVFAIL.
	DNSProxyMaxInflightPerSource int
	// DNSProxyMaxTCPPerSource bounds the TCP connections one client
	// address holds open to the proxy (each carries one query at a time);
	// past it new ones are closed.
	DNSProxyMaxTCPPerSource int
	// DNSTrustedResolvers are resolvers (IPs, prefixes, IP:port) whose
	// answers label addresses for every pod's toFQDNs, besides
	// DNSUpstream and DNSClusterService's.
	DNSTrustedResolvers []string
	// DNSClusterService is the cluster DNS Service ("namespace/name"),
	// whose frontends and backends are trusted resolvers; empty: none.
	DNSClusterService string
}

var defaultConfig = Config{
	DNSUpstreamTimeout:           2 * time.Second,
	ToFQDNsProxyResponseMaxDelay: 100 * time.Millisecond,
	ToFQDNsMaxIPsPerName:         1000,
	ToFQDNsMaxIPsPerPod:          4000,
	ToFQDNsGCInterval:            time.Minute,
	DNSIntercept:                 true,
	DNSProxyUDPLoops:             1,
	DNSProxyMaxInflightPerSource: 512,
	DNSProxyMaxTCPPerSource:      64,
	DNSClusterService:            "kube-system/kube-dns",
	DNSRejectResponse:            RejectRefused,
}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.String("dns-proxy-addr", def.DNSProxyAddr,
		"Address (host:port, UDP and TCP) of the DNS proxy workloads use as their resolver; empty disables the proxy")
	fs.String("dns-upstream", def.DNSUpstream,
		"Resolver (host:port) the DNS proxy forwards to; default: the first nameserver of /etc/resolv.conf")
	fs.Duration("dns-upstream-timeout", def.DNSUpstreamTimeout,
		"How long the DNS proxy waits for the upstream before answering SERVFAIL")
	fs.Duration("tofqdns-proxy-response-max-delay", def.ToFQDNsProxyResponseMaxDelay,
		"How long a DNS answer with new addresses is held until the ipcache map has them")
	fs.Int("tofqdns-min-ttl", def.ToFQDNsMinTTL,
		"Shortest time (seconds) an address of a DNS answer is kept; shorter TTLs are raised to it")
	fs.Int("tofqdns-max-ips-per-name", def.ToFQDNsMaxIPsPerName,
		"Most addresses kept per DNS name; the least recently seen are evicted first")
	fs.Int("tofqdns-max-ips-per-pod", def.ToFQDNsMaxIPsPerPod,
		"Most (name, address) pairs the DNS answers of one pod may bring into the DNS cache (and so the ipcache); past it their new addresses are not labelled (0: no limit)")
	fs.Duration("tofqdns-gc-interval", def.ToFQDNsGCInterval,
		"How often expired DNS addresses and their labels are removed")
	fs.Int("tofqdns-max-identities", def.ToFQDNsMaxIdentities,
		"Most identities carrying fqdn: labels; past it new selector combinations are not labelled (0: no limit)")
	fs.Bool("dns-intercept", def.DNSIntercept,
		"Send the DNS (port 53) of endpoints whose egress policy has a DNS rule to the DNS proxy, which enforces the rule; off, or without --dns-proxy-addr, their DNS is denied")
	fs.String("dns-reject-response", def.DNSRejectResponse,
		"Answer to a query no DNS rule of the endpoint allows: refused or nxdomain")
	fs.Int("dns-proxy-udp-loops", def.DNSProxyUDPLoops,
		"Goroutines serving the DNS proxy's UDP queries, each on its own socket of the same port (the kernel spreads clients over them); one serves several thousand queries per second per core")
	fs.Int("dns-proxy-max-inflight-per-source", def.DNSProxyMaxInflightPerSource,
		"Most UDP queries of one client address (a pod, the node) waiting for resolvers at once, per UDP loop; past it that client gets SERVFAIL")
	fs.StringSlice("dns-trusted-resolvers", def.DNSTrustedResolvers,
		"Resolvers (IPs, prefixes, IP:port) whose DNS answers label addresses for every pod's toFQDNs, besides --dns-upstream and the backends of --dns-cluster-service; answers from other resolvers a pod asks are passed on unlabelled")
	fs.String("dns-cluster-service", def.DNSClusterService,
		"The cluster DNS Service (namespace/name), whose addresses and backends are trusted resolvers; empty: none")
	fs.Int("dns-proxy-max-tcp-per-source", def.DNSProxyMaxTCPPerSource,
		"Most TCP connections one client address (a pod, the node) holds open to the DNS proxy; past it new ones are closed")
}

func (c Config) validate() error {
	switch {
	case c.ToFQDNsProxyResponseMaxDelay <= 0:
		return fmt.Errorf("--tofqdns-proxy-response-max-delay=%s must be positive", c.ToFQDNsProxyResponseMaxDelay)
	case c.DNSUpstreamTimeout <= 0:
		return fmt.Errorf("--dns-upstream-timeout=%s must be positive", c.DNSUpstreamTimeout)
	case c.ToFQDNsMinTTL < 0:
		return fmt.Errorf("--tofqdns-min-ttl=%d is negative", c.ToFQDNsMinTTL)
	case c.ToFQDNsMaxIPsPerName < 1:
		return fmt.Errorf("--tofqdns-max-ips-per-name=%d must be at least 1", c.ToFQDNsMaxIPsPerName)
	case c.ToFQDNsMaxIPsPerPod < 0:
		return fmt.Errorf("--tofqdns-max-ips-per-pod=%d is negative", c.ToFQDNsMaxIPsPerPod)
	case c.ToFQDNsGCInterval <= 0:
		return fmt.Errorf("--tofqdns-gc-interval=%s must be positive", c.ToFQDNsGCInterval)
	case c.DNSProxyUDPLoops < 1 || c.DNSProxyUDPLoops > 64:
		return fmt.Errorf("--dns-proxy-udp-loops=%d must be between 1 and 64", c.DNSProxyUDPLoops)
	case c.DNSProxyMaxInflightPerSource < 1 || c.DNSProxyMaxInflightPerSource > maxInflight:
		return fmt.Errorf("--dns-proxy-max-inflight-per-source=%d must be between 1 and %d", c.DNSProxyMaxInflightPerSource, maxInflight)
	case c.DNSProxyMaxTCPPerSource < 1:
		return fmt.Errorf("--dns-proxy-max-tcp-per-source=%d must be at least 1", c.DNSProxyMaxTCPPerSource)
	case c.ToFQDNsMaxIdentities < 0:
		return fmt.Errorf("--tofqdns-max-identities=%d is negative", c.ToFQDNsMaxIdentities)
	case c.DNSRejectResponse != RejectRefused && c.DNSRejectResponse != RejectNXDomain:
		return fmt.Errorf("--dns-reject-response=%q: want %s or %s", c.DNSRejectResponse, RejectRefused, RejectNXDomain)
	}
	// Checked here too, not only when the proxy starts: a typo must stop
	// the agent whether or not --dns-proxy-addr is set yet.
	if _, _, err := parseTrusted(c.DNSTrustedResolvers); err != nil {
		return err
	}
	if c.DNSClusterService != "" {
		if _, err := tables.ParseServiceName(c.DNSClusterService); err != nil {
			return fmt.Errorf("--dns-cluster-service=%q: %w", c.DNSClusterService, err)
		}
	}
	return nil
}

// defaultUpstream returns the first nameserver of /etc/resolv.conf.
func defaultUpstream(resolvConf string) (string, error) {
	cc, err := dns.ClientConfigFromFile(resolvConf)
	if err != nil {
		return "", fmt.Errorf("read %s: %w", resolvConf, err)
	}
	if len(cc.Servers) == 0 {
		return "", fmt.Errorf("%s names no nameserver", resolvConf)
	}
	return net.JoinHostPort(cc.Servers[0], cc.Port), nil
}

type managerParams struct {
	cell.In

	Log        *slog.Logger
	DB         *statedb.DB
	Table      statedb.RWTable[*tables.FQDNName]
	Identities statedb.Table[*tables.Identity]
	Prefixes   ipcache.Prefixes
	Metrics    *fqdnMetrics
	Node       node.Config
	Config     Config
}

// newNameManager builds the DNS cache and restores the checkpoint into it
// and into the prefixes table, before the ipcache map may be pruned: FQDN
// addresses keep their labels, and so their identities, across a restart.
func newNameManager(p managerParams) (*nameManager, error) {
	if err := p.Config.validate(); err != nil {
		return nil, err
	}
	m := &nameManager{
		log: p.Log, db: p.DB, table: p.Table, identities: p.Identities,
		prefixes: p.Prefixes, metrics: p.Metrics,
		minTTL:        time.Duration(p.Config.ToFQDNsMinTTL) * time.Second,
		maxIPsPerName: p.Config.ToFQDNsMaxIPsPerName,
		maxIPsPerPod:  p.Config.ToFQDNsMaxIPsPerPod,
		maxIdentities: p.Config.ToFQDNsMaxIdentities,
		selectors:     map[string]*pattern.Pattern{},
	}
	done := p.Prefixes.RegisterInitializer("fqdn")
	defer done()
	path := filepath.Join(p.Node.StateDir, CheckpointFile)
	rows, err := readCheckpoint(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		p.Log.Info("No DNS cache checkpoint, starting afresh", "path", path)
		return m, nil
	case err != nil:
		p.Log.Warn("DNS cache checkpoint unusable, starting afresh", "error", err)
		return m, nil
	}
	// Until the policies have synced, the restored names' selectors
	// stand for the selectors.
	for _, row := range rows {
		for _, label := range row.Selectors {
			if sel, _, ok := tables.SplitEndpointFQDNLabel(label); ok {
				label = sel
			}
			if pat, err := parseSelectorLabel(label); err == nil {
				m.selectors[label] = pat
			}
		}
	}
	if err := m.restore(rows); err != nil {
		return nil, err
	}
	p.Log.Info("Restored the DNS cache", "names", len(rows), "path", path)
	return m, nil
}

// Gate holds a DNS answer until the datapath acts on its addresses as
// policy says: policy enforcement provides one when it is part of the
// agent. Wait returns once it does, or with ctx's error.
type Gate interface {
	Wait(ctx context.Context, ips []netip.Addr) error
}

type proxyParams struct {
	cell.In

	Gate        Gate        `optional:"true"`
	Interceptor Interceptor `optional:"true"`
	// Pods are this node's pods, whose queries the proxy serves (with
	// the node's own); without the table only the node is served.
	Pods statedb.Table[*tables.Endpoint] `optional:"true"`
	DB   *statedb.DB
	// The load balancer's tables, for the cluster DNS Service's
	// addresses.
	Frontends statedb.Table[*tables.Frontend] `optional:"true"`
	Backends  statedb.Table[*tables.Backend]  `optional:"true"`

	Log       *slog.Logger
	Lifecycle cell.Lifecycle
	Health    cell.Health
	Names     *nameManager
	Prefixes  ipcache.Prefixes
	Metrics   *fqdnMetrics
	Config    Config
}

func newProxy(p proxyParams) (*Proxy, error) {
	cfg := p.Config
	px := &Proxy{log: p.Log, names: p.Names, prefixes: p.Prefixes, gate: p.Gate, intercept: p.Interceptor, metrics: p.Metrics, cfg: cfg, now: time.Now}
	px.sources = &sources{nodeAddrs: interfaceAddrs, anyLoopback: true}
	if p.Pods != nil {
		px.sources.db, px.sources.pods = p.DB, p.Pods
	}
	health := p.Health.NewScope("proxy")
	px.health = health
	interception := p.Health.NewScope("interception")
	if cfg.DNSProxyAddr == "" {
		health.OK("Disabled: no --dns-proxy-addr")
		p.Lifecycle.Append(cell.Hook{OnStart: func(cell.HookContext) error {
			setInterception(p.Log, interception, p.Interceptor, nil, false)
			return nil
		}})
		return px, nil
	}
	if err := checkHostPort(cfg.DNSProxyAddr, true); err != nil {
		return nil, fmt.Errorf("--dns-proxy-addr=%q: %w", cfg.DNSProxyAddr, err)
	}
	if cfg.DNSUpstream == "" {
		up, err := defaultUpstream("/etc/resolv.conf")
		if err != nil {
			return nil, fmt.Errorf("--dns-upstream is empty and no default: %w", err)
		}
		px.cfg.DNSUpstream = up
	}
	if err := checkHostPort(px.cfg.DNSUpstream, false); err != nil {
		return nil, fmt.Errorf("--dns-upstream=%q: %w", px.cfg.DNSUpstream, err)
	}
	tr, err := newTrust(px.cfg, p)
	if err != nil {
		return nil, err
	}
	px.trust = tr
	p.Lifecycle.Append(cell.Hook{
		OnStart: func(cell.HookContext) error {
			if err := px.start(); err != nil {
				health.Degraded("DNS proxy not listening", err)
				return err
			}
			health.OK(fmt.Sprintf("Listening on %s (UDP and TCP), upstream %s", px.Addr(), px.cfg.DNSUpstream))
			setInterception(p.Log, interception, p.Interceptor, px.listenAddr(), cfg.DNSIntercept)
			return nil
		},
		OnStop: func(ctx cell.HookContext) error { return px.stop(ctx) },
	})
	return px, nil
}

// setInterception tells the datapath where intercepted DNS goes (the
// proxy listening on listen, nil when there is none) and whether to
// intercept, and says so in the health scope. Without interception the
// DNS of endpoints with a DNS rule is denied: the scope says that too.
func setInterception(log *slog.Logger, h cell.Health, ic Interceptor, listen net.Addr, intercept bool) {
	if ic == nil {
		h.OK("Off: no policy enforcement, so no DNS rule applies")
		return
	}
	var v4, v6 netip.AddrPort
	if listen != nil {
		v4, v6 = proxyTargets(listen)
	}
	on := intercept && (v4.IsValid() || v6.IsValid())
	if err := ic.SetProxy(v4, v6, on); err != nil {
		log.Error("DNS interception could not be configured: the DNS of endpoints with DNS rules is denied", "error", err)
		h.Degraded("DNS interception could not be configured; the DNS of endpoints with DNS rules is denied", err)
		return
	}
	switch {
	case on:
		log.Info("Intercepting the DNS of endpoints with DNS rules", "ipv4", v4, "ipv6", v6)
		h.OK(fmt.Sprintf("Intercepting the DNS of endpoints with DNS rules to %s", joinValid(v4, v6)))
	case listen == nil:
		h.OK("Off (no --dns-proxy-addr): the DNS of endpoints with DNS rules is denied")
	default:
		h.OK("Off (--dns-intercept=false): the DNS of endpoints with DNS rules is denied")
	}
}

// joinValid lists the valid addresses of a and b.
func joinValid(a, b netip.AddrPort) string {
	var out []string
	for _, ap := range []netip.AddrPort{a, b} {
		if ap.IsValid() {
			out = append(out, ap.String())
		}
	}
	return strings.Join(out, " and ")
}

// checkHostPort checks that addr is an IP address and a port, as the
// listener (listen: the IP may be empty, the port 0) and the upstream dialer
// need. A host name is refused: the proxy must not need DNS to start.
func checkHostPort(addr string, listen bool) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("want IP:port: %w", err)
	}
	if host != "" || !listen {
		if _, err := netip.ParseAddr(host); err != nil {
			return fmt.Errorf("want IP:port, %q is not an IP address", host)
		}
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || (n == 0 && !listen) {
		return fmt.Errorf("want IP:port, %q is not a port", port)
	}
	return nil
}

type jobParams struct {
	cell.In

	Log           *slog.Logger
	DB            *statedb.DB
	Jobs          job.Group
	Names         *nameManager
	Table         statedb.Table[*tables.FQDNName]
	Selectors     statedb.Table[*tables.Selector]
	PrefixesTable statedb.Table[*tables.PrefixLabels]
	Allocator     *identity.Allocator
	Metrics       *fqdnMetrics
	Node          node.Config
	Config        Config
	// Pods are this node's endpoints: the untrusted answers of one that
	// is gone are dropped. Without the table, they expire.
	Pods statedb.Table[*tables.Endpoint] `optional:"true"`
}

func registerJobs(p jobParams) {
	if p.Pods != nil {
		p.Jobs.Add(job.OneShot("endpoints-gone", func(ctx context.Context, h cell.Health) error {
			return dropGoneEndpoints(ctx, h, p)
		}))
	}
	p.Jobs.Add(
		job.OneShot("selectors", func(ctx context.Context, h cell.Health) error {
			return watchSelectors(ctx, h, p)
		}),
		job.Timer("gc", func(ctx context.Context) error {
			n, err := p.Names.gc(time.Now())
			if err != nil {
				return err
			}
			if n > 0 {
				p.Metrics.gcRemoved.Add(float64(n))
				p.Log.Debug("Removed expired DNS addresses", "count", n)
			}
			return nil
		}, p.Config.ToFQDNsGCInterval),
		job.OneShot("checkpoint", func(ctx context.Context, h cell.Health) error {
			return checkpointLoop(ctx, h, p)
		}),
	)
}

// watchSelectors follows the FQDN selectors of the selectors table into
// the name manager, and pre-allocates the identity {fqdn:<pattern>, world}
// of each, so that the first answer for a selector usually costs only an
// ipcache map write. Until every source of prefixes has synced (and so the
// policies), the selectors of the restored names are kept too: a selector
// that has not come back yet does not unlabel anything.
func watchSelectors(ctx context.Context, h cell.Health, p jobParams) error {
	restored := p.Names.currentSelectors()
	var (
		current    map[string]*pattern.Pattern
		held       = map[string][]uint32{} // pre-allocated identities by selector label
		everSynced bool
	)
	worlds := []string{tables.LabelWorld}
	if p.Node.EnableIPv6 {
		worlds = []string{tables.LabelWorldIPv4, tables.LabelWorldIPv6}
	}
	for {
		rtxn := p.DB.ReadTxn()
		// Initialized hands back a closed channel once the table is
		// initialized: waiting on it then would spin. Wait only until then.
		var syncWatch <-chan struct{}
		synced := everSynced
		if !everSynced {
			synced, syncWatch = p.PrefixesTable.Initialized(rtxn)
			if synced {
				syncWatch = nil
			}
		}
		rows, watch := p.Selectors.AllWatch(rtxn)
		next := map[string]*pattern.Pattern{}
		for row := range rows {
			if !strings.HasPrefix(row.Selector, tables.SourceFQDN+":") {
				continue
			}
			if _, _, ok := tables.SplitEndpointFQDNLabel(row.Selector); ok {
				continue // one endpoint's, made from the labels this cell gave
			}
			pat, err := parseSelectorLabel(row.Selector)
			if err != nil {
				// The selectors cell validated it with the same parser.
				p.Log.Warn("Ignoring an FQDN selector", "selector", row.Selector, "error", err)
				continue
			}
			next[row.Selector] = pat
		}
		if err := preallocate(p, held, next, worlds); err != nil {
			h.Degraded("Pre-allocation of FQDN identities failed", err)
		}
		effective := next
		if !synced && !everSynced {
			effective = maps.Clone(next)
			maps.Copy(effective, restored)
		}
		everSynced = everSynced || synced
		if current == nil || !slices.Equal(slices.Sorted(maps.Keys(current)), slices.Sorted(maps.Keys(effective))) {
			if _, err := p.Names.setSelectors(effective); err != nil {
				return err
			}
			current = effective
		}
		h.OK(fmt.Sprintf("%d FQDN selectors", len(next)))
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		case <-syncWatch:
		}
	}
}

// preallocate acquires {label, world} for every selector label in next not
// yet held, and releases those of selectors gone.
func preallocate(p jobParams, held map[string][]uint32, next map[string]*pattern.Pattern, worlds []string) error {
	var added, removed []string
	for label := range next {
		if _, ok := held[label]; !ok {
			added = append(added, label)
		}
	}
	for label := range held {
		if _, ok := next[label]; !ok {
			removed = append(removed, label)
		}
	}
	if len(added) == 0 && len(removed) == 0 {
		return nil
	}
	// In order, so that numbers do not depend on map iteration.
	slices.Sort(added)
	slices.Sort(removed)
	wtxn := p.DB.WriteTxn(p.Allocator.Table())
	defer wtxn.Abort()
	var errs []error
	for _, label := range removed {
		for _, id := range held[label] {
			if err := p.Allocator.Release(wtxn, id); err != nil {
				errs = append(errs, err)
			}
		}
		delete(held, label)
	}
	for _, label := range added {
		var ids []uint32
		for _, w := range worlds {
			id, err := p.Allocator.Acquire(wtxn, tables.NewLabels(label, w), 0)
			if err != nil {
				errs = append(errs, fmt.Errorf("pre-allocate the identity of %s: %w", label, err))
				continue
			}
			ids = append(ids, id.ID)
		}
		held[label] = ids
	}
	wtxn.Commit()
	return errors.Join(errs...)
}

// goneInterval throttles dropGoneEndpoints: at most one pass over the
// DNS cache per interval, however often endpoints change.
const goneInterval = time.Second

// dropGoneEndpoints drops the rows of the untrusted answers of endpoints
// that are gone, and the labels their addresses had for them, once the
// endpoints table is initialized (so that a restored row of an endpoint
// not listed yet stays).
func dropGoneEndpoints(ctx context.Context, h cell.Health, p jobParams) error {
	for {
		rtxn := p.DB.ReadTxn()
		init, initWatch := p.Pods.Initialized(rtxn)
		_, watch := p.Pods.AllWatch(rtxn)
		if init {
			n, err := p.Names.dropEndpoints(func(name string) bool {
				_, _, found := p.Pods.Get(rtxn, tables.EndpointNameIndex.Query(name))
				return found
			})
			if err != nil {
				h.Degraded("Dropping the DNS answers of endpoints gone failed", err)
			} else {
				if n > 0 {
					p.Log.Debug("Dropped the untrusted DNS answers of endpoints gone", "rows", n)
				}
				h.OK("Following endpoints")
			}
		} else {
			h.OK("Waiting for the endpoints table")
			watch = initWatch
		}
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(goneInterval):
		}
	}
}

// checkpointInterval throttles checkpoint writes: at most one per interval,
// plus one when the agent stops.
const checkpointInterval = time.Second

func checkpointLoop(ctx context.Context, h cell.Health, p jobParams) error {
	return tablefile.Writer{
		What:     "DNS cache",
		Path:     filepath.Join(p.Node.StateDir, CheckpointFile),
		Interval: checkpointInterval,
		Watch: func() <-chan struct{} {
			_, watch := p.Table.AllWatch(p.DB.ReadTxn())
			return watch
		},
		Encode: func() ([]byte, error) {
			var rows []*tables.FQDNName
			for row := range p.Table.All(p.DB.ReadTxn()) {
				rows = append(rows, row)
			}
			return encodeCheckpoint(rows)
		},
	}.Run(ctx, h, p.Log)
}

// newTrust builds the proxy's trusted resolvers from cfg (DNSUpstream
// already set) and the load balancer's tables.
func newTrust(cfg Config, p proxyParams) (*trust, error) {
	prefixes, addrPorts, err := parseTrusted(cfg.DNSTrustedResolvers)
	if err != nil {
		return nil, err
	}
	t := &trust{upstream: cfg.DNSUpstream, prefixes: prefixes, addrPorts: addrPorts}
	if cfg.DNSClusterService != "" {
		if t.service, err = tables.ParseServiceName(cfg.DNSClusterService); err != nil {
			return nil, fmt.Errorf("--dns-cluster-service=%q: %w", cfg.DNSClusterService, err)
		}
		t.db, t.frontends, t.backends = p.DB, p.Frontends, p.Backends
	}
	return t, nil
}
