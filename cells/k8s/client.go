package k8s

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/pflag"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Clientset is the agent's Kubernetes client. The embedded Interface is nil
// when Kubernetes is disabled (no --kubeconfig and not running in a cluster);
// check IsEnabled before using it.
type Clientset struct {
	kubernetes.Interface

	// Dynamic is the client of the custom resources (CRDs) whose types
	// apiary defines (CustomResourceListWatch). Nil when disabled.
	Dynamic dynamic.Interface

	// RESTConfig is the configuration the clientset was built from. Nil
	// when disabled and for the fake clientset.
	RESTConfig *rest.Config
}

// IsEnabled reports whether a Kubernetes API server is configured.
func (c *Clientset) IsEnabled() bool {
	return c != nil && c.Interface != nil
}

// ClientConfig is the configuration of ClientCell.
type ClientConfig struct {
	// Kubeconfig is the path of a kubeconfig file. Empty means the in-cluster
	// configuration when running in a pod, otherwise no Kubernetes.
	Kubeconfig string
	// K8sAPIServer is the API server's address, replacing the kubeconfig's
	// or the in-cluster one (the `kubernetes` Service, which nothing may
	// load-balance before the agent itself runs). Empty: theirs.
	K8sAPIServer string `mapstructure:"k8s-api-server"`
}

// Flags implements cell.Flagger.
func (def ClientConfig) Flags(fs *pflag.FlagSet) {
	fs.String("kubeconfig", def.Kubeconfig,
		"Path of a kubeconfig file; empty: the in-cluster config when running in a pod, else no Kubernetes")
	fs.String(APIServerFlag, def.K8sAPIServer,
		"Address of the Kubernetes API server (https://HOST:PORT), replacing the kubeconfig's or the in-cluster one (the kubernetes Service); "+
			"in a pod the ServiceAccount's token and CA are used with it; empty: theirs")
}

// APIServerFlag names the flag holding ClientConfig.K8sAPIServer.
const APIServerFlag = "k8s-api-server"

// serviceAccountDir is where Kubernetes mounts a pod's ServiceAccount token
// and the cluster's CA.
const serviceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"

func newClientset(cfg ClientConfig, log *slog.Logger) (*Clientset, error) {
	restCfg, err := restConfig(cfg, serviceAccountDir, log)
	if err != nil || restCfg == nil {
		return &Clientset{}, err
	}
	cs, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return nil, fmt.Errorf("create Kubernetes client for %s: %w", restCfg.Host, err)
	}
	dyn, err := dynamic.NewForConfig(restCfg)
	if err != nil {
		return nil, fmt.Errorf("create Kubernetes dynamic client for %s: %w", restCfg.Host, err)
	}
	log.Info("Kubernetes enabled", "host", restCfg.Host)
	return &Clientset{Interface: cs, Dynamic: dyn, RESTConfig: restCfg}, nil
}

// restConfig is the client configuration cfg asks for, nil when Kubernetes
// is disabled. saDir is where a pod's ServiceAccount credentials are.
func restConfig(cfg ClientConfig, saDir string, log *slog.Logger) (*rest.Config, error) {
	server := strings.TrimSpace(cfg.K8sAPIServer)
	switch {
	case cfg.Kubeconfig != "":
		restCfg, err := clientcmd.BuildConfigFromFlags(server, cfg.Kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("load kubeconfig %s: %w", cfg.Kubeconfig, err)
		}
		return restCfg, nil
	case server != "":
		return serverConfig(server, saDir)
	}
	restCfg, err := rest.InClusterConfig()
	if err != nil {
		if errors.Is(err, rest.ErrNotInCluster) {
			log.Info("Kubernetes disabled: no --kubeconfig and not running in a cluster")
		} else {
			log.Warn("Kubernetes disabled: in-cluster config unusable", "error", err)
		}
		return nil, nil
	}
	return restCfg, nil
}

// serverConfig is the configuration for the API server at server with the
// ServiceAccount credentials in saDir: the in-cluster configuration at
// another address.
func serverConfig(server, saDir string) (*rest.Config, error) {
	if !strings.Contains(server, "://") {
		server = "https://" + server
	}
	u, err := url.Parse(server)
	if err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http") {
		return nil, fmt.Errorf("--%s %q: want https://HOST[:PORT]", APIServerFlag, server)
	}
	token := filepath.Join(saDir, "token")
	if _, err := os.Stat(token); err != nil {
		return nil, fmt.Errorf("--%s %s without --kubeconfig needs a ServiceAccount token: %w", APIServerFlag, server, err)
	}
	restCfg := &rest.Config{Host: server, BearerTokenFile: token}
	if u.Scheme == "https" {
		restCfg.TLSClientConfig.CAFile = filepath.Join(saDir, "ca.crt")
	}
	return restCfg, nil
}
