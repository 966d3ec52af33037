package tables

import "github.com/cilium/statedb/reconciler"

// StatusText is a reconciliation status for a table row: its kind and, on
// error, the error, without the age, so that rows compare equal in tests.
func StatusText(s reconciler.Status) string {
	if s.Kind == reconciler.StatusKindError {
		return s.Kind.String() + ": " + s.GetError()
	}
	return s.Kind.String()
}
