package k8s

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Clientset is the agent's Kubernetes client. The embedded Interface is nil
// when Kubernetes is disabled (no --kubeconfig and not running in a cluster);
// check IsEnabled before using it.
type Clientset struct {
	kubernetes.Interface

	// RESTConfig is the configuration the clientset was built from, for
	// building clients of other API groups (e.g. CRDs). Nil when disabled
	// and for the fake clientset.
	RESTConfig *rest.Config
}

// RESTClientFor returns a REST client for the API group version gv (a CRD's,
// typically), decoding JSON into the types of scheme.
func (c *Clientset) RESTClientFor(gv schema.GroupVersion, scheme *runtime.Scheme) (*rest.RESTClient, error) {
	if c == nil || c.RESTConfig == nil {
		return nil, fmt.Errorf("no REST config for %s", gv)
	}
	cfg := rest.CopyConfig(c.RESTConfig)
	cfg.GroupVersion = &gv
	cfg.APIPath = "/apis"
	cfg.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	if cfg.UserAgent == "" {
		cfg.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	rc, err := rest.RESTClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("REST client for %s: %w", gv, err)
	}
	return rc, nil
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
}

// Flags implements cell.Flagger.
func (def ClientConfig) Flags(fs *pflag.FlagSet) {
	fs.String("kubeconfig", def.Kubeconfig,
		"Path of a kubeconfig file; empty: the in-cluster config when running in a pod, else no Kubernetes")
}

func newClientset(cfg ClientConfig, log *slog.Logger) (*Clientset, error) {
	var (
		restCfg *rest.Config
		err     error
	)
	if cfg.Kubeconfig != "" {
		restCfg, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("load kubeconfig %s: %w", cfg.Kubeconfig, err)
		}
	} else {
		restCfg, err = rest.InClusterConfig()
		if err != nil {
			if errors.Is(err, rest.ErrNotInCluster) {
				log.Info("Kubernetes disabled: no --kubeconfig and not running in a cluster")
			} else {
				log.Warn("Kubernetes disabled: in-cluster config unusable", "error", err)
			}
			return &Clientset{}, nil
		}
	}
	cs, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return nil, fmt.Errorf("create Kubernetes client for %s: %w", restCfg.Host, err)
	}
	log.Info("Kubernetes enabled", "host", restCfg.Host)
	return &Clientset{Interface: cs, RESTConfig: restCfg}, nil
}
