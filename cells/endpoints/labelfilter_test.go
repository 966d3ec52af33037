package endpoints

import (
	"strings"
	"testing"
)

// TestLabelFilter: which pod label keys make identities, by the
// reference's default filter and with patterns added (--identity-labels),
// as the reference decides them (class 7 of issue 24).
func TestLabelFilter(t *testing.T) {
	for _, tc := range []struct {
		added []string
		keep  []string
		drop  []string
		err   string
	}{
		{
			// The defaults: the namespace, its labels and app.kubernetes.io
			// count; what Kubernetes and its controllers add does not.
			keep: []string{"app", "tier", "io.kubernetes.pod.namespace", "io.cilium.k8s.namespace.labels.team",
				"io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name", "app.kubernetes.io/name",
				"io.cilium.k8s.policy.serviceaccount", "example.com/role"},
			drop: []string{"kubernetes.io/arch",
				// The reference's kubernetes.io exclusion is not anchored:
				// it leaves the key out wherever kubernetes.io appears.
				"topology.kubernetes.io/zone", "topology.kubernetes.io/region", "node.kubernetes.io/instance-type",
				"example.kubernetes.io/team", "io.kubernetes.container.name", "k8s.io/foo",
				"statefulset.kubernetes.io/pod-name", "apps.kubernetes.io/pod-index",
				"batch.kubernetes.io/job-completion-index", "batch.kubernetes.io/controller-uid",
				"failure-domain.beta.kubernetes.io/zone", "beta.kubernetes.io/os",
				"pod-template-hash", "pod-template-generation", "controller-revision-hash", "controller-uid",
				"annotation.kubectl.kubernetes.io/restartedAt", "etcd_node"},
		},
		{
			// Exclusive patterns add to the defaults.
			added: []string{`!rollout`, `k8s:!example\.com`},
			keep:  []string{"app", "io.kubernetes.pod.namespace"},
			drop:  []string{"rollout", "rollout-id", "example.com/role", "pod-template-hash"},
		},
		{
			// One inclusive pattern: only what an inclusive pattern
			// matches (its own, and the defaults') counts.
			added: []string{`app$`},
			keep:  []string{"app", "io.kubernetes.pod.namespace", "io.cilium.k8s.namespace.labels.team", "app.kubernetes.io/name"},
			drop:  []string{"apps", "tier", "example.com/role", "kubernetes.io/arch"},
		},
		{
			// An inclusive pattern longer than an exclusive one wins.
			added: []string{`kubernetes\.io/arch`, `topology\.kubernetes\.io/zone`},
			keep:  []string{"kubernetes.io/arch", "io.kubernetes.pod.namespace", "topology.kubernetes.io/zone"},
			drop:  []string{"kubernetes.io/os", "app"},
		},
		{
			// Space-separated, as the reference's config map writes them;
			// a source other than k8s matches no pod label.
			added: []string{"!tier !zone", "reserved:!app"},
			keep:  []string{"app"},
			drop:  []string{"tier", "zone"},
		},
		{added: []string{"!("}, err: "--identity-labels"},
		{added: []string{"k8s:!"}, err: "no regular expression"},
	} {
		f, err := NewLabelFilter(tc.added)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: error %v, want one with %q", tc.added, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%q: %v", tc.added, err)
		}
		for _, k := range tc.keep {
			if !f.Keep("k8s", k) {
				t.Errorf("%q: %s left out, want it kept", tc.added, k)
			}
		}
		for _, k := range tc.drop {
			if f.Keep("k8s", k) {
				t.Errorf("%q: %s kept, want it left out", tc.added, k)
			}
		}
	}
}
