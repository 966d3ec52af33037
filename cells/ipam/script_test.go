package ipam_test

import (
	"testing"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/cells/ipam"
)

// TestScript runs testdata/*.txtar. Their plugins are the scripts in
// testdata (--cni-bin-dir=testdata), so they need no CNI installation.
func TestScript(t *testing.T) {
	apiarytest.RunCellsInMemory(t, "testdata/*.txtar", ipam.Cell)
}
