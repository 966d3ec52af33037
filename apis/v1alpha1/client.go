package v1alpha1

import (
	"context"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"

	"github.com/apiary-net/apiary/cells/k8s"
)

// Verbs on Identities that the code calls, kept next to the calls: the
// agent in operator mode reads, the operator reads and writes. deploy/'s RBAC is
// tested against these lists (deploy/manifests_test.go), so a new call here
// without a rule there fails a test rather than a cluster.
var (
	// AgentReadVerbs are what IdentityKind's informer uses (k8s.InformerVerbs).
	AgentReadVerbs = []string{"list", "watch"}
	// AgentWriteVerbs are none: agents never write Identities (in agent
	// mode their numbers are node-local, in operator mode the operator
	// writes).
	AgentWriteVerbs = []string{}
	// OperatorVerbs are the informer's plus Client.Create and Client.Delete.
	OperatorVerbs = []string{"list", "watch", "create", "delete"}
)

// IdentityKind is apiary.io/v1alpha1 Identity, for k8s.NewResource: an
// informer over the clientset's dynamic client and documents in
// --config-dir.
var IdentityKind = k8s.Kind[*Identity]{
	GVK:        GroupVersion.WithKind(IdentityKindName),
	Resource:   IdentityResource,
	Namespaced: false,
	ListWatch: func(c *k8s.Clientset) cache.ListerWatcher {
		return k8s.CustomResourceListWatch[*Identity, *IdentityList](c, IdentityGVR)
	},
}

// Client creates and deletes Identities through the clientset's dynamic
// client (a real API server's, or client-go's fake in tests).
type Client struct {
	res dynamic.ResourceInterface
}

// NewClient returns a Client over the clientset, which must be enabled.
func NewClient(c *k8s.Clientset) (*Client, error) {
	if !c.IsEnabled() || c.Dynamic == nil {
		return nil, fmt.Errorf("no Kubernetes client for %s", GroupVersion)
	}
	return &Client{res: c.Dynamic.Resource(IdentityGVR)}, nil
}

// Create creates id; an existing name is an AlreadyExists error
// (k8serrors.IsAlreadyExists).
func (c *Client) Create(ctx context.Context, id *Identity) (*Identity, error) {
	u, err := k8s.ToUnstructured(id, GroupVersion.WithKind(IdentityKindName))
	if err != nil {
		return nil, fmt.Errorf("create identity %s: %w", id.Name, err)
	}
	created, err := c.res.Create(ctx, u, metav1.CreateOptions{})
	if err != nil {
		return nil, err
	}
	out := &Identity{}
	if err := k8s.FromUnstructured(created.Object, out); err != nil {
		return nil, fmt.Errorf("create identity %s: decode the answer: %w", id.Name, err)
	}
	return out, nil
}

// Delete deletes the Identity name. With a non-empty resourceVersion, only
// that version is deleted (a precondition), so that a concurrent re-creation
// under the same name is not lost.
func (c *Client) Delete(ctx context.Context, name, resourceVersion string) error {
	opts := metav1.DeleteOptions{}
	if resourceVersion != "" {
		opts.Preconditions = &metav1.Preconditions{ResourceVersion: &resourceVersion}
	}
	return c.res.Delete(ctx, name, opts)
}
