// Package proxyhealth answers the health checks a cluster asks of
// kube-proxy, so that apiary can stand in for it: the health endpoint
// (--kube-proxy-healthz-addr, kube-proxy's :10256 /healthz and /livez),
// healthy while the load balancer's maps are in line with its tables, and,
// with --enable-health-check-node-port, the healthCheckNodePort of every
// Service with externalTrafficPolicy Local, answering 200 with the count
// of the Service's ready endpoints on this node, 503 with none, for cloud
// load balancers to send traffic only to nodes that can serve it. The
// answers are kube-proxy's, byte for byte where clients parse them. The
// listeners are the proxy-health table. See docs/load-balancing.md.
package proxyhealth

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/apiary-net/apiary/tables"
)

// Cell serves kube-proxy's health endpoint and health check node ports,
// and provides the read-only proxy-health table. It reads the lb cell's
// tables.
var Cell = cell.Module(
	"proxy-health",
	"kube-proxy health endpoint and health check node ports",

	cell.Config(defaultConfig),
	cell.ProvidePrivate(tables.NewProxyHealthTable),
	cell.Provide(statedb.RWTable[*tables.ProxyHealthListener].ToTable),
	cell.Invoke(register),
)

// Flag names.
const (
	HealthzAddrFlag     = "kube-proxy-healthz-addr"
	HealthzTimeoutFlag  = "kube-proxy-healthz-timeout"
	HealthCheckNodePort = "enable-health-check-node-port"
)

// Config is the cell's configuration.
type Config struct {
	// KubeProxyHealthzAddr is where /healthz and /livez are answered;
	// "" turns them off.
	KubeProxyHealthzAddr string
	// KubeProxyHealthzTimeout is how long a change may wait for the maps
	// before the endpoint says unhealthy.
	KubeProxyHealthzTimeout time.Duration
	// EnableHealthCheckNodePort answers Services' healthCheckNodePorts.
	EnableHealthCheckNodePort bool
}

var defaultConfig = Config{KubeProxyHealthzTimeout: time.Minute}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.String(HealthzAddrFlag, def.KubeProxyHealthzAddr, "Answer kube-proxy's health endpoint (/healthz, /livez) on this address (kube-proxy's is :10256): 200 while the load-balancing maps are in line with the Services, 503 when a change has waited longer than --"+HealthzTimeoutFlag+"; empty: off")
	fs.Duration(HealthzTimeoutFlag, def.KubeProxyHealthzTimeout, "How long a Service change may wait to reach the load-balancing maps before --"+HealthzAddrFlag+" and the health check node ports say unhealthy (kube-proxy: twice its sync period)")
	fs.Bool(HealthCheckNodePort, def.EnableHealthCheckNodePort, "Answer the healthCheckNodePort of each Service with externalTrafficPolicy Local, as kube-proxy does: 200 with the count of its ready endpoints on this node, 503 with none")
}

type params struct {
	cell.In

	Config    Config
	Jobs      job.Group
	DB        *statedb.DB
	Table     statedb.RWTable[*tables.ProxyHealthListener]
	Services  statedb.Table[*tables.Service]
	Frontends statedb.Table[*tables.Frontend]
	Log       *slog.Logger
}

func register(p params) error {
	if p.Config.KubeProxyHealthzTimeout <= 0 {
		return fmt.Errorf("--%s=%s: want a positive duration", HealthzTimeoutFlag, p.Config.KubeProxyHealthzTimeout)
	}
	if p.Config.KubeProxyHealthzAddr == "" && !p.Config.EnableHealthCheckNodePort {
		return nil
	}
	s := newSyncer(p, time.Now)
	p.Jobs.Add(job.OneShot("sync", s.run))
	if p.Config.KubeProxyHealthzAddr != "" {
		p.Jobs.Add(job.OneShot("healthz", s.serveHealthz, job.WithRetry(-1, &job.ExponentialBackoff{Min: time.Second, Max: time.Minute})))
	}
	return nil
}
