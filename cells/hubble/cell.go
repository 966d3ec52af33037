// Package hubble serves Hubble's observer gRPC API (observer.Observer of
// the reference's api/v1/observer) from the agent's verdict stream, so
// that the `hubble` CLI and whatever else speaks that API read apiary's
// flows. See docs/hubble.md.
package hubble

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"time"

	observerpb "github.com/cilium/cilium/api/v1/observer"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/apiary-net/apiary/cells/cgroups"
	"github.com/apiary-net/apiary/cells/node"
	"github.com/apiary-net/apiary/cells/policy"
	"github.com/apiary-net/apiary/cells/socketlb"
	"github.com/apiary-net/apiary/tables"
)

// Cell serves Hubble's observer API on --hubble-socket-path (and
// --hubble-listen-address) when --enable-hubble is set.
var Cell = cell.Module(
	"hubble",
	"Hubble observer API over the agents flows",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(newMetrics),
	cell.Invoke(register),
)

// Flag names, as the reference names them.
const (
	EnableFlag         = "enable-hubble"
	SocketPathFlag     = "hubble-socket-path"
	ListenAddressFlag  = "hubble-listen-address"
	BufferCapacityFlag = "hubble-event-buffer-capacity"
	QueueSizeFlag      = "hubble-event-queue-size"
)

// observerHealthName is the gRPC health service name of the observer in
// the reference (pkg/hubble/api/v1.ObserverServiceName).
const observerHealthName = "hubble.server.Observer"

// DefaultSocketPath is where the API listens unless --hubble-socket-path
// says otherwise.
const DefaultSocketPath = "/var/run/apiary/hubble.sock"

// Config is the Hubble server's configuration.
type Config struct {
	EnableHubble bool
	// HubbleSocketPath is the Unix socket the API is served on.
	HubbleSocketPath string
	// HubbleListenAddress is an optional TCP host:port also serving it
	// (plaintext: bind it where only trusted clients reach).
	HubbleListenAddress string
	// HubbleEventBufferCapacity is how many flows the ring keeps.
	HubbleEventBufferCapacity int
	// HubbleEventQueueSize is how many verdicts may wait for conversion
	// before new ones are dropped (and counted).
	HubbleEventQueueSize int
}

var defaultConfig = Config{
	HubbleSocketPath:          DefaultSocketPath,
	HubbleEventBufferCapacity: 4095,
	HubbleEventQueueSize:      1024,
}

// maxBufferCapacity bounds the ring: a flow takes about a kilobyte.
const maxBufferCapacity = 1 << 20

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.Bool(EnableFlag, def.EnableHubble, "Serve Hubble's observer gRPC API (hubble observe) from the agent's flows")
	fs.String(SocketPathFlag, def.HubbleSocketPath, "Unix socket where the Hubble API listens (mode 0600)")
	fs.String(ListenAddressFlag, def.HubbleListenAddress,
		"Also serve the Hubble API on this TCP host:port, without TLS or authentication; empty: the socket only")
	fs.Int(BufferCapacityFlag, def.HubbleEventBufferCapacity, "How many flows the Hubble ring keeps (its memory bound)")
	fs.Int(QueueSizeFlag, def.HubbleEventQueueSize, "How many events may wait for the Hubble ring before new ones are dropped and counted")
}

func (c Config) validate() error {
	if !c.EnableHubble {
		return nil
	}
	if c.HubbleEventBufferCapacity < 1 || c.HubbleEventBufferCapacity > maxBufferCapacity {
		return fmt.Errorf("invalid --%s %d: must be from 1 to %d", BufferCapacityFlag, c.HubbleEventBufferCapacity, maxBufferCapacity)
	}
	if c.HubbleEventQueueSize < 1 || c.HubbleEventQueueSize > maxBufferCapacity {
		return fmt.Errorf("invalid --%s %d: must be from 1 to %d", QueueSizeFlag, c.HubbleEventQueueSize, maxBufferCapacity)
	}
	if c.HubbleSocketPath == "" || !filepath.IsAbs(c.HubbleSocketPath) {
		return fmt.Errorf("invalid --%s %q: must be an absolute path", SocketPathFlag, c.HubbleSocketPath)
	}
	if c.HubbleListenAddress != "" {
		if _, _, err := net.SplitHostPort(c.HubbleListenAddress); err != nil {
			return fmt.Errorf("invalid --%s %q: %w", ListenAddressFlag, c.HubbleListenAddress, err)
		}
	}
	return nil
}

type params struct {
	cell.In

	Config    Config
	Log       *slog.Logger
	Lifecycle cell.Lifecycle
	Jobs      job.Group
	Health    cell.Health
	DB        *statedb.DB
	Endpoints statedb.Table[*tables.Endpoint]
	FQDNNames statedb.Table[*tables.FQDNName]
	Frontends statedb.Table[*tables.Frontend]
	Backends  statedb.Table[*tables.Backend]
	// IPCache names the pods of other nodes in flows.
	IPCache statedb.Table[*tables.IPCacheEntry] `optional:"true"`
	Monitor *policy.Monitor
	// Translations are the socket LB's, for the trace-sock flows.
	Translations *socketlb.Translations
	CgroupRoot   cgroups.Root
	Node         node.Config
	Metrics      *metrics
}

func register(p params) error {
	if err := p.Config.validate(); err != nil {
		return err
	}
	if !p.Config.EnableHubble {
		return nil
	}
	// Asked for now, before the socket LB loads its programs: they report
	// translations only when someone reads them.
	xlates := p.Translations.Subscribe(p.Config.HubbleEventQueueSize)
	r := newRing(p.Config.HubbleEventBufferCapacity)
	conv := newConverter(p.Node.NodeName, p.DB, p.Endpoints, p.FQDNNames, lbTables{p.Frontends, p.Backends})
	conv.cgroupRoot = p.CgroupRoot.Path()
	conv.ipcache = p.IPCache
	var (
		ch      <-chan policy.Verdict
		dropped func() uint64
		cancel  func()
	)
	obs := &observer{ring: r, nodeName: p.Node.NodeName, onLost: func(n uint64) {
		p.Metrics.lost.WithLabelValues("hubble_ring_buffer").Add(float64(n))
	}}
	srv := grpc.NewServer()
	observerpb.RegisterObserverServer(srv, obs)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	var listeners []net.Listener

	p.Lifecycle.Append(cell.Hook{
		OnStart: func(ctx cell.HookContext) error {
			obs.started = time.Now()
			// Subscribe before anything can be published, so that the
			// ring holds every verdict from start.
			ch, dropped, cancel = p.Monitor.Subscribe(p.Config.HubbleEventQueueSize)
			ln, err := listenUnix(p.Config.HubbleSocketPath)
			if err != nil {
				cancel()
				return err
			}
			listeners = append(listeners, ln)
			if addr := p.Config.HubbleListenAddress; addr != "" {
				var lc net.ListenConfig
				tln, err := lc.Listen(ctx, "tcp", addr)
				if err != nil {
					cancel()
					ln.Close()
					return fmt.Errorf("listen on --%s %s: %w", ListenAddressFlag, addr, err)
				}
				listeners = append(listeners, tln)
			}
			for _, ln := range listeners {
				go func() {
					if err := srv.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
						p.Log.Error("Hubble API stopped serving", "address", ln.Addr().String(), "error", err)
					}
				}()
			}
			// The CLI's `hubble status` asks for the observer by the
			// name the reference's server registers it under.
			hs.SetServingStatus(observerHealthName, healthpb.HealthCheckResponse_SERVING)
			hs.SetServingStatus(observerpb.Observer_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
			p.Health.OK("Serving on " + p.Config.HubbleSocketPath)
			return nil
		},
		OnStop: func(cell.HookContext) error {
			hs.Shutdown()
			// Followers never end by themselves: Stop cuts them.
			srv.Stop()
			if cancel != nil {
				cancel()
			}
			os.Remove(p.Config.HubbleSocketPath)
			return nil
		},
	})
	p.Jobs.Add(job.OneShot("ingest", func(ctx context.Context, _ cell.Health) error {
		var lastDropped, lastLost, lastXlateLost uint64
		for {
			select {
			case <-ctx.Done():
				return nil
			case tr := <-xlates:
				for _, f := range conv.xlateFlows(tr) {
					r.write(f)
					p.Metrics.observe(f)
				}
				if l := p.Translations.Lost(); l > lastXlateLost {
					p.Metrics.lost.WithLabelValues("perf_event_ring_buffer").Add(float64(l - lastXlateLost))
					lastXlateLost = l
				}
			case v, ok := <-ch:
				if !ok {
					return nil
				}
				for _, f := range conv.flows(v) {
					r.write(f)
					p.Metrics.observe(f)
				}
				if d := dropped(); d != lastDropped {
					p.Metrics.lost.WithLabelValues("observer_events_queue").Add(float64(d - lastDropped))
					lastDropped = d
				}
				if l := p.Monitor.Lost(); l > lastLost {
					p.Metrics.lost.WithLabelValues("perf_event_ring_buffer").Add(float64(l - lastLost))
					lastLost = l
				}
			}
		}
	}))
	return nil
}

// listenUnix listens on path, replacing a stale socket of an earlier run
// but nothing else (not a live socket, not another kind of file), and lets
// only the owner (root) connect.
func listenUnix(path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("create the directory of --%s: %w", SocketPathFlag, err)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("--%s %s exists and is not a socket", SocketPathFlag, path)
		}
		// Another agent (another --state-dir) may be serving there: take
		// its socket away only when nobody answers on it.
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("--%s %s is in use by another process", SocketPathFlag, path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove the stale socket %s: %w", path, err)
		}
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on --%s %s: %w", SocketPathFlag, path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("restrict %s: %w", path, err)
	}
	return ln, nil
}
