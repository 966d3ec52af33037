package wake

import "testing"

func TestEither(t *testing.T) {
	for _, tc := range []struct {
		name           string
		closeA, closeB bool
	}{
		{"a", true, false},
		{"b", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := make(chan struct{}), make(chan struct{})
			ch, stop := Either(a, b)
			defer stop()
			if tc.closeA {
				close(a)
			}
			if tc.closeB {
				close(b)
			}
			<-ch // the test times out if it never fires
		})
	}
	t.Run("nil", func(t *testing.T) {
		a := make(chan struct{})
		ch, stop := Either(nil, a)
		defer stop()
		close(a)
		<-ch
	})
	t.Run("stopped", func(t *testing.T) {
		a, b := make(chan struct{}), make(chan struct{})
		ch, stop := Either(a, b)
		stop()
		select {
		case <-ch:
			t.Fatal("fired without a or b")
		default:
		}
	})
}
