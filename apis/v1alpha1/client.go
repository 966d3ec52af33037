package v1alpha1

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	k8stesting "k8s.io/client-go/testing"
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
	// Client.List and Client.Watch are the informer's.
	OperatorVerbs = []string{"list", "watch", "create", "delete"}
)

// IdentityKind is apiary.io/v1alpha1 Identity, for k8s.NewResource: an
// informer over the clientset (the REST API, or the fake clientset's
// tracker in tests) and documents in --config-dir.
var IdentityKind = k8s.Kind[*Identity]{
	GVK:        GroupVersion.WithKind(IdentityKindName),
	Resource:   IdentityResource,
	Namespaced: false,
	ListWatch: func(c *k8s.Clientset) cache.ListerWatcher {
		cl, err := NewClient(c)
		if err != nil {
			return &failingListWatch{err: err}
		}
		return k8s.NewListWatch(c.Interface, cl.List, cl.Watch)
	},
}

// Client creates, deletes, lists and watches Identities, on a real API
// server through a REST client or on the fake clientset of tests through
// its reactors (so that tests see the calls in Actions()).
type Client struct {
	rest *rest.RESTClient
	fake reactor
}

// reactor is what client-go's fake clientset offers to record and answer
// calls. An interface, so that the binary does not link the fake clientset.
type reactor interface {
	Invokes(action k8stesting.Action, defaultReturnObj runtime.Object) (runtime.Object, error)
	InvokesWatch(action k8stesting.Action) (watch.Interface, error)
}

// NewClient returns a Client over the clientset, which must be enabled.
func NewClient(c *k8s.Clientset) (*Client, error) {
	if !c.IsEnabled() {
		return nil, fmt.Errorf("no Kubernetes client for %s", GroupVersion)
	}
	if f, ok := c.Interface.(reactor); ok && c.RESTConfig == nil {
		return &Client{fake: f}, nil
	}
	rc, err := c.RESTClientFor(GroupVersion, scheme)
	if err != nil {
		return nil, err
	}
	return &Client{rest: rc}, nil
}

// Create creates id; an existing name is an AlreadyExists error
// (k8serrors.IsAlreadyExists).
func (c *Client) Create(ctx context.Context, id *Identity) (*Identity, error) {
	if c.fake != nil {
		obj, err := c.fake.Invokes(k8stesting.NewRootCreateAction(IdentityGVR, id.DeepCopy()), nil)
		if err != nil {
			return nil, err
		}
		out, ok := obj.(*Identity)
		if !ok {
			return nil, fmt.Errorf("create identity %s: unexpected %T", id.Name, obj)
		}
		return out, nil
	}
	out := &Identity{}
	err := c.rest.Post().Resource(IdentityResource).Body(id).Do(ctx).Into(out)
	return out, err
}

// Delete deletes the Identity name. With a non-empty resourceVersion, only
// that version is deleted (a precondition), so that a concurrent re-creation
// under the same name is not lost.
func (c *Client) Delete(ctx context.Context, name, resourceVersion string) error {
	opts := metav1.DeleteOptions{}
	if resourceVersion != "" {
		opts.Preconditions = &metav1.Preconditions{ResourceVersion: &resourceVersion}
	}
	if c.fake != nil {
		_, err := c.fake.Invokes(k8stesting.NewRootDeleteActionWithOptions(IdentityGVR, name, opts), nil)
		return err
	}
	return c.rest.Delete().Resource(IdentityResource).Name(name).Body(&opts).Do(ctx).Error()
}

// List lists every Identity.
func (c *Client) List(ctx context.Context, opts metav1.ListOptions) (*IdentityList, error) {
	if c.fake != nil {
		// The tracker stores objects of any type but lists only the types
		// of its own scheme: asked for a generic v1 List, it returns the
		// Identities as they are.
		obj, err := c.fake.Invokes(k8stesting.NewRootListAction(IdentityGVR, schema.GroupVersionKind{Version: "v1"}, opts), nil)
		if err != nil {
			return nil, err
		}
		items, err := meta.ExtractList(obj)
		if err != nil {
			return nil, err
		}
		out := &IdentityList{}
		if lm, err := meta.ListAccessor(obj); err == nil {
			out.ResourceVersion = lm.GetResourceVersion()
		}
		for _, o := range items {
			if id, ok := o.(*Identity); ok {
				out.Items = append(out.Items, *id)
			}
		}
		return out, nil
	}
	out := &IdentityList{}
	err := c.rest.Get().Resource(IdentityResource).VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(out)
	return out, err
}

// Watch watches every Identity.
func (c *Client) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	if c.fake != nil {
		return c.fake.InvokesWatch(k8stesting.NewRootWatchAction(IdentityGVR, opts))
	}
	opts.Watch = true
	return c.rest.Get().Resource(IdentityResource).VersionedParams(&opts, metav1.ParameterCodec).Watch(ctx)
}

// failingListWatch reports a client that could not be built on every call,
// so that the informer retries and logs it instead of the process crashing.
type failingListWatch struct{ err error }

func (f *failingListWatch) List(metav1.ListOptions) (runtime.Object, error)   { return nil, f.err }
func (f *failingListWatch) Watch(metav1.ListOptions) (watch.Interface, error) { return nil, f.err }
