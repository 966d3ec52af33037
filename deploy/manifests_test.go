// Package deploy holds the Kubernetes manifests; its test parses every one
// of them and checks them against the code: RBAC covers exactly the verbs
// and resources the code uses, environment variables name real flags,
// config map keys exist, the agent gets the host access it needs.
package deploy

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/apis/v1alpha1"
	"github.com/apiary-net/apiary/cells/api"
	"github.com/apiary-net/apiary/cells/clusternetpolstatus"
	"github.com/apiary-net/apiary/cells/cnichain"
	"github.com/apiary-net/apiary/cells/core"
	"github.com/apiary-net/apiary/cells/endpoints"
	"github.com/apiary-net/apiary/cells/fqdn"
	"github.com/apiary-net/apiary/cells/health"
	"github.com/apiary-net/apiary/cells/hubble"
	"github.com/apiary-net/apiary/cells/identitymode"
	"github.com/apiary-net/apiary/cells/infra"
	"github.com/apiary-net/apiary/cells/ipam"
	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/metrics"
	"github.com/apiary-net/apiary/cells/nodeport"
	"github.com/apiary-net/apiary/cells/operator"
	"github.com/apiary-net/apiary/cells/proxyhealth"
	"github.com/apiary-net/apiary/cells/selectors"
	"github.com/apiary-net/apiary/cells/socketlb"
)

// manifests holds every object of every YAML file under deploy/.
type manifests struct {
	serviceAccounts     map[string]*corev1.ServiceAccount // by namespace/name
	configMaps          map[string]*corev1.ConfigMap
	clusterRoles        map[string]*rbacv1.ClusterRole
	roles               map[string]*rbacv1.Role
	clusterRoleBindings []*rbacv1.ClusterRoleBinding
	roleBindings        []*rbacv1.RoleBinding
	daemonSets          []*appsv1.DaemonSet
	deployments         []*appsv1.Deployment
	crds                int
}

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

// load decodes every document strictly into its Kubernetes type, so that a
// misspelt field fails here rather than being dropped by the API server.
func load(t *testing.T) *manifests {
	t.Helper()
	m := &manifests{
		serviceAccounts: map[string]*corev1.ServiceAccount{}, configMaps: map[string]*corev1.ConfigMap{},
		clusterRoles: map[string]*rbacv1.ClusterRole{}, roles: map[string]*rbacv1.Role{},
	}
	var files []string
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && (strings.HasSuffix(path, ".yaml") || strings.HasSuffix(path, ".yml")) {
			files = append(files, path)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 6 {
		t.Fatalf("found only %v", files)
	}
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range docSep.Split(string(data), -1) {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			var meta struct {
				Kind string `json:"kind"`
			}
			if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
				t.Fatalf("%s doc %d: %v", file, i, err)
			}
			var obj any
			switch meta.Kind {
			case "ServiceAccount":
				obj = &corev1.ServiceAccount{}
			case "ConfigMap":
				obj = &corev1.ConfigMap{}
			case "ClusterRole":
				obj = &rbacv1.ClusterRole{}
			case "Role":
				obj = &rbacv1.Role{}
			case "ClusterRoleBinding":
				obj = &rbacv1.ClusterRoleBinding{}
			case "RoleBinding":
				obj = &rbacv1.RoleBinding{}
			case "DaemonSet":
				obj = &appsv1.DaemonSet{}
			case "Deployment":
				obj = &appsv1.Deployment{}
			case "CustomResourceDefinition":
				m.crds++ // checked against the Go types in apis/v1alpha1
				continue
			default:
				t.Fatalf("%s doc %d: kind %q is not checked by this test", file, i, meta.Kind)
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Fatalf("%s doc %d (%s): %v", file, i, meta.Kind, err)
			}
			switch o := obj.(type) {
			case *corev1.ServiceAccount:
				m.serviceAccounts[o.Namespace+"/"+o.Name] = o
			case *corev1.ConfigMap:
				m.configMaps[o.Namespace+"/"+o.Name] = o
			case *rbacv1.ClusterRole:
				m.clusterRoles[o.Name] = o
			case *rbacv1.Role:
				m.roles[o.Namespace+"/"+o.Name] = o
			case *rbacv1.ClusterRoleBinding:
				m.clusterRoleBindings = append(m.clusterRoleBindings, o)
			case *rbacv1.RoleBinding:
				m.roleBindings = append(m.roleBindings, o)
			case *appsv1.DaemonSet:
				m.daemonSets = append(m.daemonSets, o)
			case *appsv1.Deployment:
				m.deployments = append(m.deployments, o)
			}
		}
	}
	return m
}

func stripComments(doc string) string {
	var b bytes.Buffer
	for line := range strings.Lines(doc) {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line)
		}
	}
	return b.String()
}

// grant is one permission: verb on group/resource, in a namespace ("" for
// cluster-wide) and optionally on one name.
type grant struct {
	group, resource, verb, namespace, name string
}

func (g grant) String() string {
	s := fmt.Sprintf("%s %s.%s", g.verb, g.resource, g.group)
	if g.namespace != "" {
		s += " in " + g.namespace
	}
	if g.name != "" {
		s += " named " + g.name
	}
	return s
}

// rulesOf returns the rules bound to a service account, with the
// namespace they apply in ("" for cluster-wide).
func (m *manifests) rulesOf(t *testing.T, ns, sa string) map[string][]rbacv1.PolicyRule {
	out := map[string][]rbacv1.PolicyRule{}
	isSubject := func(subjects []rbacv1.Subject) bool {
		return slices.ContainsFunc(subjects, func(s rbacv1.Subject) bool {
			return s.Kind == "ServiceAccount" && s.Namespace == ns && s.Name == sa
		})
	}
	for _, b := range m.clusterRoleBindings {
		if isSubject(b.Subjects) {
			r, ok := m.clusterRoles[b.RoleRef.Name]
			if b.RoleRef.Kind != "ClusterRole" || !ok {
				t.Fatalf("ClusterRoleBinding %s refers to missing %s %s", b.Name, b.RoleRef.Kind, b.RoleRef.Name)
			}
			out[""] = append(out[""], r.Rules...)
		}
	}
	for _, b := range m.roleBindings {
		if isSubject(b.Subjects) {
			r, ok := m.roles[b.Namespace+"/"+b.RoleRef.Name]
			if b.RoleRef.Kind != "Role" || !ok {
				t.Fatalf("RoleBinding %s/%s refers to missing %s %s", b.Namespace, b.Name, b.RoleRef.Kind, b.RoleRef.Name)
			}
			out[b.Namespace] = append(out[b.Namespace], r.Rules...)
		}
	}
	return out
}

func allows(rules map[string][]rbacv1.PolicyRule, g grant) bool {
	for ns, rs := range rules {
		if ns != "" && ns != g.namespace {
			continue
		}
		for _, r := range rs {
			if slices.Contains(r.APIGroups, g.group) && slices.Contains(r.Resources, g.resource) &&
				(slices.Contains(r.Verbs, g.verb) || slices.Contains(r.Verbs, "*")) &&
				(len(r.ResourceNames) == 0 || slices.Contains(r.ResourceNames, g.name)) {
				return true
			}
		}
	}
	return false
}

// everything lists every permission the rules give, to find excess ones.
func everything(rules map[string][]rbacv1.PolicyRule) []grant {
	var out []grant
	for ns, rs := range rules {
		for _, r := range rs {
			for _, gr := range r.APIGroups {
				for _, res := range r.Resources {
					for _, v := range r.Verbs {
						names := r.ResourceNames
						if len(names) == 0 {
							names = []string{""}
						}
						for _, n := range names {
							out = append(out, grant{gr, res, v, ns, n})
						}
					}
				}
			}
		}
	}
	return out
}

func kindGrants(group, resource string, verbs []string) []grant {
	var out []grant
	for _, v := range verbs {
		out = append(out, grant{group: group, resource: resource, verb: v})
	}
	return out
}

func informer[T k8s.Object](k k8s.Kind[T]) []grant {
	gvr := k.GVR()
	return kindGrants(gvr.Group, gvr.Resource, k8s.InformerVerbs)
}

// checkRBAC says what is missing and what is granted beyond need.
func checkRBAC(t *testing.T, who string, rules map[string][]rbacv1.PolicyRule, need []grant) {
	t.Helper()
	for _, g := range need {
		if !allows(rules, g) {
			t.Errorf("%s: RBAC does not allow %s, which the code uses", who, g)
		}
	}
	for _, g := range everything(rules) {
		needed := slices.ContainsFunc(need, func(n grant) bool {
			return n.group == g.group && n.resource == g.resource && n.verb == g.verb &&
				(g.namespace == "" || n.namespace == g.namespace)
		})
		if !needed {
			t.Errorf("%s: RBAC allows %s, which the code never uses", who, g)
		}
	}
}

const ns = "kube-system"

func TestAgentRBAC(t *testing.T) {
	m := load(t)
	var need []grant
	need = append(need, informer(k8s.ServiceKind)...)
	need = append(need, informer(k8s.EndpointSliceKind)...)
	need = append(need, informer(k8s.PodKind)...)
	need = append(need, informer(k8s.NamespaceKind)...)
	need = append(need, informer(k8s.NodeKind)...)
	need = append(need, informer(selectors.CNPKind)...)
	need = append(need, informer(selectors.CCNPKind)...)
	need = append(need, informer(selectors.NetworkPolicyKind)...)
	need = append(need, informer(selectors.ClusterNetpolKind)...)
	need = append(need, kindGrants(selectors.ClusterNetpolGroupVersion.Group, "clusternetworkpolicies", clusternetpolstatus.ObjectVerbs)...)
	need = append(need, kindGrants(selectors.ClusterNetpolGroupVersion.Group, clusternetpolstatus.StatusResource, clusternetpolstatus.StatusVerbs)...)
	need = append(need, informer(v1alpha1.IdentityKind)...)
	need = append(need, kindGrants(v1alpha1.GroupVersion.Group, v1alpha1.IdentityResource, v1alpha1.AgentReadVerbs)...)
	need = append(need, kindGrants(v1alpha1.GroupVersion.Group, v1alpha1.IdentityResource, v1alpha1.AgentWriteVerbs)...)
	rules := m.rulesOf(t, ns, "apiary-agent")
	checkRBAC(t, "agent", rules, need)
	for _, v := range []string{"create", "update", "patch", "delete", "deletecollection"} {
		if allows(rules, grant{group: v1alpha1.GroupVersion.Group, resource: v1alpha1.IdentityResource, verb: v}) {
			t.Errorf("agent may %s Identities: only the operator writes them", v)
		}
	}
}

func TestOperatorRBAC(t *testing.T) {
	m := load(t)
	var need []grant
	need = append(need, informer(k8s.PodKind)...)
	need = append(need, informer(k8s.NamespaceKind)...)
	need = append(need, informer(v1alpha1.IdentityKind)...)
	need = append(need, kindGrants(v1alpha1.GroupVersion.Group, v1alpha1.IdentityResource, v1alpha1.OperatorVerbs)...)
	for _, v := range operator.LeaseVerbs {
		need = append(need, grant{group: "coordination.k8s.io", resource: "leases", verb: v, namespace: ns, name: "apiary-operator"})
	}
	checkRBAC(t, "operator", m.rulesOf(t, ns, "apiary-operator"), need)
}

// flagsOf returns the flag names a composition registers.
func flagsOf(cells ...cell.Cell) map[string]bool {
	h := hive.NewWithOptions(core.HiveOptions(), cells...)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	out := map[string]bool{"log-level": true, "log-format": true} // the command's own
	fs.VisitAll(func(f *pflag.Flag) { out[f.Name] = true })
	return out
}

// checkContainer checks the env of a workload's container against the
// flags of its command and the config map.
func checkContainer(t *testing.T, m *manifests, who string, spec corev1.PodSpec, flags map[string]bool) map[string]string {
	t.Helper()
	if _, ok := m.serviceAccounts[ns+"/"+spec.ServiceAccountName]; !ok {
		t.Errorf("%s: service account %q is not in the manifests", who, spec.ServiceAccountName)
	}
	if len(spec.Containers) != 1 {
		t.Fatalf("%s: %d containers", who, len(spec.Containers))
	}
	env := map[string]string{}
	for _, e := range spec.Containers[0].Env {
		// A variable of the pod's own (the downward API) that a flag's
		// value refers to, $(NAME), is no flag.
		if !strings.HasPrefix(e.Name, core.EnvPrefix) && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			continue
		}
		name, ok := strings.CutPrefix(e.Name, core.EnvPrefix)
		flag := strings.ToLower(strings.ReplaceAll(name, "_", "-"))
		if !ok || !flags[flag] {
			t.Errorf("%s: env %s names no flag of the command", who, e.Name)
		}
		env[flag] = e.Value
		if ref := e.ValueFrom; ref != nil && ref.ConfigMapKeyRef != nil {
			cm, ok := m.configMaps[ns+"/"+ref.ConfigMapKeyRef.Name]
			if !ok {
				t.Errorf("%s: env %s: config map %s missing", who, e.Name, ref.ConfigMapKeyRef.Name)
				continue
			}
			if _, ok := cm.Data[ref.ConfigMapKeyRef.Key]; !ok {
				t.Errorf("%s: env %s: key %s not in config map", who, e.Name, ref.ConfigMapKeyRef.Key)
			}
			if ref.ConfigMapKeyRef.Key != flag {
				t.Errorf("%s: env %s reads key %s; keys are named after their flags", who, e.Name, ref.ConfigMapKeyRef.Key)
			}
		}
	}
	return env
}

func TestAgentDaemonSet(t *testing.T) {
	m := load(t)
	// The Identity CRD, the two Cilium policy CRDs and
	// ClusterNetworkPolicy's.
	if len(m.daemonSets) != 1 || m.crds != 4 {
		t.Fatalf("%d DaemonSets, %d CRDs; want 1 and 4", len(m.daemonSets), m.crds)
	}
	spec := m.daemonSets[0].Spec.Template.Spec
	flags := flagsOf(infra.Cell, k8s.ClientCell, identitymode.Cell, endpoints.Cell, socketlb.Cell, fqdn.Cell, ipam.Cell, cnichain.Cell, proxyhealth.Cell, nodeport.Cell, hubble.Cell)
	env := checkContainer(t, m, "agent", spec, flags)
	c := spec.Containers[0]
	if !spec.HostNetwork {
		t.Error("agent: not on the host network")
	}
	if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
		t.Error("agent: not privileged")
	}
	if !slices.Equal(c.Command, []string{"apiary", "agent"}) {
		t.Errorf("agent: command %v", c.Command)
	}
	mounted := func(dir string) bool {
		return slices.ContainsFunc(c.VolumeMounts, func(vm corev1.VolumeMount) bool {
			return dir == vm.MountPath || strings.HasPrefix(dir, vm.MountPath+"/")
		})
	}
	for _, f := range []string{"bpf-pin-dir", "state-dir", cnichain.ConfDirFlag, ipam.CNIBinDirFlag} {
		if env[f] == "" || !mounted(env[f]) {
			t.Errorf("agent: --%s=%q is not on a mounted volume", f, env[f])
		}
	}
	for _, v := range spec.Volumes {
		if v.HostPath == nil {
			t.Errorf("agent: volume %s is not from the host", v.Name)
		}
	}
	cm := m.configMaps[ns+"/apiary-config"]
	if cm == nil || cm.Data["identity-management-mode"] != identitymode.ModeAgent {
		t.Fatal("config map: identity-management-mode must default to agent (switch after the operator runs)")
	}
	// As shipped, the agent is the Service load balancer and reaches the
	// API server where the config map says (empty: in-cluster).
	if env[socketlb.EnableFlag] != "" || cm.Data[socketlb.EnableFlag] != "true" {
		t.Errorf("socket LB: env %q, config map %q; want it on through the config map", env[socketlb.EnableFlag], cm.Data[socketlb.EnableFlag])
	}
	// The agent answers kube-proxy's health checks, on kube-proxy's port.
	if cm.Data[proxyhealth.HealthzAddrFlag] != ":10256" || cm.Data[proxyhealth.HealthCheckNodePort] != "true" {
		t.Errorf("config map %s = %q, %s = %q; want :10256 and true", proxyhealth.HealthzAddrFlag, cm.Data[proxyhealth.HealthzAddrFlag],
			proxyhealth.HealthCheckNodePort, cm.Data[proxyhealth.HealthCheckNodePort])
	}
	// The agent chains apiary-cni, on the node's own CNI directories.
	if cm.Data[cnichain.ModeFlag] != cnichain.ModeChain {
		t.Errorf("config map %s = %q, want %s", cnichain.ModeFlag, cm.Data[cnichain.ModeFlag], cnichain.ModeChain)
	}
	for flag, host := range map[string]string{cnichain.ConfDirFlag: cnichain.DefaultConfDir, ipam.CNIBinDirFlag: ipam.DefaultCNIBinDir} {
		if !slices.ContainsFunc(c.VolumeMounts, func(vm corev1.VolumeMount) bool {
			return vm.MountPath == env[flag] && !vm.ReadOnly && slices.ContainsFunc(spec.Volumes, func(v corev1.Volume) bool {
				return v.Name == vm.Name && v.HostPath != nil && v.HostPath.Path == host
			})
		}) {
			t.Errorf("agent: --%s=%q is not the host's %s, writable", flag, env[flag], host)
		}
	}
	if v, ok := cm.Data[k8s.APIServerFlag]; !ok || v != "" {
		t.Errorf("config map %s = %q (present %v), want it empty: the in-cluster default", k8s.APIServerFlag, v, ok)
	}
	// A locally imported image must run: never pulled when present.
	for _, c := range append(spec.InitContainers, spec.Containers...) {
		if c.Image != m.deployments[0].Spec.Template.Spec.Containers[0].Image || c.ImagePullPolicy != corev1.PullIfNotPresent {
			t.Errorf("agent container %s: image %s, pull policy %q; want the operator's image, IfNotPresent", c.Name, c.Image, c.ImagePullPolicy)
		}
	}
	// Bidirectional propagation fails on hosts whose bpffs is not a shared
	// mount; the init step mounts bpffs on the host instead.
	for _, vm := range c.VolumeMounts {
		if vm.MountPropagation != nil && *vm.MountPropagation != corev1.MountPropagationNone {
			t.Errorf("agent: mount %s propagates (%s): fails where the host mount is not shared", vm.Name, *vm.MountPropagation)
		}
	}
	if len(spec.InitContainers) != 1 || !slices.Equal(spec.InitContainers[0].Command[:2], []string{"apiary", "init-node"}) {
		t.Errorf("agent: init containers %+v, want apiary init-node", spec.InitContainers)
	}
}

func TestOperatorDeployment(t *testing.T) {
	m := load(t)
	if len(m.deployments) != 1 {
		t.Fatalf("%d Deployments", len(m.deployments))
	}
	d := m.deployments[0]
	flags := flagsOf(statedb.Cell, health.Cell, job.Cell, metrics.Cell, api.Cell, k8s.SourcesCell, k8s.ClientCell, operator.Cell)
	env := checkContainer(t, m, "operator", d.Spec.Template.Spec, flags)
	if _, ok := env[k8s.APIServerFlag]; !ok {
		t.Errorf("operator: does not read %s from the config map", k8s.APIServerFlag)
	}
	if c := d.Spec.Template.Spec.Containers[0]; c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("operator: pull policy %q, want IfNotPresent", c.ImagePullPolicy)
	}
	if d.Spec.Replicas == nil || *d.Spec.Replicas < 2 {
		t.Error("operator: fewer than 2 replicas; leader election is there to allow a standby")
	}
	if d.Spec.Template.Spec.HostNetwork {
		t.Error("operator: needs no host network")
	}
	if c := d.Spec.Template.Spec.Containers[0]; !slices.Equal(c.Command, []string{"apiary", "operator"}) {
		t.Errorf("operator: command %v", c.Command)
	}
}

// TestIdentityLabelsShared checks that the agents and the operator read the
// identity label patterns from one config map key, empty (the defaults):
// were they to disagree, agents would never find the operator's Identities.
func TestIdentityLabelsShared(t *testing.T) {
	m := load(t)
	readers := map[string]bool{}
	for who, spec := range map[string]corev1.PodSpec{
		"agent":    m.daemonSets[0].Spec.Template.Spec,
		"operator": m.deployments[0].Spec.Template.Spec,
	} {
		for _, e := range spec.Containers[0].Env {
			if ref := e.ValueFrom; ref != nil && ref.ConfigMapKeyRef != nil && ref.ConfigMapKeyRef.Key == endpoints.IdentityLabelsFlag {
				readers[who] = true
			}
		}
	}
	if !readers["agent"] || !readers["operator"] {
		t.Errorf("%s is read by %v; want the agent and the operator", endpoints.IdentityLabelsFlag, readers)
	}
	cm := m.configMaps[ns+"/apiary-config"]
	if cm == nil {
		t.Fatal("config map apiary-config missing")
	}
	if got, ok := cm.Data[endpoints.IdentityLabelsFlag]; !ok || got != "" {
		t.Errorf("config map %s = %q (present %v), want it empty: the defaults", endpoints.IdentityLabelsFlag, got, ok)
	}
}
