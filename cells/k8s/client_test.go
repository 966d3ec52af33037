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
	t.Run("kubeconfig with api server", func(t *testing.T) {
		cs, _, err := populateWithFlags(t, "--kubeconfig", good, "--k8s-api-server", "https://10.1.2.3:6443")
		require.NoError(t, err)
		require.Equal(t, "https://10.1.2.3:6443", cs.RESTConfig.Host)
		require.Equal(t, "secret", cs.RESTConfig.BearerToken, "the kubeconfig's credentials are kept")
	})
	t.Run("api server outside a pod", func(t *testing.T) {
		_, _, err := populateWithFlags(t, "--k8s-api-server", "https://10.1.2.3:6443")
		require.ErrorContains(t, err, "--k8s-api-server https://10.1.2.3:6443 without --kubeconfig needs a ServiceAccount token")
	})
	t.Run("config-dir", func(t *testing.T) {
		_, dir, err := populateWithFlags(t, "--config-dir", tmp)
		require.NoError(t, err)
		require.Equal(t, tmp, dir.Dir())
	})
	require.False(t, (*Clientset)(nil).IsEnabled())
}

// TestServerConfig: --k8s-api-server without a kubeconfig is the in-cluster
// configuration (the ServiceAccount's token and CA) at that address.
func TestServerConfig(t *testing.T) {
	sa := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(sa, "token"), []byte("tok"), 0o600))
	for _, tc := range []struct {
		server, host, ca, err string
	}{
		{server: "https://192.0.2.1:6443", host: "https://192.0.2.1:6443", ca: filepath.Join(sa, "ca.crt")},
		{server: "192.0.2.1:6443", host: "https://192.0.2.1:6443", ca: filepath.Join(sa, "ca.crt")},
		{server: "http://127.0.0.1:8080", host: "http://127.0.0.1:8080"},
		{server: "ftp://192.0.2.1", err: `--k8s-api-server "ftp://192.0.2.1": want https://HOST[:PORT]`},
		{server: "https://", err: `--k8s-api-server "https://": want https://HOST[:PORT]`},
	} {
		t.Run(tc.server, func(t *testing.T) {
			cfg, err := serverConfig(tc.server, sa)
			if tc.err != "" {
				require.EqualError(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.host, cfg.Host)
			require.Equal(t, filepath.Join(sa, "token"), cfg.BearerTokenFile)
			require.Equal(t, tc.ca, cfg.TLSClientConfig.CAFile)
		})
	}
}
