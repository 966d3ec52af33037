package clusternodes_test

import (
	"testing"

	"github.com/apiary-net/apiary/apiarytest"
	"github.com/apiary-net/apiary/cells/clusternodes"
	"github.com/apiary-net/apiary/cells/identity"
	"github.com/apiary-net/apiary/cells/ipcache"
)

func TestScript(t *testing.T) {
	apiarytest.RunCellsInMemory(t, "testdata/*.txtar", identity.Cell, ipcache.Cell, clusternodes.Cell)
}
