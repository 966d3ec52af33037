package lb_test

import (
	"testing"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/cells/lb"
)

func TestScript(t *testing.T) {
	apiarytest.RunCells(t, "testdata/*.txtar", lb.Cell)
}

// TestScriptInMemory runs the same scripts on maps in memory, without root.
func TestScriptInMemory(t *testing.T) {
	apiarytest.RunCellsInMemory(t, "testdata/*.txtar", lb.Cell)
}
