package blockedports_test

import (
	"testing"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/docs/example/blockedports"
)

// TestScript runs testdata/*.txtar on maps in memory: no root needed.
func TestScript(t *testing.T) {
	apiarytest.RunCellsInMemory(t, "testdata/*.txtar", blockedports.Cell)
}
