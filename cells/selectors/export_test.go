package selectors

import "testing"

// SetTestHookCommitted calls f after each chunk the controller commits
// (see testHookCommitted) until the test ends. Tests that set it must not
// run in parallel with other hives of this package.
func SetTestHookCommitted(tb testing.TB, f func(table string, chunk, chunks int)) {
	testHookCommitted = f
	tb.Cleanup(func() { testHookCommitted = nil })
}

// WriteChunk is writeChunk, for tests that need several chunks.
const WriteChunk = writeChunk
