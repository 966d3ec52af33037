package k8s

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/watchlist"
)

// Default bounds of how often a resource that is not served is checked
// again: at first soon, as a CRD is often installed just after the agent
// starts, then no more than once a minute.
const (
	defaultNotServedRetryMin = time.Second
	defaultNotServedRetryMax = time.Minute
)

// ResourceOptions tunes the informers beyond their kinds. Provide it (it is
// an optional dependency of NewResource) to change the defaults; tests do.
type ResourceOptions struct {
	// NotServedRetryMin and NotServedRetryMax bound the backoff between
	// checks of whether an optional kind's resource is served yet: the
	// first check comes after NotServedRetryMin, each next one after twice
	// as long, up to NotServedRetryMax. Zero: 1s and 1 min.
	NotServedRetryMin, NotServedRetryMax time.Duration
}

// servedState is what the last listing of a kind found out about its
// resource.
type servedState int

const (
	servedUnknown servedState = iota
	served
	notServed
)

// listWatch sits between a kind's informer and the API server. It reports the
// outcome of every list and watch in the resource's health scope, and for an
// optional kind (Kind.Optional) it makes a resource the API server does not
// serve look like an empty one:
//
//   - A list answered 404 gives an empty list, so the informer syncs with
//     no objects. A warning is logged once, when the resource goes from
//     served (or not yet listed) to not served.
//   - The watch that follows is a local one that checks, with backoff,
//     whether the resource is served now. Once it is, the watch ends with
//     "resource version expired", which makes the reflector list again
//     (quietly): the objects arrive as Upserts.
//   - A watch answered 404 on a resource listed a moment ago (its CRD was
//     just deleted) ends the same way, and the new list, answered 404,
//     empties the informer: its objects are delivered as Deletes.
//
// Any other error (403, the network) passes through to the reflector, which
// logs it and retries with its own backoff, and degrades the health scope
// until a list or watch succeeds again.
type listWatch struct {
	kind               string // "CiliumNetworkPolicy (cilium.io/v2)"
	kindName           string // "CiliumNetworkPolicy"
	optional           bool
	inner              cache.ListerWatcher
	innerCtx           cache.ListerWatcherWithContext
	health             cell.Health // nil: not reported
	log                *slog.Logger
	retryMin, retryMax time.Duration

	mu    sync.Mutex
	state servedState
}

func newListWatch[T Object](r *resource[T], inner cache.ListerWatcher, health cell.Health, opts ResourceOptions) *listWatch {
	lw := &listWatch{
		kind:     fmt.Sprintf("%s (%s)", r.kind.GVK.Kind, r.kind.GVK.GroupVersion()),
		kindName: r.kind.GVK.Kind,
		optional: r.kind.Optional,
		inner:    inner,
		innerCtx: cache.ToListerWatcherWithContext(inner),
		health:   health,
		log:      r.log,
		retryMin: opts.NotServedRetryMin,
		retryMax: opts.NotServedRetryMax,
	}
	if lw.retryMin <= 0 {
		lw.retryMin = defaultNotServedRetryMin
	}
	if lw.retryMax <= 0 {
		lw.retryMax = defaultNotServedRetryMax
	}
	lw.retryMax = max(lw.retryMax, lw.retryMin)
	return lw
}

// List implements cache.Lister.
func (lw *listWatch) List(opts metav1.ListOptions) (runtime.Object, error) {
	return lw.ListWithContext(context.Background(), opts)
}

// Watch implements cache.Watcher.
func (lw *listWatch) Watch(opts metav1.ListOptions) (watch.Interface, error) {
	return lw.WatchWithContext(context.Background(), opts)
}

// IsWatchListSemanticsUnSupported passes on what the inner ListerWatcher
// says about watch-list streaming (the fake clientset can't do it).
func (lw *listWatch) IsWatchListSemanticsUnSupported() bool {
	return watchlist.DoesClientNotSupportWatchListSemantics(lw.inner)
}

// ListWithContext implements cache.ListerWithContext.
func (lw *listWatch) ListWithContext(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
	obj, err := lw.innerCtx.ListWithContext(ctx, opts)
	switch {
	case err == nil:
		lw.setState(served)
		return obj, nil
	case lw.optional && apierrors.IsNotFound(err):
		lw.setState(notServed)
		return &metav1.List{}, nil
	default:
		lw.failed(ctx, "list", err)
		return nil, err
	}
}

// WatchWithContext implements cache.WatcherWithContext.
func (lw *listWatch) WatchWithContext(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	// A watch-list request (SendInitialEvents) replaces the list; it must
	// reach the server, and if it fails the reflector falls back to a list.
	initial := opts.SendInitialEvents != nil && *opts.SendInitialEvents
	if lw.optional && !initial && lw.getState() == notServed {
		return lw.newProbeWatch(ctx), nil
	}
	w, err := lw.innerCtx.WatchWithContext(ctx, opts)
	switch {
	case err == nil:
		lw.ok()
		return w, nil
	case lw.optional && apierrors.IsNotFound(err):
		if initial {
			return nil, err // the reflector falls back to a list, which tells
		}
		// Listed a moment ago, gone now: have the reflector list again,
		// which finds out and empties the informer.
		return relistWatch(), nil
	default:
		lw.failed(ctx, "watch", err)
		return nil, err
	}
}

func (lw *listWatch) getState() servedState {
	lw.mu.Lock()
	defer lw.mu.Unlock()
	return lw.state
}

// setState records what a list or check found, logs a change and reports it
// in health.
func (lw *listWatch) setState(s servedState) {
	lw.mu.Lock()
	old := lw.state
	lw.state = s
	lw.mu.Unlock()

	switch {
	case s == notServed && old != notServed:
		lw.log.Warn(fmt.Sprintf("%s is not served by the API server; treating it as empty until its CRD is installed", lw.kind))
	case s == served && old == notServed:
		lw.log.Info(fmt.Sprintf("%s is served now; listing it", lw.kind))
	}
	lw.ok()
}

// ok reports the current state in health after a successful call.
func (lw *listWatch) ok() {
	if lw.health == nil {
		return
	}
	if lw.getState() == notServed {
		lw.health.OK(lw.kindName + " not served; treated as empty")
	} else {
		lw.health.OK("Listed and watching")
	}
}

// failed reports a failed call in health, unless the informer is stopping.
func (lw *listWatch) failed(ctx context.Context, op string, err error) {
	if lw.health == nil || ctx.Err() != nil {
		return
	}
	lw.health.Degraded(fmt.Sprintf("%s %s failed; retrying", op, lw.kind), err)
}

// expired is the watch error that makes a reflector list again without
// logging more than a debug message.
func expired() watch.Event {
	return watch.Event{Type: watch.Error, Object: &metav1.Status{
		Status:  metav1.StatusFailure,
		Code:    http.StatusGone,
		Reason:  metav1.StatusReasonExpired,
		Message: "served state of the resource changed; list again",
	}}
}

// relistWatch returns a watch that ends at once with expired.
func relistWatch() watch.Interface {
	ch := make(chan watch.Event, 1)
	ch <- expired()
	close(ch)
	return chanWatch(ch)
}

// chanWatch is a watch over a channel that its sender closes.
type chanWatch <-chan watch.Event

func (w chanWatch) Stop()                          {}
func (w chanWatch) ResultChan() <-chan watch.Event { return w }

// probeWatch stands in for the watch of a resource that is not served: it
// delivers nothing, and checks with backoff whether the resource is served
// now, by listing at most one object. When it is, or when the check fails
// otherwise, it ends with expired, so that the reflector lists again and
// gets the objects (or reports the error).
type probeWatch struct {
	ch     chan watch.Event
	cancel context.CancelFunc
	done   chan struct{}
}

func (lw *listWatch) newProbeWatch(ctx context.Context) *probeWatch {
	ctx, cancel := context.WithCancel(ctx)
	w := &probeWatch{ch: make(chan watch.Event, 1), cancel: cancel, done: make(chan struct{})}
	go w.run(ctx, lw)
	return w
}

func (w *probeWatch) run(ctx context.Context, lw *listWatch) {
	defer close(w.done)
	defer close(w.ch)
	delay := lw.retryMin
	timer := time.NewTimer(delay)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		_, err := lw.innerCtx.ListWithContext(ctx, metav1.ListOptions{Limit: 1})
		if ctx.Err() != nil {
			return
		}
		if apierrors.IsNotFound(err) {
			delay = min(2*delay, lw.retryMax)
			timer.Reset(delay)
			continue
		}
		if err == nil {
			lw.setState(served)
		}
		w.ch <- expired() // buffered: never blocks
		return
	}
}

// Stop implements watch.Interface. It returns once the check has stopped.
func (w *probeWatch) Stop() {
	w.cancel()
	<-w.done
}

// ResultChan implements watch.Interface.
func (w *probeWatch) ResultChan() <-chan watch.Event { return w.ch }
