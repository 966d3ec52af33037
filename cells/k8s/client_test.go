package k8s

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/require"

	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/health"
)

const kubeconfig = `apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: https://127.0.0.1:1
contexts:
- name: test
  context: {cluster: test, user: test}
current-context: test
users:
- name: test
  user: {token: secret}
`

// populateWithFlags builds a hive of the k8s cells, parses args as its
// command line and populates it.
func populateWithFlags(t *testing.T, args ...string) (*Clientset, *DirSource, error) {
	var (
		cs  *Clientset
		dir *DirSource
	)
	h := hive.NewWithOptions(core.HiveOptions(),
		statedb.Cell, health.Cell, job.Cell,
		ClientCell, SourcesCell,
		cell.Invoke(func(c *Clientset, d *DirSource) { cs, dir = c, d }),
	)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	require.NoError(t, fs.Parse(args))
	return cs, dir, h.Populate(hivetest.Logger(t))
}

func TestClientCell(t *testing.T) {
	// Not in a cluster, whatever machine the test runs on.
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	tmp := t.TempDir()
	good := filepath.Join(tmp, "kubeconfig")
	require.NoError(t, os.WriteFile(good, []byte(kubeconfig), 0o600))
	garbage := filepath.Join(tmp, "garbage")
	require.NoError(t, os.WriteFile(garbage, []byte("clusters: 42\n"), 0o600))

	t.Run("disabled", func(t *testing.T) {
		cs, dir, err := populateWithFlags(t)
		require.NoError(t, err)
		require.False(t, cs.IsEnabled())
		require.False(t, dir.Enabled())
	})
	t.Run("kubeconfig", func(t *testing.T) {
		cs, _, err := populateWithFlags(t, "--kubeconfig", good)
		require.NoError(t, err)
		require.True(t, cs.IsEnabled())
		require.Equal(t, "https://127.0.0.1:1", cs.RESTConfig.Host)
	})
	for name, path := range map[string]string{"missing": filepath.Join(tmp, "nope"), "garbage": garbage} {
		t.Run(name, func(t *testing.T) {
			_, _, err := populateWithFlags(t, "--kubeconfig="+path)
			require.ErrorContains(t, err, "load kubeconfig "+path)
		})
	}
	t.Run("config-dir", func(t *testing.T) {
		_, dir, err := populateWithFlags(t, "--config-dir", tmp)
		require.NoError(t, err)
		require.Equal(t, tmp, dir.Dir())
	})
	require.False(t, (*Clientset)(nil).IsEnabled())
}
