package lb_test

import (
	"testing"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/cells/lb"
)

func TestScript(t *testing.T) {
	apiarytest.RunCells(t, "testdata/*.txtar", lb.Cell)
}
