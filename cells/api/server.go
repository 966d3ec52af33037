package api

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/apiary-net/apiary/cells/health"
)

// Server is the agent's HTTP API. It listens from hive start to hive stop.
type Server struct {
	cfg        Config
	log        *slog.Logger
	health     cell.Health
	shutdowner hive.Shutdowner
	srv        *http.Server

	// baseCtx is the parent of every request context. Cancelling it on stop
	// ends /statedb/changes streams, which would otherwise keep their
	// connections busy until the stop timeout.
	baseCtx    context.Context
	cancelBase context.CancelFunc

	mu     sync.Mutex
	ln     net.Listener
	served chan struct{} // closed when Serve returns
}

type serverParams struct {
	cell.In

	Config     Config
	Log        *slog.Logger
	Lifecycle  cell.Lifecycle
	Health     cell.Health
	Shutdowner hive.Shutdowner
	DB         *statedb.DB
	Registry   *health.Registry
	Metrics    *prometheus.Registry
	Handlers   []Handler `group:"api-handlers"`
}

func newServer(p serverParams) (*Server, error) {
	if err := p.Config.validate(); err != nil {
		return nil, err
	}
	errorLog := slog.NewLogLogger(p.Log.Handler(), slog.LevelWarn)
	mux, err := newMux(p, errorLog)
	if err != nil {
		return nil, err
	}

	baseCtx, cancel := context.WithCancel(context.Background())
	s := &Server{
		cfg:        p.Config,
		log:        p.Log,
		health:     p.Health,
		shutdowner: p.Shutdowner,
		baseCtx:    baseCtx,
		cancelBase: cancel,
	}
	s.srv = &http.Server{
		Handler:     recoverPanics(p.Log, mux),
		BaseContext: func(net.Listener) context.Context { return s.baseCtx },
		ErrorLog:    errorLog,
		// Bounds clients that open a connection and never finish the
		// headers. No write timeout: /statedb/changes streams for as long
		// as the client stays.
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
	}
	// Shutdown waits for busy connections to become idle; streams only
	// end when their context does.
	s.srv.RegisterOnShutdown(cancel)
	p.Lifecycle.Append(cell.Hook{OnStart: s.start, OnStop: s.stop})
	return s, nil
}

// Addr returns the address the server listens on, which tells the port
// when --api-addr asked for port 0. It is nil before start.
func (s *Server) Addr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln == nil {
		return nil
	}
	return s.ln.Addr()
}

// start listens in the start hook, so that a taken port fails the start of
// the hive instead of being logged from a goroutine later.
func (s *Server) start(ctx cell.HookContext) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", s.cfg.APIAddr)
	if err != nil {
		return fmt.Errorf("listen on %s (--%s): %w", s.cfg.APIAddr, AddrFlag, listenCause(err))
	}
	served := make(chan struct{})
	s.mu.Lock()
	s.ln, s.served = ln, served
	s.mu.Unlock()

	s.log.Info("API listening", "address", ln.Addr().String())
	if !isLoopback(ln.Addr()) {
		// Tables name pods, addresses and policies, and nothing checks who
		// asks: say so where the operator looks.
		s.log.Warn("HTTP API listens on a non-loopback address without authentication: whoever reaches "+
			ln.Addr().String()+" reads the agent's state",
			"address", ln.Addr().String(), AddrFlag, s.cfg.APIAddr)
	}
	s.health.OK("Listening on " + ln.Addr().String())

	go s.serve(ln, served)
	return nil
}

// isLoopback reports whether a listener's address only accepts connections
// from this host: a loopback address. The unspecified address (0.0.0.0,
// ::) and every other one are reachable from elsewhere.
func isLoopback(addr net.Addr) bool {
	tcp, ok := addr.(*net.TCPAddr)
	return ok && tcp.IP.IsLoopback()
}

// serve runs until stop and closes served when it returns.
func (s *Server) serve(ln net.Listener, served chan<- struct{}) {
	defer close(served)
	err := s.srv.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) {
		return
	}
	// The API is how operators see the agent; running blind is worse than
	// stopping with a reason.
	err = fmt.Errorf("serve HTTP API on %s: %w", ln.Addr(), err)
	s.log.Error("API server failed", "error", err)
	s.health.Degraded("HTTP API server failed", err)
	s.shutdowner.Shutdown(hive.ShutdownWithError(err))
}

// listenCause strips "listen tcp ADDR: bind:" from a listen error, as the
// caller already says what was listened on.
func listenCause(err error) error {
	var opErr *net.OpError
	if !errors.As(err, &opErr) {
		return err
	}
	var sysErr *os.SyscallError
	if errors.As(opErr.Err, &sysErr) {
		return sysErr.Err
	}
	return opErr.Err
}

// stop shuts down gracefully within the stop context, then forcibly.
func (s *Server) stop(ctx cell.HookContext) error {
	defer s.cancelBase()
	s.mu.Lock()
	served := s.served
	s.mu.Unlock()
	if served == nil {
		return nil // never started
	}

	err := s.srv.Shutdown(ctx)
	if err != nil {
		// Out of time: cut the remaining connections rather than leave them
		// serving after the hive has stopped.
		_ = s.srv.Close()
		err = fmt.Errorf("shut down HTTP API: %w", err)
	}
	<-served
	s.health.Stopped("HTTP API stopped")
	return err
}
