package k8s

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"

	"github.com/cilium/hive/cell"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// EventKind says what an Event means.
type EventKind int

const (
	// Upsert: the object was added or changed (or is part of the replay of
	// the current state to a new subscriber).
	Upsert EventKind = iota
	// Delete: the object is gone. Event.Object is the last version of it
	// that the subscriber received.
	Delete
	// Sync: every source has delivered its initial state, and the
	// subscriber has received all of it. Sent once per subscriber. Until
	// then, what a subscriber has seen may be incomplete, so it must not
	// prune anything.
	Sync
)

// String returns "Upsert", "Delete" or "Sync".
func (k EventKind) String() string {
	switch k {
	case Upsert:
		return "Upsert"
	case Delete:
		return "Delete"
	case Sync:
		return "Sync"
	}
	return fmt.Sprintf("EventKind(%d)", int(k))
}

// Event is one change of one object, or the Sync marker.
type Event[T Object] struct {
	Kind EventKind
	// Key of the object; zero on Sync.
	Key Key
	// Object is the new object on Upsert, the last one the subscriber saw on
	// Delete, and the zero value on Sync. It is shared: don't modify it.
	Object T
}

// String describes the event for logs and test failures.
func (e Event[T]) String() string {
	if e.Kind == Sync {
		return "Sync"
	}
	return e.Kind.String() + " " + e.Key.String()
}

// Resource is the event stream of one kind.
type Resource[T Object] interface {
	// Events: every current object as Upsert, then exactly one Sync once
	// every active source has done its initial listing, then live Upserts
	// and Deletes. Per subscriber, events for a key are coalesced: a
	// subscriber that falls behind gets the latest state of each key, never
	// an unbounded backlog; Delete comes only for keys the subscriber saw.
	// The channel closes when ctx ends. Many subscribers are allowed, each
	// gets the full replay.
	Events(ctx context.Context) <-chan Event[T]
}

// source is one origin of objects. A higher value wins when two sources hold
// the same key: a file in --config-dir overrides the API server's copy, so
// that an operator can pin an object locally.
type source int

const (
	sourceInformer source = iota
	sourceDir
	numSources
)

func (s source) String() string {
	switch s {
	case sourceInformer:
		return "informer"
	case sourceDir:
		return "config-dir"
	}
	return "unknown"
}

// resource merges the objects of its active sources and fans them out to
// subscribers.
type resource[T Object] struct {
	kind Kind[T]
	log  *slog.Logger

	mu     sync.Mutex
	objs   [numSources]map[Key]T
	active [numSources]bool
	synced [numSources]bool
	subs   map[*subscriber[T]]struct{}
}

// NewResource returns the event stream of kind. It registers the kind with
// the YAML decoder (so --config-dir and the fake clientset's script commands
// accept it) and, when Kubernetes is enabled and the kind has a ListWatch,
// runs an informer between hive start and stop, which reports in the health
// sub-scope "informer-<resource>" of the calling module (see Kind.Optional
// for kinds whose resource may not be served). Use it in a provider:
//
//	cell.Provide(func(p k8s.ResourceParams) k8s.Resource[*X] { return k8s.NewResource(p, XKind) })
//
// It panics if the kind is malformed or its GVK is already registered with
// another Go type, which is a programming error.
func NewResource[T Object](p ResourceParams, kind Kind[T]) Resource[T] {
	if p.Kinds != nil {
		if err := RegisterKind(p.Kinds, kind); err != nil {
			panic(fmt.Sprintf("k8s.NewResource: %s", err))
		}
	} else if _, err := describe(kind); err != nil {
		panic(fmt.Sprintf("k8s.NewResource: %s", err))
	}
	log := p.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	r := newResource(kind, log.With("k8sKind", kind.GVK.Kind))
	if p.Clientset.IsEnabled() && kind.ListWatch != nil {
		r.active[sourceInformer] = true
		var health cell.Health
		if p.Health != nil {
			health = p.Health.NewScope("informer-" + kind.Resource)
		}
		startInformer(r, p.Lifecycle, p.Clientset, health, p.Options)
	}
	if p.Dir.Enabled() {
		r.active[sourceDir] = true
		p.Dir.subscribe(r)
	}
	return r
}

func newResource[T Object](kind Kind[T], log *slog.Logger) *resource[T] {
	r := &resource[T]{kind: kind, log: log, subs: map[*subscriber[T]]struct{}{}}
	for s := range numSources {
		r.objs[s] = map[Key]T{}
	}
	return r
}

// current returns the merged view of key: the copy of the highest-priority
// source that has it.
func (r *resource[T]) current(key Key) (T, bool) {
	for s := numSources - 1; s >= 0; s-- {
		if obj, ok := r.objs[s][key]; ok {
			return obj, true
		}
	}
	var zero T
	return zero, false
}

func (r *resource[T]) isSynced() bool {
	for s := range numSources {
		if r.active[s] && !r.synced[s] {
			return false
		}
	}
	return true
}

// set stores (or with del removes) a source's copy of key and tells the
// subscribers if the merged view changed. Called with r.mu held.
func (r *resource[T]) set(src source, key Key, obj T, del bool) {
	before, hadBefore := r.current(key)
	if del {
		delete(r.objs[src], key)
	} else {
		r.objs[src][key] = obj
	}
	after, hasAfter := r.current(key)
	if hadBefore == hasAfter && (!hasAfter || sameObject(before, after)) {
		return // e.g. the API server's copy changed under a local file's copy
	}
	for sub := range r.subs {
		sub.push(key)
	}
}

func (r *resource[T]) upsert(src source, obj T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.set(src, KeyOf(obj), obj, false)
}

func (r *resource[T]) delete(src source, key Key) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var zero T
	r.set(src, key, zero, true)
}

func (r *resource[T]) markSynced(src source) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.synced[src] {
		return
	}
	r.synced[src] = true
	r.log.Debug("Source synced", "source", src)
	for sub := range r.subs {
		sub.poke()
	}
}

// dirGVK, dirApply and dirSynced make the resource a sink of the directory
// source.
func (r *resource[T]) dirGVK() schema.GroupVersionKind { return r.kind.GVK }

func (r *resource[T]) dirApply(changes []dirChange) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range changes {
		if c.obj == nil {
			var zero T
			r.set(sourceDir, c.key, zero, true)
			continue
		}
		obj, ok := c.obj.(T)
		if !ok {
			// Can't happen: the decoder built the object from this kind's
			// registered type.
			r.log.Error("BUG: directory source delivered an object of the wrong type",
				"key", c.key, "type", fmt.Sprintf("%T", c.obj))
			continue
		}
		r.set(sourceDir, c.key, obj, false)
	}
}

func (r *resource[T]) dirSynced() { r.markSynced(sourceDir) }

// Events implements Resource.
func (r *resource[T]) Events(ctx context.Context) <-chan Event[T] {
	ch := make(chan Event[T])
	sub := &subscriber[T]{
		queued: map[Key]struct{}{},
		sent:   map[Key]T{},
		wake:   make(chan struct{}, 1),
	}

	r.mu.Lock()
	keys := map[Key]struct{}{}
	for s := range numSources {
		for k := range r.objs[s] {
			keys[k] = struct{}{}
		}
	}
	// The replay comes in key order so that it is deterministic.
	for _, k := range slices.SortedFunc(maps.Keys(keys), compareKeys) {
		sub.push(k)
	}
	r.subs[sub] = struct{}{}
	r.mu.Unlock()

	go r.deliver(ctx, sub, ch)
	return ch
}

func (r *resource[T]) deliver(ctx context.Context, sub *subscriber[T], ch chan<- Event[T]) {
	defer close(ch)
	defer func() {
		r.mu.Lock()
		delete(r.subs, sub)
		r.mu.Unlock()
	}()
	for {
		r.mu.Lock()
		ev, ok := r.next(sub)
		r.mu.Unlock()
		if !ok {
			select {
			case <-sub.wake:
				continue
			case <-ctx.Done():
				return
			}
		}
		select {
		case ch <- ev:
		case <-ctx.Done():
			return
		}
	}
}

// next computes the subscriber's next event from its queue of changed keys
// and the current merged state. Called with r.mu held.
func (r *resource[T]) next(sub *subscriber[T]) (Event[T], bool) {
	for len(sub.queue) > 0 {
		key := sub.queue[0]
		sub.queue = sub.queue[1:]
		delete(sub.queued, key)

		obj, exists := r.current(key)
		prev, seen := sub.sent[key]
		switch {
		case exists && seen && sameObject(prev, obj):
			// Changed and changed back before the subscriber looked.
		case exists:
			sub.sent[key] = obj
			return Event[T]{Kind: Upsert, Key: key, Object: obj}, true
		case seen:
			delete(sub.sent, key)
			return Event[T]{Kind: Delete, Key: key, Object: prev}, true
		}
	}
	if !sub.syncSent && r.isSynced() {
		sub.syncSent = true
		return Event[T]{Kind: Sync}, true
	}
	return Event[T]{}, false
}

// subscriber is the per-subscriber state: the keys that changed since it
// last looked (each at most once, in order of first change) and what it has
// been sent, so that it gets Deletes only for what it saw.
type subscriber[T Object] struct {
	queue    []Key
	queued   map[Key]struct{}
	sent     map[Key]T
	syncSent bool
	wake     chan struct{}
}

func (s *subscriber[T]) push(key Key) {
	if _, ok := s.queued[key]; !ok {
		s.queued[key] = struct{}{}
		s.queue = append(s.queue, key)
	}
	s.poke()
}

func (s *subscriber[T]) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func sameObject[T Object](a, b T) bool {
	// Objects are pointers, so identity is what matters: every source hands
	// over a new pointer only when the object really changed.
	return any(a) == any(b)
}

func compareKeys(a, b Key) int {
	return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
}

// ResourceParams holds what NewResource needs. Everything is provided by
// SourcesCell and one of ClientCell or k8sfake.Cell (tests).
type ResourceParams struct {
	cell.In

	Lifecycle cell.Lifecycle
	Log       *slog.Logger
	Clientset *Clientset
	Kinds     *Kinds
	Dir       *DirSource
	// Health is the calling module's scope; each informer reports in a
	// sub-scope "informer-<resource>" (e.g. selectors.informer-ciliumnetworkpolicies).
	Health cell.Health `optional:"true"`
	// Options tunes the informers; the zero value means the defaults.
	Options ResourceOptions `optional:"true"`
}
