package clusternetpolstatus_test

import (
	"testing"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/cells/clusternetpolstatus"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/ipcache"
	"github.com/apiary-net/apiary/cells/selectors"
)

func TestScript(t *testing.T) {
	apiarytest.RunCellsInMemory(t, "testdata/*.txtar", identity.Cell, ipcache.Cell, selectors.Cell, clusternetpolstatus.Cell)
}
