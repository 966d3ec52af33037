// Package v1alpha1 holds the apiary.io/v1alpha1 API: the cluster-scoped
// Identity, which binds a numeric security identity (its name) to a
// security label set. In the operator identity management mode the
// operator is the only writer of Identities and agents only read them; see
// docs/operator.md.
//
// The Go types here are the source of truth: deploy/crds/identities.yaml is
// checked against them by crd_test.go.
package v1alpha1

import (
	"fmt"
	"slices"
	"strconv"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupVersion is apiary.io/v1alpha1.
var GroupVersion = schema.GroupVersion{Group: "apiary.io", Version: "v1alpha1"}

// Names of the Identity resource.
const (
	IdentityKindName = "Identity"
	IdentityResource = "identities"
	IdentitySingular = "identity"
	IdentityListKind = "IdentityList"
)

// IdentityGVR is the group, version and resource of Identities.
var IdentityGVR = GroupVersion.WithResource(IdentityResource)

// Identity is one cluster security identity: metadata.name is the number
// (256–65535, in decimal), SecurityLabels the label set it stands for.
// Identities are never updated: a label set that changes gets another
// Identity, and the old one is collected once no pod uses it.
type Identity struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`

	// SecurityLabels is the sorted label set, each "source:key=value" or
	// "source:key".
	SecurityLabels []string `json:"securityLabels"`
}

// IdentityList is a list of Identities.
type IdentityList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata"`

	Items []Identity `json:"items"`
}

// Number returns the identity number the name holds.
func (i *Identity) Number() (uint32, error) {
	n, err := strconv.ParseUint(i.Name, 10, 32)
	if err != nil || strconv.FormatUint(n, 10) != i.Name {
		return 0, fmt.Errorf("identity name %q is not a decimal number", i.Name)
	}
	return uint32(n), nil
}

// NewIdentity returns the Identity of number id for labels (which must be
// sorted, as tables.Labels are).
func NewIdentity(id uint32, labels []string) *Identity {
	return &Identity{
		TypeMeta:       metav1.TypeMeta{APIVersion: GroupVersion.String(), Kind: IdentityKindName},
		ObjectMeta:     metav1.ObjectMeta{Name: strconv.FormatUint(uint64(id), 10)},
		SecurityLabels: slices.Clone(labels),
	}
}

// DeepCopyInto copies i into out.
func (i *Identity) DeepCopyInto(out *Identity) {
	*out = *i
	out.TypeMeta = i.TypeMeta
	i.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	out.SecurityLabels = slices.Clone(i.SecurityLabels)
}

// DeepCopy returns a copy of i.
func (i *Identity) DeepCopy() *Identity {
	if i == nil {
		return nil
	}
	out := new(Identity)
	i.DeepCopyInto(out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (i *Identity) DeepCopyObject() runtime.Object {
	if c := i.DeepCopy(); c != nil {
		return c
	}
	return nil
}

// DeepCopyInto copies l into out.
func (l *IdentityList) DeepCopyInto(out *IdentityList) {
	*out = *l
	l.ListMeta.DeepCopyInto(&out.ListMeta)
	if l.Items != nil {
		out.Items = make([]Identity, len(l.Items))
		for n := range l.Items {
			l.Items[n].DeepCopyInto(&out.Items[n])
		}
	}
}

// DeepCopy returns a copy of l.
func (l *IdentityList) DeepCopy() *IdentityList {
	if l == nil {
		return nil
	}
	out := new(IdentityList)
	l.DeepCopyInto(out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (l *IdentityList) DeepCopyObject() runtime.Object {
	if c := l.DeepCopy(); c != nil {
		return c
	}
	return nil
}
