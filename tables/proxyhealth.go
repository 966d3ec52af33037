package tables

import (
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// ProxyHealthTableName is the statedb name of the proxy-health table.
const ProxyHealthTableName = "proxy-health"

// ProxyHealthListener is one of the HTTP listeners the agent answers as
// kube-proxy does (cells/proxyhealth): its health endpoint
// (--kube-proxy-healthz-addr), or a Service's healthCheckNodePort
// (--enable-health-check-node-port).
type ProxyHealthListener struct {
	// Name is "healthz" for the health endpoint, the Service's
	// "namespace/name" for a health check node port.
	Name string `json:"name" yaml:"name"`
	// Address is where it listens.
	Address string `json:"address" yaml:"address"`
	// LocalEndpoints is, for a Service, the number of its ready endpoints
	// on this node that it answers with.
	LocalEndpoints int `json:"localEndpoints" yaml:"localEndpoints"`
	// Error says why it does not listen.
	Error string `json:"error,omitempty" yaml:"error,omitempty"`
}

// TableHeader implements statedb.TableWritable.
func (*ProxyHealthListener) TableHeader() []string {
	return []string{"Name", "Address", "LocalEndpoints", "Error"}
}

// TableRow implements statedb.TableWritable.
func (l *ProxyHealthListener) TableRow() []string {
	eps := strconv.Itoa(l.LocalEndpoints)
	if l.Name == ProxyHealthzName {
		eps = ""
	}
	return []string{l.Name, l.Address, eps, l.Error}
}

// ProxyHealthzName is the Name of the health endpoint's row.
const ProxyHealthzName = "healthz"

// ProxyHealthNameIndex is the primary index of the proxy-health table.
var ProxyHealthNameIndex = statedb.Index[*ProxyHealthListener, string]{
	Name:       "name",
	FromObject: func(l *ProxyHealthListener) index.KeySet { return index.NewKeySet(index.String(l.Name)) },
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewProxyHealthTable registers the proxy-health table with db.
func NewProxyHealthTable(db *statedb.DB) (statedb.RWTable[*ProxyHealthListener], error) {
	return statedb.NewTable(db, ProxyHealthTableName, ProxyHealthNameIndex)
}
