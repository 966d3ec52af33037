// Package api serves the agent's HTTP API on --api-addr: the statedb tables
// under /statedb/, health under /healthz and Prometheus metrics under
// /metrics. Other cells add routes through the "api-handlers" value group.
//
// Nothing here is authenticated, which is why the default address is on the
// loopback interface, and why listening anywhere else logs a warning naming
// the address.
package api

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
)

// Cell provides *Server, which listens on --api-addr while the hive runs.
var Cell = cell.Module(
	"api",
	"HTTP API for tables health and metrics",

	cell.Config(defaultConfig),
	cell.Provide(newServer),
	// Nothing else depends on *Server, and an invalid address must fail
	// populate rather than go unnoticed, so construct it unconditionally.
	cell.Invoke(func(*Server) {}),
)

// AddrFlag is the flag naming the API's listen address.
const AddrFlag = "api-addr"

// DefaultAddr is where the API listens unless --api-addr says otherwise.
const DefaultAddr = "127.0.0.1:9234"

// Config is the configuration of the API server.
type Config struct {
	// APIAddr is the host:port to listen on; port 0 picks a free port.
	APIAddr string
}

var defaultConfig = Config{APIAddr: DefaultAddr}

// Flags implements cell.Flagger.
func (def Config) Flags(fs *pflag.FlagSet) {
	fs.String(AddrFlag, def.APIAddr,
		"Address (host:port) where the HTTP API listens; loopback by default because it is not authenticated")
}

// validate checks the address up front so that a typo fails populate with
// the flag's name instead of failing start with a resolver error.
func (c Config) validate() error {
	host, port, err := net.SplitHostPort(c.APIAddr)
	if err != nil {
		// The AddrError repeats the address; keep just the reason.
		var addrErr *net.AddrError
		if errors.As(err, &addrErr) {
			return fmt.Errorf("invalid --%s %q: %s", AddrFlag, c.APIAddr, addrErr.Err)
		}
		return fmt.Errorf("invalid --%s %q: %w", AddrFlag, c.APIAddr, err)
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("invalid --%s %q: port %q is not a number from 0 to 65535", AddrFlag, c.APIAddr, port)
	}
	for _, r := range host {
		if r <= ' ' || r == '/' {
			return fmt.Errorf("invalid --%s %q: host %q is not an IP address or host name", AddrFlag, c.APIAddr, host)
		}
	}
	return nil
}

// Handler is an extra route served by the API.
type Handler struct {
	// Path is a net/http.ServeMux pattern such as "/debug/x" (exact) or
	// "/debug/" (subtree). It must not clash with another route.
	Path string
	// Handler serves the route. Panics are recovered like for every route.
	Handler http.Handler
}

// HandlerOut is returned by a constructor to add a Handler to the API:
//
//	cell.Provide(func() api.HandlerOut {
//		return api.HandlerOut{Handler: api.Handler{Path: "/debug/x", Handler: h}}
//	})
type HandlerOut struct {
	cell.Out

	Handler Handler `group:"api-handlers"`
}
