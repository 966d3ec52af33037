package k8s

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
)

// ClientCell provides the *Clientset, configured by --kubeconfig. A
// composition includes exactly one of ClientCell and k8sfake.Cell (tests).
var ClientCell = cell.Module(
	"k8s-client",
	"Kubernetes client",

	cell.Config(ClientConfig{}),
	cell.Provide(newClientset),
)

// SourcesCell provides what NewResource needs (the kinds registry and the
// --config-dir source) and the Resources of the core kinds: Service,
// EndpointSlice, Pod and Namespace. It runs the directory source in the
// module's job.Group, which the hive options provide to every module
// (core.HiveOptions).
var SourcesCell = cell.Module(
	"k8s-sources",
	"Kubernetes objects from the API server and the config dir",

	cell.Config(defaultSourcesConfig),
	cell.Provide(
		NewKinds,
		newDirSource,
		func(p ResourceParams) Resource[*corev1.Service] { return NewResource(p, ServiceKind) },
		func(p ResourceParams) Resource[*discoveryv1.EndpointSlice] { return NewResource(p, EndpointSliceKind) },
		func(p ResourceParams) Resource[*corev1.Pod] { return NewResource(p, PodKind) },
		func(p ResourceParams) Resource[*corev1.Namespace] { return NewResource(p, NamespaceKind) },
	),
	cell.Invoke(startDirSource),
)

// SourcesConfig is the configuration of SourcesCell.
type SourcesConfig struct {
	// ConfigDir is a directory of Kubernetes YAML files to read objects
	// from, next to or instead of the API server. Empty: none.
	ConfigDir string
	// ConfigFileMaxSize is the largest file in ConfigDir that is read, as
	// a Kubernetes quantity ("4Mi", "500k", "1048576"); larger files are
	// reported and not read.
	ConfigFileMaxSize string
}

var defaultSourcesConfig = SourcesConfig{
	ConfigFileMaxSize: "4Mi",
}

// Flags implements cell.Flagger.
func (def SourcesConfig) Flags(fs *pflag.FlagSet) {
	fs.String("config-dir", def.ConfigDir,
		"Directory of Kubernetes YAML files (Services, EndpointSlices, Pods, Namespaces, policies) to read and watch; empty: none")
	fs.String("config-file-max-size", def.ConfigFileMaxSize,
		"Largest file in --config-dir that is read (bytes, or a quantity such as 4Mi or 500k); a larger one is reported and not read")
}

// startDirSource runs the directory source as a job when --config-dir is
// set. Resources subscribe to it while they are constructed during populate,
// so they are all there when the job does its first scan.
func startDirSource(d *DirSource, jobs job.Group) {
	if d.Enabled() {
		jobs.Add(job.OneShot("config-dir", d.run))
	}
}
