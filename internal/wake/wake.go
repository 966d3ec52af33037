// Package wake combines the channels a controller loop waits on.
package wake

// Either returns a channel that is closed once a or b is, and a function
// that releases it (and the goroutine watching them) when the caller stops
// waiting. A nil channel never fires. Meant for waits that happen a few
// times, such as until a table is initialized, not for every round of a
// busy loop.
func Either(a, b <-chan struct{}) (<-chan struct{}, func()) {
	if a == nil {
		return b, func() {}
	}
	if b == nil {
		return a, func() {}
	}
	out := make(chan struct{})
	stop := make(chan struct{})
	go func() {
		select {
		case <-a:
			close(out)
		case <-b:
			close(out)
		case <-stop:
		}
	}()
	return out, func() { close(stop) }
}
