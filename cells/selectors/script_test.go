package selectors_test

import (
	"testing"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/cells/clusternodes"
	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/selectors"
)

// The selectors need no kernel: the ipcache's map is in memory, and the
// scripts run without root.
func TestScript(t *testing.T) {
	apiarytest.RunCellsInMemory(t, "testdata/*.txtar", identity.Cell, ipcache.Cell, clusternodes.Cell, selectors.Cell)
}

// TestScriptPods runs testdata/pods/*.txtar with the endpoints cell too:
// pods of other nodes (no cgroups needed), whose labels and identities
// the policies' selectors meet.
func TestScriptPods(t *testing.T) {
	apiarytest.RunCellsInMemory(t, "testdata/pods/*.txtar", identity.Cell, ipcache.Cell, clusternodes.Cell, selectors.Cell, endpoints.Cell)
}
