package k8s

import "context"

// Batching: a controller that follows several kinds wants one loop that
// waits for whichever stream has something, then takes everything already
// waiting so that it can write it in one transaction. Go can only select over
// a fixed set of channels, and reflect.Select or a forwarding goroutine per
// stream would cost too much on the load-balancing path (~100k events/s), so
// the select is written once here for three streams; two streams pass a nil
// third channel, which select never picks.

// ReceiveBatch3 waits until one of the streams a, b and c has an event, wake
// delivers (or is closed), or ctx is done. After an event it goes on taking
// the events that are ready, without blocking, until there are max in all
// (max below 1 counts as 1) or none is ready. Each event goes to the handler
// of its stream, Sync included, in the order received. A wake ends the wait
// with no event and takes none: the caller has something else to look at.
// A nil wake (or stream) is never ready. wake may carry anything (a statedb
// watch channel, a timer's channel); a caller without one passes a typed nil
// such as a nil <-chan struct{} variable.
//
// n is the number of events handled. ok is false when ctx was done while
// waiting or a stream was closed (Events closes it when its context ends):
// the caller should stop. The events handled before the closed stream was
// seen are counted in n.
func ReceiveBatch3[A, B, C Object, W any](ctx context.Context, wake <-chan W, max int,
	a <-chan Event[A], onA func(Event[A]),
	b <-chan Event[B], onB func(Event[B]),
	c <-chan Event[C], onC func(Event[C]),
) (n int, ok bool) {
	select {
	case <-ctx.Done():
		return 0, false
	case <-wake:
		return 0, true
	case ev, open := <-a:
		if !open {
			return 0, false
		}
		onA(ev)
	case ev, open := <-b:
		if !open {
			return 0, false
		}
		onB(ev)
	case ev, open := <-c:
		if !open {
			return 0, false
		}
		onC(ev)
	}
	n, ok = DrainBatch3(max-1, a, onA, b, onB, c, onC)
	return n + 1, ok
}

// ReceiveBatch2 is ReceiveBatch3 for two streams.
func ReceiveBatch2[A, B Object, W any](ctx context.Context, wake <-chan W, max int,
	a <-chan Event[A], onA func(Event[A]),
	b <-chan Event[B], onB func(Event[B]),
) (n int, ok bool) {
	return ReceiveBatch3[A, B, B](ctx, wake, max, a, onA, b, onB, nil, nil)
}

// DrainBatch3 hands the events that are ready on a, b and c to their
// handlers, without blocking, until max have been handled or none is ready.
// ok is false when a stream was closed. ReceiveBatch3 drains with it; a
// caller can call it again to add to a batch, for example after letting a
// busy source run.
func DrainBatch3[A, B, C Object](max int,
	a <-chan Event[A], onA func(Event[A]),
	b <-chan Event[B], onB func(Event[B]),
	c <-chan Event[C], onC func(Event[C]),
) (n int, ok bool) {
	for ; n < max; n++ {
		select {
		case ev, open := <-a:
			if !open {
				return n, false
			}
			onA(ev)
		case ev, open := <-b:
			if !open {
				return n, false
			}
			onB(ev)
		case ev, open := <-c:
			if !open {
				return n, false
			}
			onC(ev)
		default:
			return n, true
		}
	}
	return n, true
}

// DrainBatch2 is DrainBatch3 for two streams.
func DrainBatch2[A, B Object](max int,
	a <-chan Event[A], onA func(Event[A]),
	b <-chan Event[B], onB func(Event[B]),
) (n int, ok bool) {
	return DrainBatch3[A, B, B](max, a, onA, b, onB, nil, nil)
}

// TrackSync returns a handler for ReceiveBatch that sets *synced on the
// stream's Sync event and hands every other event to changed.
func TrackSync[T Object](synced *bool, changed func(Event[T])) func(Event[T]) {
	return func(ev Event[T]) {
		if ev.Kind == Sync {
			*synced = true
			return
		}
		changed(ev)
	}
}

// ReceiveBatch4 is ReceiveBatch3 for four streams: it waits on a, b and c
// and d together, then drains all four.
func ReceiveBatch4[A, B, C, D Object, W any](ctx context.Context, wake <-chan W, max int,
	a <-chan Event[A], onA func(Event[A]),
	b <-chan Event[B], onB func(Event[B]),
	c <-chan Event[C], onC func(Event[C]),
	d <-chan Event[D], onD func(Event[D]),
) (n int, ok bool) {
	select {
	case <-ctx.Done():
		return 0, false
	case <-wake:
		return 0, true
	case ev, open := <-a:
		if !open {
			return 0, false
		}
		onA(ev)
	case ev, open := <-b:
		if !open {
			return 0, false
		}
		onB(ev)
	case ev, open := <-c:
		if !open {
			return 0, false
		}
		onC(ev)
	case ev, open := <-d:
		if !open {
			return 0, false
		}
		onD(ev)
	}
	n = 1
	for n < max {
		select {
		case ev, open := <-d:
			if !open {
				return n, false
			}
			onD(ev)
			n++
			continue
		default:
		}
		m, ok := DrainBatch3(1, a, onA, b, onB, c, onC)
		if !ok {
			return n + m, false
		}
		if m == 0 {
			// Nothing on a, b or c: d may have got one meanwhile, or
			// nothing is ready.
			select {
			case ev, open := <-d:
				if !open {
					return n, false
				}
				onD(ev)
				n++
				continue
			default:
				return n, true
			}
		}
		n += m
	}
	return n, true
}
