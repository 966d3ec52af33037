package v1alpha1

import (
	"context"
	"slices"
	"testing"
	"time"

	k8serrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/apiary-net/apiary/cells/k8s"
	"github.com/apiary-net/apiary/cells/k8s/k8sfake"
)

// TestClientAndInformer drives the client and the kind's informer against
// client-go's fake dynamic client, as the operator and agents do in tests.
func TestClientAndInformer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kinds := k8s.NewKinds()
	if err := k8s.RegisterKind(kinds, IdentityKind); err != nil {
		t.Fatal(err)
	}
	f := k8sfake.New(kinds)
	cs := f.K8s()
	c, err := NewClient(cs)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Create(ctx, NewIdentity(300, []string{"k8s:app=a"})); err != nil {
		t.Fatal(err)
	}

	inf := cache.NewSharedIndexInformer(IdentityKind.ListWatch(cs), &Identity{}, 0, cache.Indexers{})
	go inf.Run(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		t.Fatal("informer did not sync")
	}
	names := func() []string {
		var out []string
		for _, o := range inf.GetStore().List() {
			out = append(out, o.(*Identity).Name)
		}
		slices.Sort(out)
		return out
	}
	waitFor := func(want ...string) {
		t.Helper()
		for !slices.Equal(names(), want) {
			select {
			case <-ctx.Done():
				t.Fatalf("informer has %v, want %v", names(), want)
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	waitFor("300")

	if _, err := c.Create(ctx, NewIdentity(301, []string{"k8s:app=b"})); err != nil {
		t.Fatal(err)
	}
	waitFor("300", "301")
	if _, err := c.Create(ctx, NewIdentity(301, []string{"k8s:app=c"})); !k8serrors.IsAlreadyExists(err) {
		t.Fatalf("creating a taken name: err = %v, want AlreadyExists", err)
	}
	if err := c.Delete(ctx, "300", ""); err != nil {
		t.Fatal(err)
	}
	waitFor("301")
	if err := c.Delete(ctx, "300", ""); !k8serrors.IsNotFound(err) {
		t.Fatalf("deleting a missing name: err = %v, want NotFound", err)
	}

	got := inf.GetStore().List()[0].(*Identity)
	if got.Name != "301" || !slices.Equal(got.SecurityLabels, []string{"k8s:app=b"}) {
		t.Fatalf("informer has %+v", got)
	}
	n, err := got.Number()
	if err != nil || n != 301 {
		t.Fatalf("Number() = %d, %v", n, err)
	}

	// Every call went through the fake's reactors, where tests can count
	// them.
	creates := 0
	for _, a := range f.Dynamic.Fake().Actions() {
		if a.GetVerb() == "create" && a.GetResource() == IdentityGVR {
			creates++
		}
	}
	if creates != 3 {
		t.Errorf("%d create calls recorded, want 3", creates)
	}
}

func TestNumber(t *testing.T) {
	for _, tc := range []struct {
		name string
		want uint32
		ok   bool
	}{
		{"256", 256, true}, {"65535", 65535, true}, {"0256", 0, false}, {"x", 0, false}, {"-1", 0, false}, {"", 0, false},
	} {
		got, err := (&Identity{ObjectMeta: metav1.ObjectMeta{Name: tc.name}}).Number()
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("Number(%q) = %d, %v", tc.name, got, err)
		}
	}
}

func TestDeepCopy(t *testing.T) {
	a := NewIdentity(256, []string{"k8s:a=b"})
	a.Labels = map[string]string{"x": "y"}
	b := a.DeepCopyObject().(*Identity)
	b.SecurityLabels[0] = "changed"
	b.Labels["x"] = "z"
	if a.SecurityLabels[0] != "k8s:a=b" || a.Labels["x"] != "y" {
		t.Fatalf("copy shares memory with the original: %+v", a)
	}
	l := &IdentityList{Items: []Identity{*a}}
	lc := l.DeepCopyObject().(*IdentityList)
	lc.Items[0].SecurityLabels[0] = "changed"
	if l.Items[0].SecurityLabels[0] != "k8s:a=b" {
		t.Fatal("list copy shares memory")
	}
}
